"""The checks of a public `SamplingParams`, shared by the gateway (public requests) and the verifier (its own
requests, which may come from other callers). Every rejection names its field."""

from __future__ import annotations

import math

from ddtree.v1 import generation_pb2 as pb
from service_kit.errors import InvalidArgument

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|: OpenAI's range
MAX_REPETITION_PENALTY = 10.0
MAX_BIAS = 100.0  # |logit_bias value|: OpenAI's range
MAX_BIAS_ENTRIES = 1024


def check_sampling(s: pb.SamplingParams, vocab_size: int) -> None:
    if s.HasField("temperature") and not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise InvalidArgument("sampling.temperature", f"must be a finite number >= 0, got {s.temperature}")
    if s.HasField("top_p") and not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    if s.HasField("min_p") and not 0.0 <= s.min_p <= 1.0:  # NaN fails both comparisons
        raise InvalidArgument("sampling.min_p", f"must be in [0, 1], got {s.min_p}")
    if s.HasField("top_k") and s.top_k < 0:
        raise InvalidArgument("sampling.top_k", f"must be >= 0, got {s.top_k}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if s.HasField(name) and not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails both comparisons
            raise InvalidArgument(f"sampling.{name}", f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if s.HasField("repetition_penalty") and not 0.0 < s.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidArgument("sampling.repetition_penalty",
                              f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {s.repetition_penalty}")
    if len(s.logit_bias) > MAX_BIAS_ENTRIES:
        raise InvalidArgument("sampling.logit_bias", f"at most {MAX_BIAS_ENTRIES} entries, got {len(s.logit_bias)}")
    for token, bias in s.logit_bias.items():
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"sampling.logit_bias[{token}]", f"token id outside [0, {vocab_size})")
        if not -MAX_BIAS <= bias <= MAX_BIAS:
            raise InvalidArgument(f"sampling.logit_bias[{token}]",
                                  f"must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
