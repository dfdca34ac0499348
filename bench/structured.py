"""Structured outputs: what the constraint library costs, and speculation under constraints.

    python -m bench.structured [--reps 3] [--streams 1,16]

- `masks`: llguidance's mask time per token along JSON outputs (the services' `SessionConstraint.allowed`,
  unpacking included) at the default pair's vocabulary and at a synthetic 128k byte-level vocabulary,
  and a rollback as deep as the whole output.
- `outputs`: the default pair over held-out schemas (nested objects, arrays, enums, bounded numbers,
  optional fields), greedy and sampled: how many outputs end in EOS and validate, how many hit LENGTH.
- `speed`: prompts asking for JSON, the target alone and `load_aware` with and without the schema,
  interleaved; acceptance per position. And the mask's own cost: a regex that allows every token gives
  the unconstrained outputs through the masking path, so the difference in time is the masking.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import jsonschema  # type: ignore[import-untyped]
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from serving.constraints import ConstraintSpec, Grammars
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from tools.local_stack import LocalStack

PAIR = Path("default_models/pair")
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 16},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array of enums": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["int", "str", "list", "dict"]}, "minItems": 1, "maxItems": 4}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "bounded numbers": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "n": {"type": "integer", "minimum": 0, "maximum": 255},
        },
        "required": ["x", "n"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "maxLength": 24},
            "mode": {"enum": ["r", "w", "a"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 4096},
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    "unbounded strings": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "doc": {"type": "string"}},
        "required": ["name", "doc"],
        "additionalProperties": False,
    },
}
PROMPTS = [
    "# The settings, as JSON\nconfig = ",
    "def load():\n    return json.loads('",
    "# response body\nbody = ",
    "data = ",
]


def synthetic_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level vocabulary of `vocab` tokens: the 256 bytes, then random strings of 2 to 8 of them."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    generator = torch.Generator().manual_seed(0)
    entries = {char: i for i, char in enumerate(sorted(alphabet))}
    letters = sorted(alphabet)
    while len(entries) < vocab - 1:
        length = int(torch.randint(2, 9, (1,), generator=generator))
        word = "".join(letters[int(i)] for i in torch.randint(0, len(letters), (length,), generator=generator))
        entries.setdefault(word, len(entries))
    entries["<eos>"] = len(entries)
    tokenizer = Tokenizer(models.BPE(vocab=entries, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def masks(reps: int) -> dict[str, Any]:
    """Mean microseconds of one mask along a greedy walk through each schema, per vocabulary."""
    out: dict[str, Any] = {}
    for name, tokenizer in (
        ("default pair (4,096)", AutoTokenizer.from_pretrained(str(PAIR / "target"))),
        ("synthetic 128,256", synthetic_tokenizer(128_256)),
    ):
        vocab = len(tokenizer)
        started = time.perf_counter()
        grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
        setup = time.perf_counter() - started
        times: list[float] = []
        depth = 0
        for schema in SCHEMAS.values():
            template = grammars.compile(ConstraintSpec("json_schema", json.dumps(schema)))
            for rep in range(reps):
                constraint = grammars.session(template, 0)
                generator = torch.Generator().manual_seed(rep)
                for _ in range(48):
                    begun = time.perf_counter()
                    allowed = constraint.allowed()
                    times.append(time.perf_counter() - begun)
                    choices = allowed.nonzero().flatten()
                    token = int(choices[torch.randint(0, len(choices), (1,), generator=generator)])
                    if constraint.is_eos(token):
                        break
                    constraint.consume(token)
                depth = max(depth, len(constraint.consumed))
                constraint.rollback(0)  # the whole output at once: back to the initial state
                assert not constraint.consumed and not constraint.matcher.is_error()
                assert torch.equal(constraint.allowed(), grammars.session(template, 0).allowed())
        out[name] = {
            "tokenizer_setup_s": round(setup, 3),
            "mask_us_median": round(statistics.median(times) * 1e6, 1),
            "mask_us_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1),
            "masks": len(times),
            "deepest_rollback_tokens": depth,
        }
        print(name, out[name], flush=True)
    out["llguidance"] = importlib.metadata.version("llguidance")
    return out


def _request(prompt: str, constraint: common_pb2.StructuredOutput | None, **fields: Any) -> Any:
    message = orchestrator_pb2.GenerateRequest(text=prompt, **fields)
    if constraint is not None:
        message.structured_output.CopyFrom(constraint)
    return message


def _run(stub: Any, message: Any) -> tuple[list[int], str, Any]:
    ids: list[int] = []
    text = ""
    last = None
    for response in stub.Generate(message):
        ids.extend(response.token_ids)
        text += response.text
        last = response
    return ids, text, last


def outputs(stub: Any, max_new_tokens: int) -> dict[str, Any]:
    """Per schema: outputs that end in EOS and validate, and LENGTH outputs, greedy and sampled."""
    table: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        constraint = common_pb2.StructuredOutput(json_schema=json.dumps(schema))
        valid = length = invalid = 0
        for prompt in PROMPTS:
            for temperature, seed in ((0.0, 0), (0.8, 1), (1.0, 2)):
                message = _request(
                    prompt, constraint, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
                )
                _, text, last = _run(stub, message)
                if last.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH:
                    length += 1
                    continue
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
        table[name] = {
            "valid_eos": valid,
            "invalid_eos": invalid,
            "length": length,
            "outputs": valid + length + invalid,
        }
        print(name, table[name], flush=True)
    return table


def _concurrent(stub: Any, messages: list[Any], streams: int) -> tuple[float, list[Any]]:
    """Run `messages` over `streams` client threads; wall seconds and each one's (ids, last)."""
    results: list[Any] = [None] * len(messages)
    next_index = iter(range(len(messages)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            ids, _, last = _run(stub, messages[index])
            results[index] = (ids, last)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


def speed(stub: Any, reps: int, streams: Sequence[int], max_new_tokens: int) -> dict[str, Any]:
    schema = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMAS["optional fields"]))
    allow_all = common_pb2.StructuredOutput(regex=r"(?s:.*)")
    arms = {
        "K = 0, schema": (schema, 0),
        "load_aware, schema": (schema, None),
        "K = 0, free": (None, 0),
        "load_aware, free": (None, None),
        "K = 0, allow-all mask": (allow_all, 0),
        "load_aware, allow-all mask": (allow_all, None),
    }
    report: dict[str, Any] = {}
    for count in streams:
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        accepted: dict[str, Counter[int]] = {arm: Counter() for arm in arms}
        outputs_by_arm: dict[str, list[list[int]]] = {}
        for rep in range(reps):
            for arm in list(arms)[rep % len(arms) :] + list(arms)[: rep % len(arms)]:
                constraint, k = arms[arm]
                fields: dict[str, Any] = {"max_new_tokens": max_new_tokens}
                if k is not None:
                    fields["num_speculative_tokens"] = k
                messages = [_request(p, constraint, **fields) for p in PROMPTS * max(1, count // 2)]
                seconds, results = _concurrent(stub, messages, count)
                rates[arm].append(sum(len(ids) for ids, _ in results) / seconds)
                outputs_by_arm[arm] = [ids for ids, _ in results]
                for _, last in results:
                    for position, count_at in enumerate(last.stats.accepted_per_position):
                        accepted[arm][position] += count_at
        medians = {arm: statistics.median(values) for arm, values in rates.items()}
        report[str(count)] = {
            "tok_per_s": {arm: round(value, 1) for arm, value in medians.items()},
            "speedup_schema": round(medians["load_aware, schema"] / medians["K = 0, schema"], 3),
            "speedup_free": round(medians["load_aware, free"] / medians["K = 0, free"], 3),
            "mask_cost_K0": round(1 - medians["K = 0, allow-all mask"] / medians["K = 0, free"], 3),
            "mask_cost_load_aware": round(1 - medians["load_aware, allow-all mask"] / medians["load_aware, free"], 3),
            "allow_all_outputs_equal_free": outputs_by_arm["K = 0, allow-all mask"] == outputs_by_arm["K = 0, free"],
            "accepted_per_position_schema": [
                accepted["load_aware, schema"][i] for i in sorted(accepted["load_aware, schema"])
            ],
            "accepted_per_position_free": [
                accepted["load_aware, free"][i] for i in sorted(accepted["load_aware, free"])
            ],
        }
        print(count, json.dumps(report[str(count)]), flush=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.structured", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="masks,outputs,speed")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured.json"))
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {}
    if "masks" in parts:
        result["masks"] = masks(args.reps)
    if parts & {"outputs", "speed"}:
        with LocalStack(str(PAIR / "target"), str(PAIR / "draft"), extra_service_args=["--threads", "1"]) as stack:
            channel = grpc.insecure_channel(stack.orchestrator_address)
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            _run(stub, _request("x = ", None, max_new_tokens=8))  # warm-up
            if "outputs" in parts:
                result["outputs"] = outputs(stub, args.max_new_tokens)
            if "speed" in parts:
                streams = [int(s) for s in args.streams.split(",")]
                result["speed"] = speed(stub, args.reps, streams, args.max_new_tokens)
            channel.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
