"""Generates the Python gRPC stubs from protos/**/*.proto (run by `make protos`, checked by a test).

Stubs land beside their .proto files (protos/ddtree/...), which setuptools maps to the `ddtree`
package. They are build outputs: git ignores them, nobody edits them.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(root.rglob("*.proto"))


def generate(out_dir: Path = PROTO_ROOT, root: Path = PROTO_ROOT) -> list[Path]:
    """Runs protoc (from grpcio-tools) over every .proto; returns the files written."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc", f"-I{root}", f"-I{include}",
        f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(root)) for p in proto_files(root)],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*") if p.is_file())


if __name__ == "__main__":
    written = generate()
    print(f"generated {len(written)} stub files under {PROTO_ROOT}", file=sys.stderr)
