"""VerifierGenerateRequest validation (every rejection names its field) and its GenParams."""

from __future__ import annotations


from ddtree.internal.v1 import verifier_pb2 as vpb
from ddtree.v1 import generation_pb2 as pb
from service_kit.errors import InvalidArgument
from service_kit.sampling import check_sampling
from verifier_service.session import AR, CHAIN, DDTREE, GenParams

_MODES = {pb.SPEC_MODE_AR: AR, pb.SPEC_MODE_CHAIN: CHAIN, pb.SPEC_MODE_DDTREE: DDTREE}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_FORCED = 256


def validate(req: vpb.VerifierGenerateRequest, cfg, config) -> None:
    if not req.request_id:
        raise InvalidArgument("request_id", "required")
    if not req.prompt_ids:
        raise InvalidArgument("prompt_ids", "must not be empty")
    bad = next((i for i, t in enumerate(req.prompt_ids) if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt_ids[{bad}]", f"{req.prompt_ids[bad]} is outside [0, {cfg.vocab_size})")
    limit = min(config.max_context, cfg.max_position_embeddings)
    if len(req.prompt_ids) >= limit:
        raise InvalidArgument("prompt_ids", f"{len(req.prompt_ids)} tokens leave no room in the context of {limit}")
    if not 0 <= req.max_new_tokens <= config.max_new_tokens_limit:
        raise InvalidArgument("max_new_tokens", f"must be in [1, {config.max_new_tokens_limit}] (0 = default)")
    check_sampling(req.sampling, cfg.vocab_size)
    sp = req.speculation
    if sp.mode not in (pb.SPEC_MODE_UNSPECIFIED, *_MODES):
        raise InvalidArgument("speculation.mode", f"unknown mode {sp.mode}")
    if sp.HasField("tree_budget") and not 1 <= sp.tree_budget <= config.max_tree_budget:
        raise InvalidArgument("speculation.tree_budget", f"must be in [1, {config.max_tree_budget}], got {sp.tree_budget}")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if req.top_logprobs and not req.return_logprobs:
        raise InvalidArgument("top_logprobs", "needs return_logprobs")
    bad = next((t for t in req.stop_token_ids if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise InvalidArgument("stop_token_ids", f"{bad} is outside [0, {cfg.vocab_size})")
    if not 0 <= req.min_new_tokens <= (req.max_new_tokens or config.max_new_tokens_limit):
        raise InvalidArgument("min_new_tokens", f"must be in [0, max_new_tokens], got {req.min_new_tokens}")
    if req.max_duration_ms < 0:
        raise InvalidArgument("max_duration_ms", f"must be >= 0 (0 = no limit), got {req.max_duration_ms}")
    if len(req.forced_ids) > MAX_FORCED:
        raise InvalidArgument("forced_ids", f"at most {MAX_FORCED} tokens, got {len(req.forced_ids)}")
    for name, ids in (("forced_ids", req.forced_ids),
                      ("forced_after_id", [req.forced_after_id] if req.HasField("forced_after_id") else [])):
        bad = next((t for t in ids if not 0 <= t < cfg.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(name, f"{bad} is outside [0, {cfg.vocab_size})")
    _check_grammar(req, cfg)


def _check_grammar(req: vpb.VerifierGenerateRequest, cfg) -> None:
    """What structured output cannot be combined with (the grammar itself is checked when its matcher is built)."""
    if req.HasField("grammar_after_id") and not 0 <= req.grammar_after_id < cfg.vocab_size:
        raise InvalidArgument("grammar_after_id", f"{req.grammar_after_id} is outside [0, {cfg.vocab_size})")
    if not req.grammar:
        return
    for name, on in (("forced_ids", req.forced_ids), ("min_new_tokens", req.min_new_tokens),
                     ("ignore_eos", req.ignore_eos)):
        if on:  # a forced call is not the grammar's text; a complete answer allows only EOS
            raise InvalidArgument(name, "cannot be combined with a grammar (structured output)")


def to_params(req: vpb.VerifierGenerateRequest, config) -> GenParams:
    s, sp = req.sampling, req.speculation
    return GenParams(
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        max_new_tokens=req.max_new_tokens or min(256, config.max_new_tokens_limit),
        max_duration_s=req.max_duration_ms / 1e3 if req.max_duration_ms > 0 else None,
        stop_token_ids=frozenset(req.stop_token_ids), ignore_eos=req.ignore_eos,
        mode=_MODES.get(sp.mode, config.default_mode),
        tree_budget=sp.tree_budget if sp.HasField("tree_budget") else config.default_tree_budget,
        return_logprobs=req.return_logprobs, top_logprobs=req.top_logprobs,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(s.logit_bias.items())), prompt_logprobs=req.prompt_logprobs,
        forced_ids=tuple(req.forced_ids), min_new_tokens=req.min_new_tokens,
        forced_after=req.forced_after_id if req.HasField("forced_after_id") else None)
