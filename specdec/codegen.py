"""Regenerate the protobuf/gRPC stubs from proto/: ``python -m specdec.codegen [--out DIR]``.

The stubs are committed (so the services run without a build step); tests/unit/test_proto.py
regenerates them into a temporary folder and fails when the committed copies are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILES = sorted(p.relative_to(PROTO_DIR).as_posix() for p in PROTO_DIR.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc over every file in proto/ into ``out``; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    stems = [out / name[: -len(".proto")] for name in PROTO_FILES]
    return [stem.with_name(stem.name + suffix) for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    written = generate(parser.parse_args().out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
