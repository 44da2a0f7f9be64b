"""`--set MODULE.FLAG=VALUE` of `ddtree bench kernels` / `bench verify` (kernels/overrides.py)."""

import argparse

import pytest

import kernels.moe_w4a16 as moe
import kernels.mla_tree_attention as mla
from kernels import cli, overrides


@pytest.fixture
def restore(monkeypatch):
    """Put back every flag these tests may set (monkeypatch restores what it saw first)."""
    for mod, name in ((moe, "FEW_DOWN_T"), (moe, "FEW_DOWN"), (moe, "DOWN_CAT"), (moe, "FEW_DOWN_CPW")):
        monkeypatch.setattr(mod, name, getattr(mod, name))


@pytest.mark.parametrize("setting,expected", [
    ("moe_w4a16.FEW_DOWN_T=8", ("moe_w4a16", "FEW_DOWN_T", 8)),
    ("kernels.moe_w4a16.FEW_DOWN=False", ("moe_w4a16", "FEW_DOWN", False)),
    ("moe_w4a16.DOWN_CAT=slices", ("moe_w4a16", "DOWN_CAT", "slices")),  # a bare word is a string
    ("moe_w4a16.DOWN_CAT='slices'", ("moe_w4a16", "DOWN_CAT", "slices")),
    (" mla_tree_attention.X = (2, 4) ", ("mla_tree_attention", "X", (2, 4))),
])
def test_parse(setting, expected):
    assert overrides.parse(setting) == expected


def test_apply_sets_the_module_flags(restore):
    applied = overrides.apply(["moe_w4a16.FEW_DOWN_T=8", "moe_w4a16.DOWN_CAT=True"])
    assert (moe.FEW_DOWN_T, moe.DOWN_CAT) == (8, True)
    assert applied == ["moe_w4a16.FEW_DOWN_T=8", "moe_w4a16.DOWN_CAT=True"]
    assert overrides.apply(None) == [] and overrides.apply([]) == []


@pytest.mark.parametrize("setting,message", [
    ("moe_w4a16.FEW_DOWN_T", "expected MODULE.FLAG=VALUE"),
    ("FEW_DOWN_T=8", "expected MODULE.FLAG=VALUE"),
    ("moe.FEW_DOWN_T=8", "no kernel module 'moe'"),
    ("moe_w4a16.FEW_DOWN_TT=8", "has no flag 'FEW_DOWN_TT'"),
    ("moe_w4a16.moe_w4a16_ref=1", "has no flag 'moe_w4a16_ref'"),  # functions are not flags
    ("moe_w4a16.FEW_DOWN_T=eight", "is 2, not a string"),
    ("moe_w4a16.FEW_DOWN=on", "is True, not a string"),
])
def test_bad_settings_name_the_problem_and_set_nothing(setting, message, restore):
    before = (moe.FEW_DOWN_T, moe.FEW_DOWN_CPW)
    with pytest.raises(ValueError, match=message):
        overrides.apply(["moe_w4a16.FEW_DOWN_CPW=2", setting])  # the valid first one is not set either
    assert (moe.FEW_DOWN_T, moe.FEW_DOWN_CPW) == before


def test_unknown_flag_lists_the_module_flags():
    with pytest.raises(ValueError) as e:
        overrides.apply(["mla_tree_attention.NOPE=1"])
    flags = [n for n, v in vars(mla).items() if n.isupper() and not n.startswith("_") and isinstance(v, int)]
    assert flags and all(n in str(e.value) for n in flags)


def test_bench_parsers_take_repeated_set():
    from verifier_service import bench_verify

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_bench_parser(sub)
    bench_verify.add_parser(sub)
    args = parser.parse_args(["kernels", "--only", "moe", "--set", "moe_w4a16.FEW_DOWN_T=8", "--set",
                              "moe_w4a16.FEW_DOWN_PIPE=True"])
    assert args.set == ["moe_w4a16.FEW_DOWN_T=8", "moe_w4a16.FEW_DOWN_PIPE=True"]
    assert parser.parse_args(["verify", "--set", "moe_w4a16.FEW_DOWN=False"]).set == ["moe_w4a16.FEW_DOWN=False"]
    assert parser.parse_args(["verify"]).set is None


def test_bench_parser_rejects_a_malformed_set(capsys):
    parser = argparse.ArgumentParser()
    cli.add_bench_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["kernels", "--set", "moe.FEW_DOWN_T=8"])
    assert "no kernel module 'moe'" in capsys.readouterr().err
