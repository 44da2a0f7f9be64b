"""One direct target forward at world size N through the production rank path (Runner + Control):
run as N processes with torchrun-style env vars; rank 0 writes fp32 logits to argv[3].

    RANK=r WORLD_SIZE=N MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/rank_forward.py MODEL N OUT [split] [cuda]
        [slices=S]

MODEL: a checkpoint directory, or `synthetic:PRESET` (random weights, `--synthetic PRESET`).
"""

import sys

import torch

from verifier_service import ranks
from verifier_service.config import VerifierConfig
from verifier_service.plan import SeqRows, build_plan, chain_parents, tree_parents
from verifier_service.runner import Runner


def plan_for(runner: Runner):
    """A prefill chunk at far-apart positions and a 7-node tree after a 20-token prefix."""
    t = runner.cache.table
    t.open("a")
    t.open("b")
    prompt = [(17 * i + 3) % runner.cfg.vocab_size for i in range(20)]
    slots_a = t.extend("a", 20)
    positions = [0, 9, 4100, 40000, 199000] + list(range(199001, 199016))
    seqs = [SeqRows(prompt, chain_parents(20), 0, t.pages("a"), slots_a, positions=positions)]
    return build_plan(seqs), prompt


def main() -> int:
    model, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    split = "split" in sys.argv[4:]
    device = "cuda" if "cuda" in sys.argv[4:] else "cpu"
    slices = next((int(a.split("=")[1]) for a in sys.argv[4:] if a.startswith("slices=")), 1)
    info = ranks.RankInfo.from_env()
    source = dict(synthetic=model.split(":", 1)[1]) if model.startswith("synthetic:") else dict(model=model)
    config = VerifierConfig(**source, world_size=world, kv_cache_mb=4, page_size=16, dtype="float32",
                            split_replicated=split, device=device, expert_slices=slices)
    runner = Runner(config, info if world > 1 else None)
    if runner.info.rank > 0:
        ranks.worker_loop(runner, runner.control)
        runner.control.close()
        ranks.exit_process(0)
    plan, prompt = plan_for(runner)
    logits = runner.forward(plan).logits
    # second op: a tree verify on top of the committed prefix, exercising the KV copy op too
    t = runner.cache.table
    tree_tokens, tree_par = [5, 6, 7, 8, 9, 10, 11], [0, 0, 1, 1, 2, 3, 5]
    slots = t.scratch("a", 8)
    plan2 = build_plan([SeqRows([42, *tree_tokens], tree_parents(tree_par), 20, t.pages("a"), slots)])
    logits2 = runner.forward(plan2).logits
    runner.cache.commit("a", [0, 1, 3])
    t.scratch("a", 1)
    plan3 = build_plan([SeqRows([99], [-1], 23, t.pages("a"), t.scratch_slots("a"))])
    logits3 = runner.forward(plan3).logits
    torch.save({"prefill": logits.cpu(), "tree": logits2.cpu(), "after_commit": logits3.cpu()}, out)
    runner.shutdown()
    if world > 1:
        ranks.exit_process(0)  # as the server does: no NCCL teardown at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
