"""Structured outputs through the three services, on a tiny pair over a byte-level tokenizer.

Exactness: greedy outputs under a constraint equal the target alone's under the same constraint (K = 0)
at fixed K = 4, with the default policy, with overlapped drafting and with prompt-lookup proposals;
and, independently, every committed token is the target's argmax among the tokens the constraint
allows, computed with llguidance and Hugging Face directly. Sampled outputs under a choice follow the
exact constrained distribution (chi-square). Outputs that end in EOS validate; LENGTH outputs are valid
prefixes. Bad constraints fail cleanly and the next request still speculates.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx2 as httpx
import jsonschema  # type: ignore[import-untyped]
import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoTokenizer

from model_host.loading import LoadedModel
from model_host.runtime import ModelServer
from serving.constraints import ConstraintSpec
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2
from tests.conftest import RawSession, collect, still_speculates
from tests.servers import OrchestratorThread, load, orchestrator_config, start_draft, start_target
from tests.test_sampling_exactness import chi_square_pvalue
from tests.tiny_models import TinyPair, build_byte_pair

EOS = 256
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    "regex": common_pb2.StructuredOutput(regex=r"[a-c]{2,5}@(x|yz)\.(com|org)"),
    "choice": common_pb2.StructuredOutput(choice=common_pb2.Choice(options=["red", "green", "blue", "grey"])),
    "grammar": common_pb2.StructuredOutput(grammar='start: item ("," item){0,3}\nitem: "a" | "bb" | /[0-9]{1,2}/'),
    "json_object": common_pb2.StructuredOutput(json_object=True),
}
PROMPTS = ["Answer in JSON: ", "The record is ", "x"]


@dataclass
class Stack:
    target_model: LoadedModel
    target: ModelServer
    draft: ModelServer
    orchestrator: OrchestratorThread


@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return build_byte_pair(tmp_path_factory.mktemp("byte_pair"))


@pytest.fixture(scope="module")
def stack(byte_pair: TinyPair) -> Iterator[Stack]:
    target_model = load(byte_pair.target)
    target = start_target(target_model)
    draft = start_draft(load(byte_pair.close_draft))
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    yield Stack(target_model, target, draft, orchestrator)
    orchestrator.stop()
    draft.stop()
    target.stop()


def request(prompt: str, constraint: common_pb2.StructuredOutput | None, **fields: Any) -> Any:
    fields.setdefault("max_new_tokens", 48)
    fields.setdefault("speculation_policy", orchestrator_pb2.SPECULATION_POLICY_FIXED)
    message = orchestrator_pb2.GenerateRequest(text=prompt, **fields)
    if constraint is not None:
        message.structured_output.CopyFrom(constraint)
    return message


def matcher_for(model: LoadedModel, constraint: common_pb2.StructuredOutput) -> llguidance.LLMatcher:
    """llguidance directly, not through serving/constraints.py's session code."""
    spec = ConstraintSpec.from_proto(constraint)
    assert spec is not None
    tokenizer = llguidance.hf.from_tokenizer(model.tokenizer, n_vocab=model.vocab_size, eos_token=EOS)
    matcher = llguidance.LLMatcher(tokenizer, spec.grammar(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def allowed_by(matcher: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """[vocab] bool from llguidance's byte-per-token bias (another API than the services' bitmask)."""
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[: min(vocab, bias.numel())] = bias[:vocab] > 0
    allowed[EOS] = matcher.is_accepting()
    return allowed


def check_argmax_among_allowed(
    model: LoadedModel, constraint: common_pb2.StructuredOutput, prompt_ids: list[int], tokens: list[int]
) -> list[str]:
    """Each token is the target's argmax among the allowed tokens, or a near tie (returned, reported)."""
    matcher = matcher_for(model, constraint)
    ties = []
    with torch.no_grad():
        for index, token in enumerate(tokens):
            logits = model.model(torch.tensor([prompt_ids + tokens[:index]])).logits[0, -1]
            allowed = allowed_by(matcher, model.vocab_size)
            assert allowed[token], f"token {token} at {index} is not allowed"
            masked = logits.masked_fill(~allowed, float("-inf"))
            best = int(masked.argmax())
            if best != token:
                gap = float(masked[best] - masked[token])
                assert gap < 1e-4 * max(1.0, float(masked[best].abs())), f"token {index}: {token} vs argmax {best}"
                ties.append(f"position {index}: {token} vs {best}, gap {gap:.2g}")
            if token != EOS:
                assert matcher.consume_token(token)
    return ties


def encode(model: LoadedModel, text: str) -> list[int]:
    assert model.tokenizer is not None
    return list(model.tokenizer(text)["input_ids"])


def generate(stack: Stack, message: Any) -> tuple[list[int], str, Any]:
    return collect(stack.orchestrator.stub, message)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_under_a_constraint_is_the_targets_own_argmax_among_allowed_tokens(stack: Stack, kind: str) -> None:
    constraint = CONSTRAINTS[kind]
    ties: list[str] = []
    for prompt in PROMPTS:
        alone, _, alone_last = generate(stack, request(prompt, constraint, num_speculative_tokens=0))
        prompt_ids = encode(stack.target_model, prompt)
        ties += check_argmax_among_allowed(stack.target_model, constraint, prompt_ids, alone)
        variants = {
            "fixed K = 4": request(prompt, constraint, num_speculative_tokens=4, overlap_drafting=False),
            "overlap": request(prompt, constraint, num_speculative_tokens=4, overlap_drafting=True),
            "default policy": request(prompt, constraint, speculation_policy=0),
            "ngram": request(
                prompt, constraint, num_speculative_tokens=4, draft_method=orchestrator_pb2.DRAFT_METHOD_NGRAM
            ),
        }
        forced = 0
        for name, message in variants.items():
            ids, _, last = generate(stack, message)
            assert ids == alone, f"{kind}, {name}, prompt {prompt!r}"
            assert last.finish_reason == alone_last.finish_reason
            forced += last.stats.forced_draft_tokens
        assert alone_last.stats.forced_draft_tokens == 0  # the target alone proposes nothing
        if kind in ("json_schema", "choice"):  # keys and punctuation; a choice's rest once it is one
            assert forced > 0
    print(f"{kind}: near ties {ties}")


def test_outputs_validate_and_length_outputs_are_valid_prefixes(stack: Stack) -> None:
    constraint = CONSTRAINTS["json_schema"]
    finished: Counter[int] = Counter()
    for prompt in PROMPTS:
        for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (0.7, 3)):
            for max_new_tokens in (64, 9):
                message = request(
                    prompt, constraint, num_speculative_tokens=4, temperature=temperature, seed=seed,
                    max_new_tokens=max_new_tokens,
                )  # fmt: skip
                ids, text, last = generate(stack, message)
                finished[last.finish_reason] += 1
                if last.finish_reason == orchestrator_pb2.FINISH_REASON_EOS:
                    assert ids[-1] == EOS
                    jsonschema.validate(json.loads(text), SCHEMA)
                else:
                    assert last.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH
                    matcher = matcher_for(stack.target_model, constraint)
                    assert matcher.consume_tokens(ids), matcher.get_error()
    # Every string of the schema is bounded: given room, every output completes.
    assert finished[orchestrator_pb2.FINISH_REASON_EOS] >= len(PROMPTS) * 4


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (common_pb2.StructuredOutput(regex="[0-9]+("), ["structured_output.regex", "unclosed group"]),
        (common_pb2.StructuredOutput(json_schema="{not json"), ["structured_output.json_schema", "not JSON"]),
        (
            common_pb2.StructuredOutput(json_schema='{"type": "object", "if": {"type": "object"}}'),
            ["structured_output.json_schema", "if"],
        ),
        (common_pb2.StructuredOutput(grammar="start: foo"), ["structured_output.grammar", "foo"]),
        (common_pb2.StructuredOutput(choice=common_pb2.Choice(options=[])), ["structured_output.choice"]),
        (common_pb2.StructuredOutput(regex="a" * (64 * 1024 + 1)), ["structured_output.regex", "bytes"]),
        (common_pb2.StructuredOutput(json_schema="false"), ["structured_output.json_schema", "unsatisfiable"]),
        (
            common_pb2.StructuredOutput(json_schema='{"oneOf": [{"type": "number"}, {"type": "integer"}]}'),
            ["structured_output.json_schema", "oneOf", "#"],
        ),
    ],
)
def test_a_bad_constraint_is_invalid_argument_and_the_next_request_still_speculates(
    stack: Stack, constraint: common_pb2.StructuredOutput, words: list[str]
) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        generate(stack, request("x", constraint, num_speculative_tokens=2))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in failure.value.details()
    still_speculates(stack.orchestrator.stub)


def test_constrained_and_unconstrained_requests_share_batches(stack: Stack) -> None:
    messages = [
        request(prompt, CONSTRAINTS[kind] if kind else None, num_speculative_tokens=3, max_new_tokens=32)
        for prompt in PROMPTS[:2]
        for kind in ("json_schema", "regex", None, "choice")
    ]
    alone = [generate(stack, message)[0] for message in messages]
    together: list[list[int] | None] = [None] * len(messages)

    def run(index: int) -> None:
        together[index] = generate(stack, messages[index])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(messages))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert together == alone


def test_a_draft_that_cannot_constrain_keeps_the_output(byte_pair: TinyPair, stack: Stack) -> None:
    orchestrator = OrchestratorThread(orchestrator_config(stack.target, stack.draft))
    try:
        draft = orchestrator.running.servicer.draft
        assert draft is not None and draft.info is not None
        draft_info = draft.info
        del draft_info.structured_output_kinds[:]  # as a replica without support reports
        for kind in ("json_schema", "choice"):
            message = request(PROMPTS[0], CONSTRAINTS[kind], num_speculative_tokens=4)
            ids, _, last = collect(orchestrator.stub, message)
            expected, _, _ = generate(stack, request(PROMPTS[0], CONSTRAINTS[kind], num_speculative_tokens=0))
            assert ids == expected
            assert last.stats.draft_tokens > 0
    finally:
        orchestrator.stop()


def _exact_choice_distribution(
    model: LoadedModel, constraint: common_pb2.StructuredOutput, prompt_ids: list[int], temperature: float
) -> dict[tuple[int, ...], float]:
    """Every output the constraint allows, with its probability under the target's masked rows."""
    out: dict[tuple[int, ...], float] = {}

    def walk(matcher: llguidance.LLMatcher, tokens: list[int], p: float) -> None:
        with torch.no_grad():
            logits = model.model(torch.tensor([prompt_ids + tokens])).logits[0, -1]
        allowed = allowed_by(matcher, model.vocab_size)
        probs = (logits / temperature).masked_fill(~allowed, float("-inf")).softmax(-1)
        for token in allowed.nonzero().flatten().tolist():
            if token == EOS:
                out[(*tokens, EOS)] = p * float(probs[token])
            else:
                child = matcher.deep_copy()
                assert child.consume_token(token)
                walk(child, [*tokens, token], p * float(probs[token]))

    walk(matcher_for(model, constraint), [], 1.0)
    return out


def test_sampled_outputs_under_a_choice_follow_the_constrained_distribution(stack: Stack) -> None:
    samples = 400
    constraint = common_pb2.StructuredOutput(choice=common_pb2.Choice(options=["ab", "ac", "b", "bca", "cab", "c"]))
    prompt = "x"
    prompt_ids = encode(stack.target_model, prompt)
    expected = _exact_choice_distribution(stack.target_model, constraint, prompt_ids, temperature=1.5)
    assert abs(sum(expected.values()) - 1.0) < 1e-4
    counts: Counter[tuple[int, ...]] = Counter()
    drafted = 0
    for seed in range(samples):
        message = request(prompt, constraint, temperature=1.5, seed=seed, num_speculative_tokens=2, max_new_tokens=8)
        ids, _, last = generate(stack, message)
        counts[tuple(ids)] += 1
        drafted += last.stats.draft_tokens
    assert set(counts) <= set(expected)
    assert drafted > samples  # the rounds speculated
    assert chi_square_pvalue(counts, expected, samples) > 1e-3


def test_a_session_reopened_after_a_cache_miss_masks_as_the_one_it_replaces(stack: Stack) -> None:
    """The constraint travels again with keep = 0, and the new session replays the generated tokens."""
    from specdec.v1 import target_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{stack.target.port}")
    stub = target_pb2_grpc.TargetServiceStub(channel)
    prompt = encode(stack.target_model, "The record is ")
    constraint = CONSTRAINTS["regex"]
    generated = [ord(c) for c in "abc@y"]  # allowed so far; the next token must be "z"
    first = target_pb2.VerifyRequest(
        keep=0, append_token_ids=prompt, num_rows=1, structured_output=constraint, constraint_start=len(prompt)
    )
    session = RawSession(stub.Verify)
    try:
        session.step(first)
        step = target_pb2.VerifyRequest(keep=len(prompt), append_token_ids=generated, num_rows=1)
        continued = session.step(step).argmax_token_ids
        session.close_session()
        missed = session.step(step)
        assert missed.result == common_pb2.SESSION_RESULT_CACHE_MISS
        reopened = target_pb2.VerifyRequest(
            keep=0,
            append_token_ids=prompt + generated,
            num_rows=1,
            structured_output=constraint,
            constraint_start=len(prompt),
        )
        assert session.step(reopened).argmax_token_ids == continued == [ord("z")]
        bad = target_pb2.VerifyRequest(keep=len(prompt), append_token_ids=[ord("!")], num_rows=1)
        with pytest.raises(grpc.RpcError) as failure:
            session.step(bad)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not allowed" in failure.value.details()
    finally:
        session.close()
        channel.close()


def test_get_info_lists_the_supported_kinds(stack: Stack) -> None:
    info = stack.orchestrator.stub.GetInfo(orchestrator_pb2.GetInfoRequest())
    assert list(info.target.structured_output_kinds) == list(CONSTRAINTS) or set(
        info.target.structured_output_kinds
    ) == set(CONSTRAINTS)
    assert set(info.draft.structured_output_kinds) == set(CONSTRAINTS)


# --- the OpenAI gateway -----------------------------------------------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}> {% endif %}"


@pytest.fixture(scope="module")
def gateway(stack: Stack, byte_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.test_gateway import _start

    folder = tmp_path_factory.mktemp("byte_chat_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(byte_pair.target))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    started = _start(stack.orchestrator, tokenizer=str(folder))
    yield started
    started.stop()


def test_gateway_response_format_through_the_openai_package(gateway: Any) -> None:
    client = gateway.client()
    messages = [{"role": "user", "content": "A person, as JSON"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for response_format in (schema_format, {"type": "json_object"}):
        completion = client.chat.completions.create(
            model=gateway.model, messages=messages, max_tokens=64, temperature=0, response_format=response_format
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content or "")
        assert isinstance(value, dict)
        if response_format is schema_format:
            jsonschema.validate(value, SCHEMA)
    text = client.chat.completions.create(
        model=gateway.model, messages=messages, max_tokens=4, response_format={"type": "text"}
    )
    assert text.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda text: text in ("red", "green")),
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"guided_regex": r"[a-c]{2,5}@x\.com"}, lambda text: re.fullmatch(r"[a-c]{2,5}@x\.com", text)),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda text: re.fullmatch("[0-9]{3}", text)),
        ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda text: "name" in json.loads(text)),
        ({"guided_grammar": 'start: "a" ("," "b")*'}, lambda text: re.fullmatch("a(,b)*", text)),
    ],
)
def test_gateway_vllm_extensions_constrain_completions(gateway: Any, extra: dict[str, Any], check: Any) -> None:
    completion = gateway.client().completions.create(
        model=gateway.model, prompt="x", max_tokens=64, temperature=0, extra_body=extra
    )
    text = completion.choices[0].text
    assert completion.choices[0].finish_reason == "stop"
    assert check(text), text


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"if": {}}, "strict": True},
                }
            },
            "if",
        ),
        ({"guided_regex": "a(", "guided_choice": ["a"]}, "one structured output"),
        ({"structured_outputs": {"lark": "x"}}, "structured_outputs.lark"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a("}, "regex"),
    ],
)
def test_gateway_bad_structured_outputs_are_400_naming_them(gateway: Any, extra: dict[str, Any], words: str) -> None:
    body = {"model": gateway.model, "prompt": "x", "max_tokens": 4, **extra}
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_gateway_non_strict_schemas_ignore_what_cannot_be_enforced_and_stop_strings_still_apply(gateway: Any) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {**SCHEMA, "if": {}}}}
    body = {"model": gateway.model, "prompt": "x", "max_tokens": 64, "temperature": 0, "response_format": schema_format}
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), SCHEMA)
    body = {"model": gateway.model, "prompt": "x", "max_tokens": 64, "temperature": 0, "stop": ["@"]}
    body["guided_regex"] = r"[a-c]{2,5}@x\.com"
    choice = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and re.fullmatch("[a-c]{2,5}", choice["text"]), choice


def test_a_killed_target_replica_mid_constrained_generation_keeps_the_output(byte_pair: TinyPair, stack: Stack) -> None:
    """The survivor reopens the session with the whole sequence and the constraint, and replays it."""
    constraint = CONSTRAINTS["json_schema"]
    expected, _, _ = generate(stack, request(PROMPTS[0], constraint, num_speculative_tokens=0, max_new_tokens=64))
    replicas = [start_target(stack.target_model), start_target(stack.target_model)]
    addresses = ",".join(f"127.0.0.1:{replica.port}" for replica in replicas)
    orchestrator = OrchestratorThread(orchestrator_config(addresses, stack.draft))
    try:
        call = orchestrator.stub.Generate(request(PROMPTS[0], constraint, num_speculative_tokens=3, max_new_tokens=64))
        ids = list(next(call).token_ids)
        pinned = next(r for r in replicas if r.servicer.store.open_sessions == 1)
        pinned.stop()
        last = None
        for message in call:
            ids += message.token_ids
            last = message
        assert ids == expected
        assert last is not None and last.stats.session_reopens >= 1
    finally:
        orchestrator.stop()
        for replica in replicas:
            replica.stop()


@pytest.mark.parametrize(
    "schema",
    [
        "true",
        '{"oneOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/s"}], "$defs": {"n": {"type": "integer"}, '
        '"s": {"type": "string", "maxLength": 3}}}',
    ],
)
def test_boolean_and_disjoint_oneof_schemas_are_served(stack: Stack, schema: str) -> None:
    ended = 0
    for prompt in ("x", "{", "7"):
        for k in (0, 3):
            _, text, last = generate(
                stack, request(prompt, common_pb2.StructuredOutput(json_schema=schema), num_speculative_tokens=k)
            )
            if last.finish_reason == orchestrator_pb2.FINISH_REASON_EOS:
                jsonschema.validate(json.loads(text), json.loads(schema))
                ended += 1
    assert ended  # some outputs completed, and those validate


def test_ignore_eos_and_min_tokens_that_a_constraint_cannot_meet_are_refused(stack: Stack) -> None:
    choice = common_pb2.StructuredOutput(choice=common_pb2.Choice(options=["ab"]))
    for fields, words in (({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 6}, "min_tokens cannot be met")):
        with pytest.raises(grpc.RpcError) as failure:
            generate(stack, request("x", choice, num_speculative_tokens=2, **fields))
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in failure.value.details()
    still_speculates(stack.orchestrator.stub)
    # A min_tokens the constraint can meet keeps to it.
    ids, text, _ = generate(stack, request("x", choice, num_speculative_tokens=2, min_tokens=2))
    assert len(ids) >= 2
    assert text == "ab"
