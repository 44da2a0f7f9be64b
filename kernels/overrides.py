"""`--set MODULE.FLAG=VALUE` of the bench commands: set one of a kernel module's tuning flags (its upper-case
module constants, e.g. `moe_w4a16.FEW_DOWN_T=8`) for this process, so that an A/B of a kernel variant is a plain
command line that docs/BENCHMARKS.md can quote, not a scratch script.

VALUE is a Python literal (8, 0.5, True, (2, 4), 'slices'); a bare word is taken as a string. A number or bool flag
does not take a string, which catches typos (FEW_DOWN_T=eight). The module's own launch-time asserts check ranges.
"""

from __future__ import annotations

import ast
import importlib

from kernels.cli import MODULES


def parse(setting: str) -> tuple[str, str, object]:
    """'moe_w4a16.FEW_DOWN_T=8' -> ('moe_w4a16', 'FEW_DOWN_T', 8). ValueError names what is wrong."""
    target, eq, text = setting.partition("=")
    module, dot, name = target.strip().rpartition(".")
    if not eq or not dot:
        raise ValueError(f"--set {setting!r}: expected MODULE.FLAG=VALUE, e.g. moe_w4a16.FEW_DOWN_T=8")
    module = module.removeprefix("kernels.")
    if module not in MODULES:
        raise ValueError(f"--set {setting!r}: no kernel module {module!r} (one of {', '.join(MODULES)})")
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = text.strip()
    return module, name, value


def apply(settings: list[str] | None) -> list[str]:
    """Set every flag of `settings` on its module; returns them as 'module.FLAG=repr' for the bench's header. All are
    checked before any is set."""
    parsed = [parse(s) for s in settings or []]
    for (module, name, value), setting in zip(parsed, settings or []):
        mod = importlib.import_module(f"kernels.{module}")
        if not name.isupper() or not hasattr(mod, name):
            flags = sorted(n for n, v in vars(mod).items() if n.isupper() and not n.startswith("_")
                           and isinstance(v, (bool, int, float, str, tuple)))
            raise ValueError(f"--set {setting!r}: kernels.{module} has no flag {name!r} (flags: {', '.join(flags)})")
        old = getattr(mod, name)
        if isinstance(old, (bool, int, float)) and isinstance(value, str):
            raise ValueError(f"--set {setting!r}: {module}.{name} is {old!r}, not a string")
    applied = []
    for module, name, value in parsed:
        setattr(importlib.import_module(f"kernels.{module}"), name, value)
        applied.append(f"{module}.{name}={value!r}")
    return applied
