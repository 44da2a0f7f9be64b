"""Deployment files: the compose GPU layout, health checks, start order and published ports; every
compose command line parses with the real `ddtree` CLI; deploy/ddtree.env lists every config knob."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
from pathlib import Path

import pytest
import yaml

from service_kit import config as cfg
from service_kit.cli import SERVICES, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "docker-compose.yml"
DRAFTERS = DEPLOY / "docker-compose.drafters.yml"
ENV_FILE = DEPLOY / "ddtree.env"
GPUS = 8  # the base file fills one 8-GPU host

ENV_LINE = re.compile(r"^(#?)(DDTREE_[A-Z0-9_]+)=(.*)$")
# Not config fields: compose-side ${...} variables and process-wide ones (deploy/gen_env.py).
EXTRA_VARS = {"DDTREE_MODEL_DIR", "DDTREE_DRAFTER_DIR", "DDTREE_IMAGE", "DDTREE_CPU_IMAGE", "DDTREE_PUBLISH_ADDR",
              "DDTREE_KERNEL_CACHE", "DDTREE_KERNEL_SYNC"}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def all_services() -> dict[str, tuple[str, dict]]:
    """'file:service' -> (file name, service) for both compose files."""
    out = {}
    for path in (BASE, DRAFTERS):
        for name, svc in load(path).items():
            out[f"{path.name}:{name}"] = (path.name, svc)
    return out


def role(svc: dict) -> str:
    return svc["command"][0]


def gpu_ids(svc: dict) -> list[int]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    ids = []
    for d in devices:
        assert d["driver"] == "nvidia" and d["capabilities"] == ["gpu"], d
        assert "count" not in d, "count and device_ids are mutually exclusive; pin GPUs with device_ids"
        ids += [int(i) for i in d["device_ids"]]
    return ids


def env_lines() -> list[tuple[bool, str, str]]:
    """(active, name, value) for every `DDTREE_X=v` / `#DDTREE_X=v` line of ddtree.env."""
    out = []
    for line in ENV_FILE.read_text().splitlines():
        if m := ENV_LINE.match(line):
            out.append((m[1] == "", m[2], m[3]))
    return out


def config_of(argv: list[str], monkeypatch):
    """The config object a container gets: its command line over ddtree.env over the defaults."""
    for name in [n for n in os.environ if n.startswith("DDTREE_")]:
        monkeypatch.delenv(name)
    for active, name, value in env_lines():
        if active:
            monkeypatch.setenv(name, value)
    config_module, class_name, _, _ = SERVICES[argv[0]]
    klass = getattr(importlib.import_module(config_module), class_name)
    return cfg.from_namespace(klass, build_parser(argv).parse_args(argv))


def seconds(duration: str) -> float:
    """Compose duration ('90s', '1m30s', '2h') -> seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    return sum(float(a) * units[b] for a, b in parts)


def health_name(role_name: str) -> str:
    from ddtree.internal.v1 import drafter_pb2, verifier_pb2
    from ddtree.v1 import generation_pb2

    desc = {"gateway": (generation_pb2, "Generation"), "verifier": (verifier_pb2, "Verifier"),
            "drafter": (drafter_pb2, "Drafter")}[role_name]
    return desc[0].DESCRIPTOR.services_by_name[desc[1]].full_name


# ---- GPU layout ----

def test_base_gpu_layout(monkeypatch):
    services = load(BASE)
    assert set(services) == {"gateway", "verifier", "drafter"}
    assert gpu_ids(services["drafter"]) == [0]
    assert gpu_ids(services["verifier"]) == list(range(1, 8))
    assert gpu_ids(services["gateway"]) == []
    verifier = config_of(services["verifier"]["command"], monkeypatch)
    assert verifier.world_size == 7 == len(gpu_ids(services["verifier"]))
    assert verifier.device == "cuda" and verifier.dtype == "bfloat16"
    assert verifier.gpus in ((), tuple(range(7)))  # container-local indices of its 7 GPUs
    assert verifier.drafter == ("dns:///drafters:50053",)
    drafter = config_of(services["drafter"]["command"], monkeypatch)
    assert (drafter.device, drafter.dtype) == ("cuda", "bfloat16")


def test_gpu_sets_are_disjoint_across_both_files():
    owner: dict[int, str] = {}
    for key, (_, svc) in all_services().items():
        ids = gpu_ids(svc)
        if role(svc) == "drafter":
            assert len(ids) == 1, f"{key}: a drafter replica is one GPU"
        for i in ids:
            assert i not in owner, f"GPU {i} given to both {owner[i]} and {key}"
            owner[i] = key
    assert set(range(GPUS)) <= set(owner), "the base file uses all 8 GPUs of the host"


def test_extra_drafters_are_the_base_drafter_on_other_gpus():
    base = load(BASE)["drafter"]
    extra = load(DRAFTERS)
    assert extra and all(name.startswith("drafter-") for name in extra)
    strip = lambda s: {k: v for k, v in s.items() if k != "deploy"}  # noqa: E731
    for name, svc in extra.items():
        assert strip(svc) == strip(base), f"{name} differs from the base drafter (other than its GPU)"
        assert svc["networks"]["default"]["aliases"] == ["drafters"]
    assert base["networks"]["default"]["aliases"] == ["drafters"]


# ---- health, start order, ports, lifecycle ----

@pytest.mark.parametrize("key", sorted(all_services()))
def test_every_service_has_a_grpc_health_check(key, monkeypatch):
    _, svc = all_services()[key]
    hc = svc["healthcheck"]
    assert hc["test"][:3] == ["CMD", "ddtree", "health"]
    argv = hc["test"][2:]
    args = build_parser(argv).parse_args(argv)  # the CLI must accept these flags
    config = config_of(svc["command"], monkeypatch)
    assert args.address == f"localhost:{config.port}"
    assert args.service == health_name(role(svc)), "probe readiness (the service name), not just liveness"
    assert "start_interval" not in hc, "compose 1.29 does not know start_interval"
    assert seconds(hc["timeout"]) > args.timeout_s
    assert hc["retries"] >= 3 and seconds(hc["interval"]) <= 30
    floor = {"verifier": 30 * 60, "drafter": 5 * 60, "gateway": 60}[role(svc)]
    assert seconds(hc["start_period"]) >= floor, "loading 594 GB of weights takes minutes"


def test_start_order():
    services = load(BASE)
    assert services["gateway"]["depends_on"] == {"verifier": {"condition": "service_healthy"}}
    for key, (_, svc) in all_services().items():
        if role(svc) != "gateway":
            assert "depends_on" not in svc, f"{key}: verifier and drafters start independently"


def test_only_the_gateway_publishes_ports(monkeypatch):
    for key, (_, svc) in all_services().items():
        config = config_of(svc["command"], monkeypatch)
        if role(svc) != "gateway":
            assert "ports" not in svc, f"{key} must stay on the compose network"
            assert {str(config.port), str(config.metrics_port)} <= set(map(str, svc["expose"]))
            continue
        published = {int(p.rsplit(":", 2)[-2]): int(p.rsplit(":", 1)[-1]) for p in svc["ports"]}
        assert published == {p: p for p in (config.port, config.http_port, config.metrics_port)}
        assert config.metrics_port != 0 and config.http_port != 0


@pytest.mark.parametrize("key", sorted(all_services()))
def test_lifecycle_and_runtime(key, monkeypatch):
    _, svc = all_services()[key]
    config = config_of(svc["command"], monkeypatch)
    assert svc["restart"] == "unless-stopped"
    assert svc["init"] is True
    assert seconds(svc["stop_grace_period"]) > config.drain_timeout_s + config.grace_s, \
        "compose would SIGKILL before the drain finishes"
    assert svc["env_file"] == "ddtree.env"
    if gpu_ids(svc):
        assert svc["ipc"] == "host"
        assert svc["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


@pytest.mark.parametrize("key", sorted(all_services()))
def test_models_are_mounted_read_only(key, monkeypatch):
    _, svc = all_services()[key]
    config = config_of(svc["command"], monkeypatch)
    mounts = {}
    for v in svc["volumes"]:
        source, target, *mode = v.rsplit(":", 2) if v.startswith("${") else v.split(":")
        mounts[target] = (source, mode)
    wanted = {"/models/target": "DDTREE_MODEL_DIR"}
    if role(svc) == "drafter":
        wanted["/models/drafter"] = "DDTREE_DRAFTER_DIR"
    for target, var in wanted.items():
        source, mode = mounts[target]
        assert source.startswith("${" + var + ":?") and mode == ["ro"], f"{key}: {target} from {source} {mode}"
    model_dirs = [config.model] + ([config.target_model] if role(svc) == "drafter" else [])
    assert all(d in wanted for d in model_dirs)


# ---- the commands are real command lines ----

def assert_exact_flags(argv: list[str]) -> None:
    """argparse accepts unambiguous prefixes (`--world` for `--world-size`), so a renamed flag could
    still parse: every flag must be spelled exactly as the subcommand defines it."""
    parser = build_parser(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    for arg in argv[1:]:
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] in sub._option_string_actions, f"`ddtree {argv[0]}` has no flag {arg}"


@pytest.mark.parametrize("key", sorted(all_services()))
def test_compose_command_parses_with_the_cli(key, monkeypatch, capsys):
    """`ddtree <command> --dry-run` with ddtree.env's values: a renamed or removed flag fails here."""
    _, svc = all_services()[key]
    assert_exact_flags(svc["command"])
    assert_exact_flags(svc["healthcheck"]["test"][2:])
    config = config_of(svc["command"], monkeypatch)  # also sets ddtree.env's active values in the environment
    assert main(svc["command"] + ["--dry-run"]) == 0
    assert f"port={config.port}," in capsys.readouterr().out


# ---- ddtree.env ----

def config_fields() -> dict[str, object]:
    """Every DDTREE_* variable the three services read -> its default."""
    out = {}
    for config_module, class_name, _, prefix in SERVICES.values():
        klass = getattr(importlib.import_module(config_module), class_name)
        for f in dataclasses.fields(klass):
            out[cfg.env_name(prefix, f.name)] = f.default
    return out


def test_env_file_lists_every_config_field():
    documented = {name for _, name, _ in env_lines()}
    missing = sorted(set(config_fields()) - documented)
    assert not missing, f"not in deploy/ddtree.env: {missing} (run .venv/bin/python deploy/gen_env.py)"
    unknown = sorted(documented - set(config_fields()) - EXTRA_VARS)
    assert not unknown, f"deploy/ddtree.env names variables no service reads: {unknown}"
    names = [name for _, name, _ in env_lines()]
    assert len(names) == len(set(names)), "a variable appears twice"


def env_comments() -> dict[str, str]:
    """Variable -> the comment block right above it, as one line."""
    out = {}
    for block in ENV_FILE.read_text().split("\n\n"):
        lines = block.strip().splitlines()
        if lines and (m := ENV_LINE.match(lines[-1])):
            out[m[2]] = " ".join(ln.lstrip("#").strip() for ln in lines[:-1])
    return out


def test_env_file_shows_the_real_defaults():
    fields, comments = config_fields(), env_comments()
    for active, name, value in env_lines():
        if name not in fields:
            continue
        default = fields[name]
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        if isinstance(default, bool):
            shown = shown.lower()  # booleans are written as the flags take them: true / false
        assert f"Default: {shown or '(empty)'}." in comments[name], f"{name}: the comment misstates the default"
        if not active:
            assert value == shown, f"{name}: shows {value!r}, the default is {shown!r}"


def test_env_file_values_are_valid(monkeypatch):
    """Every active value converts and validates (each service parses with the whole file set)."""
    for name, svc in load(BASE).items():
        config_of(svc["command"], monkeypatch)


# ---- image ----

def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    first_from = next(i for i, ln in enumerate(lines) if ln.startswith("FROM "))
    assert any(ln.startswith("ARG BASE_IMAGE=nvidia/cuda:") and "runtime" in ln for ln in lines[:first_from])
    assert lines[first_from] == "FROM ${BASE_IMAGE}"
    assert 'ENTRYPOINT ["ddtree"]' in lines
    user = next(ln for ln in reversed(lines) if ln.startswith("USER "))
    assert user.split()[1].split(":")[0] not in ("root", "0")
    assert "python -m service_kit.protogen" in text and "pip install --no-deps ." in text
    assert not re.search(r"^(COPY|ADD)\b.*(safetensors|models)", text, re.M), "weights are mounted, not baked in"
    # The kernels read their .cu sources next to the modules: the image must carry them.
    packaged = re.search(r'kernels\s*=\s*\[[^\]]*\.cu', (ROOT / "pyproject.toml").read_text())
    assert packaged or "cp kernels/*.cu kernels/*.cuh" in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "protos/**/*_pb2.py"} <= set(ignore)
