"""Log lines stay whole when several processes share one stderr (the orchestrator's --workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_WRITER = """
import structlog
from serving.log_setup import configure_logging

configure_logging()
log = structlog.get_logger()
for i in range(400):
    log.info("line", worker=WORKER, index=i, padding="x" * 300)
"""


def test_processes_sharing_stderr_write_whole_json_lines(tmp_path: Path):
    """Unbuffered, as the image runs (PYTHONUNBUFFERED=1), several writers on one file: every line is
    one JSON object (print() once wrote a line and its newline apart, and two workers' lines ran
    together in the workers test)."""
    log = tmp_path / "shared.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with open(log, "wb") as out:
        writers = [
            subprocess.Popen(
                [sys.executable, "-c", _WRITER.replace("WORKER", str(worker))], stderr=out, stdout=out, env=env
            )
            for worker in range(4)
        ]
        for writer in writers:
            assert writer.wait(60) == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 4 * 400
    seen = {(entry["worker"], entry["index"]) for entry in map(json.loads, lines)}
    assert len(seen) == 4 * 400
