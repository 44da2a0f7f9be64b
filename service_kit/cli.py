"""`ddtree` command line: start one service, the whole local stack, a streaming client, or tools.

Service modules are imported only by the subcommand that needs them, so `ddtree gateway` never
imports torch.
"""

from __future__ import annotations

import argparse
import sys

from service_kit import config as cfg

SERVICES = {
    # subcommand: (config module, config class, server module, env prefix)
    "gateway": ("gateway.config", "GatewayConfig", "gateway.server", "DDTREE_GATEWAY"),
    "verifier": ("verifier_service.config", "VerifierConfig", "verifier_service.server", "DDTREE_VERIFIER"),
    "drafter": ("drafter_service.config", "DrafterConfig", "drafter_service.server", "DDTREE_DRAFTER"),
}


TOOLS = ("kernels", "bench", "health", "make-tiny")


def _import(module: str):
    import importlib
    return importlib.import_module(module)


def _service_parser(sub, name: str) -> None:
    config_module, class_name, _, prefix = SERVICES[name]
    p = sub.add_parser(name, help=f"start the {name} service")
    cfg.add_arguments(p, getattr(_import(config_module), class_name), prefix)
    p.add_argument("--dry-run", action="store_true", help="print the parsed configuration and exit")
    p.set_defaults(func=_run_service, service=name)


def _run_service(args) -> int:
    config_module, class_name, server_module, _ = SERVICES[args.service]
    config = cfg.from_namespace(getattr(_import(config_module), class_name), args)
    if args.dry_run:
        print(config)
        return 0
    return _import(server_module).main(config)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv else None
    for name in SERVICES:
        # Building a service parser imports its config module; only do it for the chosen one
        # (and for --help listings) so `ddtree gateway` stays torch-free.
        if wanted in (name, None, "-h", "--help"):
            _service_parser(sub, name)
        else:
            sub.add_parser(name, help=f"start the {name} service")
    from service_kit import launcher, client, tools
    launcher.add_parser(sub)
    client.add_parser(sub)
    if wanted in SERVICES:  # tools import torch at parser-build time: list them without building
        for name in TOOLS:
            sub.add_parser(name)
    else:
        tools.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
