"""One frozen dataclass per service, filled from CLI flags with environment-variable fallback.

A field's metadata carries its help text; the flag is `--field-name`, the variable is
`<PREFIX>_FIELD_NAME` (e.g. DDTREE_VERIFIER_PORT). Precedence: flag > variable > default.
Tuple fields are repeatable flags (and comma-separated variables).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field


def option(default, help: str, *, choices: tuple | None = None, secret: bool = False):
    """A config field; a `secret` one is left out of the printed config (`--dry-run`, logs)."""
    return field(default=default, repr=not secret, metadata={"help": help, "choices": choices})


def _field_type(cls, f: dataclasses.Field):
    return typing.get_type_hints(cls)[f.name]


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(tp, text: str):
    if tp is bool:
        return _parse_bool(text)
    return tp(text)


def env_name(prefix: str, name: str) -> str:
    return f"{prefix}_{name.upper()}"


def add_arguments(parser: argparse.ArgumentParser, cls, env_prefix: str) -> None:
    """Adds one flag per dataclass field; defaults come from the environment when set there."""
    for f in dataclasses.fields(cls):
        tp = _field_type(cls, f)
        flag = "--" + f.name.replace("_", "-")
        var = env_name(env_prefix, f.name)
        shown = "%(default)s" if f.repr else "hidden"  # a secret's value (from the variable) stays out of --help
        help_text = f"{f.metadata.get('help', '')} [env {var}; default {shown}]"
        raw = os.environ.get(var)
        if typing.get_origin(tp) is tuple:
            item = typing.get_args(tp)[0]
            default = tuple(_convert(item, x) for x in raw.split(",") if x) if raw else f.default
            parser.add_argument(flag, dest=f.name, action="append", type=item, default=None, help=help_text)
            parser.set_defaults(**{f"_default_{f.name}": default})
            continue
        default = _convert(tp, raw) if raw is not None else f.default
        kwargs = dict(dest=f.name, default=default, help=help_text, choices=f.metadata.get("choices"))
        if tp is bool:
            kwargs["type"] = _parse_bool
            kwargs["metavar"] = "{true,false}"
        else:
            kwargs["type"] = tp
        parser.add_argument(flag, **kwargs)


def from_namespace(cls, ns: argparse.Namespace):
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(ns, f.name)
        if value is None and hasattr(ns, f"_default_{f.name}"):
            value = getattr(ns, f"_default_{f.name}")
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def limit_torch_threads(device: str, threads: int) -> int:
    """Sets the threads of torch's CPU ops in a service on `device` and returns them: `threads` when > 0;
    else 1 on a GPU (its host tensors are a few rows, and the OpenMP pools of the services sharing a host
    spin against each other: on a 32-core H200 host a bf16 DDTree-32 stream went from 546 to 885 tok/s
    with one thread per service) and torch's default on CPU (which follows OMP_NUM_THREADS)."""
    import torch  # only the torch services call this; the gateway has no torch

    if threads > 0 or device != "cpu":
        torch.set_num_threads(threads if threads > 0 else 1)
    return torch.get_num_threads()


@dataclass(frozen=True)
class ServerConfig:
    """Knobs every gRPC service shares; each service's config extends it."""

    host: str = option("0.0.0.0", "address to bind")
    port: int = option(0, "gRPC port")
    metrics_port: int = option(0, "Prometheus /metrics HTTP port (0 = off)")
    grace_s: float = option(5.0, "seconds in-flight RPCs get after drain before the server stops")
    drain_timeout_s: float = option(30.0, "on SIGTERM, seconds to wait for in-flight streams to finish")
    max_message_mb: int = option(64, "largest gRPC message accepted or sent, MiB")
    log_level: str = option("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = option("json", "log line format", choices=("json", "console"))

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if self.max_message_mb <= 0:
            raise ValueError("max_message_mb: must be positive")
