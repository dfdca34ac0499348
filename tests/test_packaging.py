"""`pip install` of the built wheel: one distribution with the generated gRPC code, console scripts and
the default pair, usable from outside the checkout with no network."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["specdec-target", "specdec-draft", "specdec-orchestrator", "specdec-client", "specdec-local"]


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}: {result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_the_wheel_installs_and_serves_from_outside_the_checkout(tmp_path):
    # Build from a copy of the tracked files, so that the checkout gets no build/ folder.
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    build = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w"]
    _run([*build, str(tmp_path / "dist")], source, env)
    wheel = next((tmp_path / "dist").glob("specdec-*.whl"))

    # A fresh environment whose dependencies come from the ones already installed (no network).
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=False)  # installed into by this pip (`--python`): no ensurepip, seconds saved
    python = environment / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env)
    (Path(purelib.strip()) / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    _run([*install, str(wheel)], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for script in SCRIPTS:
        assert "usage" in _run([str(environment / "bin" / script), "--help"], elsewhere, env)
    where = "import specdec.v1.orchestrator_pb2 as m; print(m.__file__)"
    location = _run([str(python), "-c", where], elsewhere, env)
    assert str(environment) in location and str(ROOT) not in location
    # A real generation through the installed commands, on the shipped default pair.
    local = [str(environment / "bin" / "specdec-local"), "--max-new-tokens", "8"]
    output = _run(local, elsewhere, {**env, "HF_HUB_OFFLINE": "1"})
    assert "speed-up over the target alone" in output and "outputs identical" in output
