"""Regenerate the committed Python protobuf/gRPC modules from ``proto/fedpart.proto``.

Run ``python proto/generate.py`` after editing the .proto file (needs the ``test`` extra's
pinned ``grpcio-tools``); ``tests/test_proto.py`` fails when the committed code drifts.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
GENERATED = ("fedpart_pb2.py", "fedpart_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the generated modules into ``out_dir``, importable as ``fedpart.proto.*``."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        package_dir = Path(tmp) / "fedpart" / "proto"
        package_dir.mkdir(parents=True)
        shutil.copy(PROTO_DIR / "fedpart.proto", package_dir / "fedpart.proto")
        code = protoc.main([
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            "fedpart/proto/fedpart.proto",
        ])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        for name in GENERATED:
            shutil.copy(package_dir / name, out_dir / name)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR)
