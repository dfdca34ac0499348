"""Build hook: the gRPC code is generated from protos/ into the build, never committed.

Everything else about the distribution is in pyproject.toml.
"""

from __future__ import annotations

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PROTOS = "protos"


class BuildPyWithProtos(build_py):
    """build_py, then the protobuf compiler writes specdec/v1 (messages, stubs, type stubs) into the build."""

    def run(self) -> None:
        super().run()
        from grpc_tools import protoc  # a build requirement (pyproject.toml)

        sources = sorted(glob.glob(os.path.join(PROTOS, "specdec", "v1", "*.proto")))
        if not sources:
            raise SystemExit(f"no .proto files under {PROTOS}/specdec/v1")
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        out = self.build_lib
        code = protoc.main(
            ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
             f"--pyi_out={out}", *sources]
        )  # fmt: skip
        if code != 0:
            raise SystemExit(f"the protobuf compiler failed ({code}) on {', '.join(sources)}")
        for package in ("specdec", os.path.join("specdec", "v1")):
            init = os.path.join(out, package, "__init__.py")
            if not os.path.exists(init):
                with open(init, "w") as handle:
                    handle.write('"""Generated from protos/ at build time."""\n')


setup(cmdclass={"build_py": BuildPyWithProtos})
