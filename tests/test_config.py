"""Service configuration: flags over environment variables over defaults; validation names the field."""

import argparse

import pytest

from service_kit import config as cfg
from verifier_service.config import VerifierConfig


def parse(argv, monkeypatch=None):
    p = argparse.ArgumentParser()
    cfg.add_arguments(p, VerifierConfig, "DDTREE_VERIFIER")
    return cfg.from_namespace(VerifierConfig, p.parse_args(argv))


def test_defaults_env_and_flags(monkeypatch):
    c = parse(["--model", "m"])
    assert (c.port, c.world_size, c.drafter) == (50052, 1, ())
    monkeypatch.setenv("DDTREE_VERIFIER_PORT", "6000")
    monkeypatch.setenv("DDTREE_VERIFIER_DRAFTER", "a:1,b:2")
    monkeypatch.setenv("DDTREE_VERIFIER_LOG_FORMAT", "console")
    c = parse(["--model", "m"])
    assert (c.port, c.drafter, c.log_format) == (6000, ("a:1", "b:2"), "console")
    c = parse(["--model", "m", "--port", "7000", "--drafter", "x:3"])
    assert (c.port, c.drafter) == (7000, ("x:3",))


def test_bools_and_choices(monkeypatch):
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--dtype", "float64"])
    monkeypatch.setenv("DDTREE_VERIFIER_DEFAULT_MODE", "chain")
    assert parse(["--model", "m"]).default_mode == "chain"


@pytest.mark.parametrize("argv, field", [
    ([], "model"),
    (["--model", "m", "--world-size", "0"], "world_size"),
    (["--model", "m", "--default-tree-budget", "100"], "default_tree_budget"),
    (["--model", "m", "--port", "70000"], "port"),
    (["--model", "m", "--world-size", "2", "--gpus", "0"], "gpus"),
    (["--synthetic", "k27"], "synthetic"),
    (["--model", "m", "--force-accept-depth", "-1"], "force_accept_depth"),
    (["--model", "m", "--torch-threads", "-1"], "torch_threads"),
    (["--model", "m", "--one-shot-all-reduce-kb", "-1"], "one_shot_all_reduce_kb"),
    (["--model", "m", "--busy-poll-ms", "-2"], "busy_poll_ms"),
])
def test_invalid_values_name_the_field(argv, field):
    with pytest.raises(ValueError, match=field):
        parse(argv)


def test_torch_threads_one_on_a_gpu_unless_set():
    """GPU services run torch's host ops on one thread (co-located OpenMP pools spin against each other);
    an explicit count wins; on CPU torch keeps its own default."""
    import torch

    default = torch.get_num_threads()
    try:
        assert cfg.limit_torch_threads("cpu", 0) == default
        assert cfg.limit_torch_threads("cuda:1", 0) == 1 == torch.get_num_threads()
        assert cfg.limit_torch_threads("cuda", 2) == 2
        assert cfg.limit_torch_threads("cpu", 1) == 1
    finally:
        torch.set_num_threads(default)


def test_synthetic_needs_no_checkpoint(capsys):
    c = parse(["--synthetic", "k26-mini", "--synthetic-layers", "3", "--force-accept-depth", "2"])
    assert (c.model, c.synthetic, c.synthetic_layers, c.force_accept_depth) == ("", "k26-mini", 3, 2)
    from drafter_service.config import DrafterConfig
    from service_kit.cli import main

    assert DrafterConfig(synthetic="k26").model == ""
    for bad in (dict(propose_port=70000), dict(propose_port=-2), dict(busy_poll_ms=-0.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DrafterConfig(synthetic="k26", **bad)
    assert DrafterConfig(synthetic="k26", propose_port=-1, busy_poll_ms=-1).propose_port == -1  # off; auto
    with pytest.raises(ValueError, match="model, target_model"):
        DrafterConfig()
    assert main(["drafter", "--synthetic", "k26-mini", "--dry-run"]) == 0
    assert "synthetic='k26-mini'" in capsys.readouterr().out


def test_cli_dry_run_matches_flags(capsys):
    from service_kit.cli import main

    assert main(["drafter", "--model", "d", "--target-model", "t", "--window", "128", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "window=128" in out and "target_model='t'" in out


def test_api_key_stays_out_of_help_and_dry_run(capsys, monkeypatch):
    from service_kit.cli import main

    monkeypatch.setenv("DDTREE_GATEWAY_API_KEY", "sekrit-123")
    with pytest.raises(SystemExit):
        main(["gateway", "--help"])
    assert "DDTREE_GATEWAY_API_KEY" in capsys.readouterr().out
    assert main(["gateway", "--model", "m", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "http_port=8000" in out and "sekrit" not in out
    with pytest.raises(SystemExit):
        main(["gateway", "--help"])
    assert "sekrit" not in capsys.readouterr().out


def test_gateway_command_never_imports_torch():
    """The gateway runs on CPU-only images: `ddtree gateway` must not pull torch in."""
    import subprocess
    import sys

    code = ("import sys; from service_kit.cli import main; "
            "main(['gateway', '--model', 'm', '--dry-run']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False"), out


def test_serve_puts_the_drafter_on_its_own_device():
    """`ddtree serve --device cuda --drafter-device cuda:7`: the drafter gets cuda:7, the verifier cuda."""
    from service_kit import launcher

    parser = argparse.ArgumentParser()
    launcher.add_parser(parser.add_subparsers())
    cmds = dict(launcher.commands(parser.parse_args(["serve", "--model", "models/kimi-tiny", "--device", "cuda",
                                                     "--drafter-device", "cuda:7"])))
    device = lambda cmd: cmd[cmd.index("--device") + 1]  # noqa: E731
    assert device(cmds["drafter"]) == "cuda:7" and device(cmds["verifier"]) == "cuda"
    same = dict(launcher.commands(parser.parse_args(["serve", "--model", "models/kimi-tiny", "--device", "cuda"])))
    assert device(same["drafter"]) == "cuda"


def test_serve_passes_the_drafter_quantization():
    """`ddtree serve --drafter-quantization int8` reaches the drafter's command line, and the drafter's parser
    takes it (none by default)."""
    from drafter_service.config import DrafterConfig
    from service_kit import launcher
    from service_kit.config import add_arguments, from_namespace

    parser = argparse.ArgumentParser()
    launcher.add_parser(parser.add_subparsers())
    for flag, want in ((["--drafter-quantization", "int8"], "int8"), ([], "none")):
        cmds = dict(launcher.commands(parser.parse_args(["serve", "--model", "models/kimi-tiny", *flag])))
        drafter = cmds["drafter"]
        assert drafter[drafter.index("--quantization") + 1] == want
        dparser = argparse.ArgumentParser()
        add_arguments(dparser, DrafterConfig, "DDTREE_DRAFTER")
        args = drafter[drafter.index("drafter") + 1:]
        assert from_namespace(DrafterConfig, dparser.parse_args(args)).quantization == want
