"""Shared helpers and session fixtures for the verifier-core tests (tiny random K2.6-format targets).

Test modules import the fixtures they use (`from model_fixtures import tiny_dir, ...`) so pytest
registers them there; there is no conftest.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from verifier_service.kv_cache import PagedKVCache
from verifier_service.model import ForwardOutput, K2Model
from verifier_service.model_config import K2Config
from verifier_service.plan import SeqRows, build_plan, chain_parents
from verifier_service.tiny_checkpoint import write_tiny_target
from verifier_service.weights import load_target_weights

VOCAB, BOS, EOS = 512, 1, [2, 3]
GROUPED = {"n_group": 4, "topk_group": 2, "num_hidden_layers": 5}  # exercises group-limited routing


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core box OpenMP spin-waits
    turn a 0.4 s test into 40 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_target(out_dir: Path, overrides: dict | None = None, seed: int = 0) -> Path:
    with one_thread():
        write_tiny_target(out_dir, vocab_size=VOCAB, bos_token_id=BOS, eos_token_ids=EOS, seed=seed,
                          overrides=overrides)
    return out_dir


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> K2Model:
    cfg = K2Config.from_json(model_dir)
    return K2Model(cfg, load_target_weights(model_dir, cfg, dtype=dtype))


def new_cache(model: K2Model, num_pages: int = 512, page_size: int = 4) -> PagedKVCache:
    cfg = model.cfg
    return PagedKVCache(num_layers=cfg.num_hidden_layers, width=cfg.kv_cache_width, num_pages=num_pages,
                        page_size=page_size, dtype=model.dtype)


def prefill(model: K2Model, cache: PagedKVCache, sid: str, tokens: Sequence[int], *,
            positions: Sequence[int] | None = None, explicit: bool = True,
            target_layer_ids: Sequence[int] = ()) -> ForwardOutput:
    """Append `tokens` to session `sid` (opened on first use) as one causal chunk."""
    if sid not in cache.table.sessions():
        cache.table.open(sid)
    start = cache.table.length(sid)
    slots = cache.table.extend(sid, len(tokens))
    seq = SeqRows(list(tokens), chain_parents(len(tokens)), start, cache.table.pages(sid), slots, positions)
    return model.forward(build_plan([seq], explicit_mla=explicit), cache.kv, target_layer_ids)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def grouped_dir(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("grouped_target"), GROUPED, seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> K2Model:
    return load_model(tiny_dir)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Every test module importing this runs single-threaded (see `one_thread`); restored after."""
    with one_thread():
        yield
