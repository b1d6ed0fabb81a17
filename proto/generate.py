"""Regenerate the Python stubs from the .proto files: `python -m hydrafl.proto.generate`.

Needs grpcio-tools (a build-time tool, not a runtime dependency). The stubs are committed so a site or
coordinator never needs protoc.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent


def generate() -> list[Path]:
    sources = sorted(PROTO_ROOT.glob("hydrafl/proto/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as out:
        for source in sources:
            code = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{PROTO_ROOT}",
                    f"-I{include}",
                    f"--python_out={out}",
                    f"--pyi_out={out}",
                    f"--grpc_python_out={out}",
                    str(source.relative_to(PROTO_ROOT)),
                ]
            )
            if code != 0:
                raise RuntimeError(f"protoc failed on {source} (exit {code})")
        for generated in sorted((Path(out) / "hydrafl" / "proto").iterdir()):
            shutil.copy(generated, PROTO_ROOT / generated.name)
            written.append(PROTO_ROOT / generated.name)
    return written


if __name__ == "__main__":
    for path in generate():
        print(path)
