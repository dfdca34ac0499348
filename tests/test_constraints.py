"""serving/constraints.py: specs and their bounds, compile errors, a session's matcher kept in step with
its sequence (rollback, a refused rollback replayed, EOS), and the rows a verify step masks."""

from __future__ import annotations

import json
from typing import Any

import grpc
import llguidance
import pytest
import torch

from serving.constraints import (
    COMPILED_CACHE_SIZE,
    MAX_CHOICES,
    ConstraintSpec,
    Grammars,
    SessionConstraint,
    block_masks,
    mask_logits,
)
from serving.errors import ServiceError
from specdec.v1 import common_pb2
from tests.tiny_models import byte_tokenizer

EOS = 256
VOCAB = 264  # wider than the tokenizer's 257: the mask is the logits' width


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    built = Grammars.for_tokenizer(byte_tokenizer(), VOCAB, [EOS], "test")
    assert built is not None
    return built


def session(grammars: Grammars, message: common_pb2.StructuredOutput, start: int = 0) -> SessionConstraint:
    spec = ConstraintSpec.from_proto(message)
    assert spec is not None
    return grammars.session(grammars.compile(spec), start)


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_spec_bounds_and_no_constraint() -> None:
    assert ConstraintSpec.from_proto(common_pb2.StructuredOutput()) is None
    assert ConstraintSpec.from_proto(common_pb2.StructuredOutput(json_object=False)) is None
    too_many = common_pb2.StructuredOutput(choice=common_pb2.Choice(options=["a"] * (MAX_CHOICES + 1)))
    empty_option = common_pb2.StructuredOutput(choice=common_pb2.Choice(options=["a", ""]))
    for message in (too_many, empty_option, common_pb2.StructuredOutput(regex="")):
        with pytest.raises(ServiceError) as failure:
            ConstraintSpec.from_proto(message)
        assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_output." in failure.value.message


def test_spec_round_trips_and_lenient_schemas_travel_as_x_guidance() -> None:
    for message in (
        common_pb2.StructuredOutput(json_schema='{"type": "integer"}'),
        common_pb2.StructuredOutput(json_object=True),
        common_pb2.StructuredOutput(regex="a+"),
        common_pb2.StructuredOutput(grammar='start: "x"'),
        common_pb2.StructuredOutput(choice=common_pb2.Choice(options=["a", 'b"c'])),
    ):
        assert ConstraintSpec.from_proto(message).to_proto() == message  # type: ignore[union-attr]
    lenient = ConstraintSpec("json_schema", '{"type": "object", "if": {}}', lenient=True)
    sent = json.loads(lenient.to_proto().json_schema)
    assert sent["x-guidance"] == {"lenient": True}


def test_compile_errors_name_the_field_and_carry_the_compilers_message(grammars: Grammars) -> None:
    cases = [
        (ConstraintSpec("regex", "a("), grpc.StatusCode.INVALID_ARGUMENT, "unclosed group"),
        (ConstraintSpec("json_schema", "[1"), grpc.StatusCode.INVALID_ARGUMENT, "not JSON"),
        (ConstraintSpec("json_schema", '{"if": {}}'), grpc.StatusCode.INVALID_ARGUMENT, "if"),
        (ConstraintSpec("grammar", "start: nothing"), grpc.StatusCode.INVALID_ARGUMENT, "nothing"),
    ]
    for spec, code, words in cases:
        with pytest.raises(ServiceError) as failure:
            grammars.compile(spec)
        assert failure.value.code == code
        assert f"structured_output.{spec.kind}" in failure.value.message and words in failure.value.message
    # A lenient schema ignores what llguidance cannot enforce instead.
    grammars.compile(ConstraintSpec("json_schema", '{"type": "object", "if": {}}', lenient=True))


def test_a_grammar_past_the_parsers_limits_is_resource_exhausted() -> None:
    small = Grammars(byte_tokenizer(), VOCAB, [EOS], llguidance.LLParserLimits(max_grammar_size=1000))
    properties = {f"p{i}": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{3,9}"}} for i in range(400)}
    spec = ConstraintSpec("json_schema", json.dumps({"type": "object", "properties": properties}))
    with pytest.raises(ServiceError) as failure:
        small.compile(spec)
    assert failure.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits" in failure.value.message


def test_compiled_constraints_are_cached_and_bounded(grammars: Grammars) -> None:
    first = ConstraintSpec("regex", "cache[0-9]")
    template = grammars.compile(first)
    assert grammars.compile(first) is template
    for i in range(COMPILED_CACHE_SIZE):
        grammars.compile(ConstraintSpec("regex", f"other{i}"))
    assert grammars.cached(first) is None


def test_eos_is_allowed_exactly_when_the_matcher_accepts_and_the_mask_is_the_logits_width(grammars: Grammars) -> None:
    constraint = session(grammars, common_pb2.StructuredOutput(regex="ab?"))
    allowed = constraint.allowed()
    assert allowed.shape == (VOCAB,)
    assert allowed.nonzero().flatten().tolist() == [ord("a")]
    constraint.consume(ord("a"))
    assert set(constraint.allowed().nonzero().flatten().tolist()) == {ord("b"), EOS}
    constraint.consume(ord("b"))
    assert constraint.allowed().nonzero().flatten().tolist() == [EOS]
    assert not constraint.allows(ord("b")) and constraint.allows(EOS)


def test_rollback_and_a_refused_rollback_replays_to_the_same_state(grammars: Grammars) -> None:
    message = common_pb2.StructuredOutput(json_schema='{"type": "object", "properties": {"k": {"type": "string"}}}')
    prompt = 5
    text = ids('{"k":"abc"')
    reference = session(grammars, message, prompt)
    reference.feed(text[:4], prompt)
    want = reference.allowed()

    constraint = session(grammars, message, prompt)
    constraint.feed(text, prompt)
    constraint.rollback(prompt + 4)
    assert constraint.length == prompt + 4 and torch.equal(constraint.allowed(), want)

    class RefusesRollback:
        """A matcher whose rollback depth is exhausted, as some libraries' are."""

        def __init__(self, inner: llguidance.LLMatcher) -> None:
            self.inner = inner

        def rollback(self, n: int) -> bool:
            return False

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    shallow = session(grammars, message, prompt)
    shallow.matcher = RefusesRollback(shallow.matcher)  # type: ignore[assignment]
    shallow.feed(text, prompt)
    shallow.rollback(prompt + 4)  # resets and replays the 4 tokens it keeps
    assert torch.equal(shallow.allowed(), want)
    shallow.rollback(0)  # before the constraint starts: the initial state
    assert shallow.length == prompt and torch.equal(shallow.allowed(), session(grammars, message, prompt).allowed())


def test_a_fed_token_the_constraint_forbids_is_refused_without_breaking_the_matcher(grammars: Grammars) -> None:
    constraint = session(grammars, common_pb2.StructuredOutput(regex="[0-9]+"), start=2)
    with pytest.raises(ServiceError) as failure:
        constraint.feed([7, 7, ord("1"), ord("x")], 0)  # two prompt tokens, then "1x"
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT and "not allowed" in failure.value.message
    assert not constraint.matcher.is_error()
    assert constraint.consumed == [ord("1")]
    constraint.feed([ord("2")], 3)
    assert constraint.consumed == [ord("1"), ord("2")]


def test_block_masks_follow_the_proposal_until_a_forbidden_token_or_eos(grammars: Grammars) -> None:
    message = common_pb2.StructuredOutput(regex="abc|abd")
    prompt = [9, 9, 9]
    constraint = session(grammars, message, start=len(prompt))
    # First step: the prompt, then a proposal "a", "b", "x" (x forbidden): 4 rows.
    block = [*prompt, ord("a"), ord("b"), ord("x")]
    allowed = block_masks(constraint, block, 0, 4)
    assert allowed[0].nonzero().flatten().tolist() == [ord("a")]
    assert allowed[1].nonzero().flatten().tolist() == [ord("b")]
    assert set(allowed[2].nonzero().flatten().tolist()) == {ord("c"), ord("d")}
    assert bool(allowed[3].all())  # past the forbidden token: never read
    # Next step: "ab" accepted and "c" committed; the proposal is EOS.
    allowed = block_masks(constraint, [ord("a"), ord("b"), ord("c"), EOS], len(prompt), 2)
    assert allowed[0].nonzero().flatten().tolist() == [EOS]
    assert constraint.consumed == [ord("a"), ord("b"), ord("c")]


def test_mask_logits_sets_forbidden_tokens_to_minus_infinity() -> None:
    logits = torch.arange(6, dtype=torch.float32)[None]
    allowed = torch.tensor([[True, False, True, False, False, True]])
    masked = mask_logits(logits, allowed)
    assert masked.tolist() == [[0.0, float("-inf"), 2.0, float("-inf"), float("-inf"), 5.0]]
    assert logits[0, 1] == 1.0  # a new tensor
