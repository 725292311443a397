"""Build hook: generates the gRPC stubs of ``proto/brigade/v1/*.proto`` with grpcio-tools.

The stubs are never committed: each wheel build writes them to ``src/brigade_client/_proto``
(git-ignored) from the repository's ``proto/`` (or an sdist's copy of it).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# grpcio-tools writes absolute imports (`from brigade.v1 import common_pb2`), which would need a
# top-level `brigade` package; the stubs live inside brigade_client, so they import each other
# relatively. protoc has no option for this, hence the one rewrite below.
_ABSOLUTE_IMPORT = re.compile(r"^from brigade\.v1 import ", re.MULTILINE)


def find_proto_root(root: Path) -> Path:
    """The folder holding ``brigade/v1/*.proto``: an sdist's ``proto/``, else the repository's."""
    for candidate in (root / "proto", root.parent.parent / "proto"):
        if (candidate / "brigade" / "v1" / "client.proto").is_file():
            return candidate
    raise RuntimeError(f"no brigade/v1/client.proto under {root / 'proto'} or {root.parent.parent / 'proto'}")


def generate(proto_root: Path, out: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) over every .proto; returns the files written to ``out``."""
    from grpc_tools import protoc  # a build requirement only

    protos = sorted((proto_root / "brigade" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {len(protos)} files under {proto_root}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        written = [out / "__init__.py"]
        written[0].write_text('"""gRPC stubs generated from proto/brigade/v1 at build time."""\n')
        for f in sorted((Path(tmp) / "brigade" / "v1").iterdir()):
            if f.suffix in (".py", ".pyi"):
                dest = out / f.name
                dest.write_text(_ABSOLUTE_IMPORT.sub("from . import ", f.read_text()))
                written.append(dest)
    return written


class ProtoBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        generate(find_proto_root(root), root / "src" / "brigade_client" / "_proto")
