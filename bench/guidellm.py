"""`python -m bench.guidellm`: guidellm, the vLLM project's load tool, against the gateway.

guidellm's synthetic benchmark sends `ignore_eos: true` with every request, so that outputs have the
lengths it asked for; a gateway that refuses the field fails every request. This starts the default
pair behind the gateway and runs `guidellm run` on /v1/completions with synthetic prompts, then reports
how many requests completed, errored or were cut short, and whether every output had its asked length.

guidellm is not a dependency of specdec (it pins its own stack): `make guidellm-bench` installs it into
a virtual environment of its own and passes `--guidellm` here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.gateway import running_gateway
from tools.local_stack import DEFAULT_PAIR, LOOPBACK, LocalStack


def run_guidellm(executable: str, base_url: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One `guidellm run` at fixed concurrency; its JSON report."""
    report = out / "guidellm.json"
    command = [
        executable, "run",
        "--backend", f"kind=openai_http,target={base_url},request_format=/v1/completions",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=huggingface_auto,model={DEFAULT_PAIR / 'target'}",
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    subprocess.run(command, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return dict(json.loads(report.read_text()))


def summarise(report: dict[str, Any], output_tokens: int) -> dict[str, Any]:
    """Requests completed, errored and incomplete, and the completed ones' output lengths."""
    totals: dict[str, Any] = {"successful": 0, "errored": 0, "incomplete": 0, "output_lengths": []}
    for benchmark in report.get("benchmarks", []):
        requests = benchmark.get("requests", {})
        for status in ("successful", "errored", "incomplete"):
            items = requests.get(status, [])
            totals[status] += len(items)
            if status == "successful":
                totals["output_lengths"] += [item.get("output_tokens") for item in items]
    lengths = totals.pop("output_lengths")
    totals["outputs_of_the_asked_length"] = sum(1 for n in lengths if n == output_tokens)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.guidellm", description=__doc__)
    parser.add_argument("--guidellm", default=shutil.which("guidellm"), help="the guidellm executable")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if not args.guidellm:
        print("guidellm is not installed: `make guidellm-bench` installs it in a virtual environment of its own")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with (
        LocalStack(str(DEFAULT_PAIR / "target"), str(DEFAULT_PAIR / "draft")) as stack,
        running_gateway(stack.orchestrator_address) as (port, _),
        tempfile.TemporaryDirectory() as scratch,
    ):
        report = run_guidellm(args.guidellm, f"http://{LOOPBACK}:{port}", Path(scratch), args)
    totals = summarise(report, args.output_tokens)
    print(f"guidellm against the gateway, {args.streams} streams, {args.requests} requests: {json.dumps(totals)}")
    (args.out / "guidellm-latest.json").write_text(json.dumps(totals, indent=2) + "\n")
    return 0 if totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] else 1


if __name__ == "__main__":
    sys.exit(main())
