"""Generate the Python stubs for ``layertap.v1`` from ``proto/layertap/v1``.

Run ``python proto/generate.py`` after editing a ``.proto`` file. The output is
committed under ``client/v1``; ``tests/test_proto_fresh.py`` regenerates into a
temporary folder and byte-compares, so stale stubs fail CI.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "layertap" / "v1"
DEFAULT_OUT = PROTO_ROOT.parent / "client" / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Compile every ``.proto`` into ``out_dir``; return the files written."""

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    plugins = []
    for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc"):
        # mypy-protobuf's plugins sit beside this interpreter, which need not be on PATH.
        exe = Path(sys.executable).parent / name
        found = str(exe) if exe.exists() else shutil.which(name)
        if found is None:
            raise RuntimeError(f"{name} not found: pip install mypy-protobuf")
        plugins.append(f"--plugin={name}={found}")
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            *plugins,
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        produced = Path(tmp) / "layertap" / "v1"
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted(produced.iterdir()):
            dst = out_dir / src.name
            shutil.copyfile(src, dst)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC stubs for the layertap.v1 API. Do not edit."""\n')
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
