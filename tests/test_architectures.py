"""The architecture matrix: every attention layout users bring, served exactly.

Tiny random checkpoints of each family (tests/architectures.py), with sliding windows of a few tokens
and local/global mixes, so that prompts run far past every window:
- each forward a service can run (batched, the lean draft, the serial fallback) computes the model's
  own logits through prefill chunks, mixed-width steps and rollbacks across the window's edge;
- through the three services, greedy outputs equal Hugging Face's `generate()` of the target alone at
  K = 0 and K = 4, alone and eight at a time, batched and in the fallback;
- sampled outputs of a sliding-window target follow its distribution, told apart from the same
  model with its window removed;
- a model whose cache cannot roll back is refused at start-up, naming the layer type.

`make test` serves a subset through the services (marked `suite` below); `make matrix` serves every
family.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import structlog
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from draft_service.lean import LeanDraft
from draft_service.servicer import SERVICE_NAME as DRAFT_SERVICE
from draft_service.servicer import DraftServicer
from draft_service.servicer import register as register_draft
from model_host import runtime
from model_host.attention import GLOBAL, AttentionLayout
from model_host.forward import (
    TOLERANCE,
    BatchedForward,
    Forward,
    ModelNotServable,
    SerialForward,
    choose_forward,
    disagreement,
    tolerance,
)
from model_host.kv_blocks import BlockStore
from model_host.loading import LoadedModel
from model_host.profile import forward_costs
from model_host.rows import Row
from model_host.runtime import ModelServer, start_model_server
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from target_service.servicer import SERVICE_NAME as TARGET_SERVICE
from target_service.servicer import TargetServicer
from target_service.servicer import register as register_target
from tests.architectures import CONTEXT, FAMILIES, VOCAB, WINDOW, build, save_pair
from tests.conftest import collect, hf_greedy
from tests.servers import SERVICE_DEFAULTS, OrchestratorThread, load, orchestrator_config
from tests.test_greedy_exactness import logit_gap
from tests.test_sampling_exactness import chi_square_pvalue
from tests.tiny_models import word_tokenizer

NEAR_TIE = 1e-4
MAX_NEW_TOKENS = 24
# The families the batched forward cannot serve, and why (the fallback's log says so too).
SERIAL_ONLY = {"falcon-alibi": "ALiBi"}
# Served through the three services in `make test`: batched, a window on every layer and local and
# global layers (by `layer_types` and by `max_window_layers`); in the fallback, a window on every
# layer and the family whose only path it is. `make matrix` serves every family both ways.
SUITE = {("mistral-window", False), ("gemma3-text", False), ("qwen2-window", False), ("mistral-window", True)}
SUITE |= {(name, True) for name in SERIAL_ONLY}


def _families() -> list:
    return [pytest.param(name, id=name) for name in FAMILIES]


def _served() -> list:
    """(family, serial) for every family, the fallback alone where it is the only path."""
    cases = [(name, serial) for name in FAMILIES for serial in (False, True) if serial or name not in SERIAL_ONLY]
    return [
        pytest.param(
            name,
            serial,
            marks=() if (name, serial) in SUITE else pytest.mark.matrix,
            id=f"{name}-{'fallback' if serial else 'batched'}",
        )
        for name, serial in cases
    ]


def _store() -> BlockStore:
    return BlockStore(torch.device("cpu"), torch.float32, CONTEXT)


# --- forwards against the model's own --------------------------------------------------------------


def _random_steps(rng: random.Random, forward: Forward, model: torch.nn.Module, steps: int = 30) -> float:
    """Random batches of four sessions: prefills, chunks and steps of mixed widths, rollbacks of up to
    four tokens, a session replaced now and then; the largest difference from the model's own forward
    over each whole sequence."""
    sequences: dict[int, list[int]] = {slot: [] for slot in range(4)}
    worst = 0.0
    for _ in range(steps):
        rows = []
        for slot in sorted(rng.sample(range(4), rng.randrange(1, 5))):
            sequence = sequences[slot]
            if rng.random() < 0.05 or len(sequence) > 3 * WINDOW + 20:
                sequence.clear()
            else:
                del sequence[max(0, len(sequence) - rng.randrange(0, 5)) :]
            new = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 2, 3, 5, WINDOW + 3]))]
            rows.append(Row(slot, len(sequence), new, rng.randrange(0, min(len(new), 5) + 1)))
            sequence += new
        for row, logits in zip(rows, forward(rows), strict=True):
            if row.num_logits:
                with torch.inference_mode():
                    want = model(torch.tensor([sequences[row.slot]])).logits[0, -row.num_logits :]
                assert logits is not None
                worst = max(worst, float((logits - want).abs().max()))
    return worst


@pytest.mark.parametrize("family", _families())
def test_every_forward_computes_the_models_own_logits_past_its_windows(family):
    target, draft = build(FAMILIES[family])
    chosen = choose_forward(target, _store())
    expected = "serial" if family in SERIAL_ONLY else "batched"
    assert chosen.name == expected, (chosen.name, expected)
    forwards: list[tuple[str, Forward, torch.nn.Module]] = [
        (chosen.name, chosen, target),
        ("serial", SerialForward(target, _store()), target),
    ]
    lean = LeanDraft.attach(draft, _store())
    if lean is not None:
        forwards.append(("lean draft", lean, draft))
    with torch.inference_mode():
        for name, forward, model in forwards:
            worst = _random_steps(random.Random(family), forward, model)
            assert worst < 1e-4, (name, worst)


def test_the_lean_draft_serves_sliding_windows():
    """Mistral's window on every layer, and Qwen2's local layers above `max_window_layers`."""
    mistral = build(FAMILIES["mistral-window"])[1]
    assert LeanDraft.attach(mistral, _store()) is not None
    qwen = build(FAMILIES["qwen2-window"])[0]  # 2 layers: global, then local
    assert LeanDraft.attach(qwen, _store()) is not None


@pytest.mark.parametrize("family", ["mistral-window", "gemma3-text", "qwen2-window"])
def test_the_start_up_check_sees_a_window_that_is_ignored(family):
    """The batched forward with every layer made global, as it was before windows were read: the
    start-up check, which runs past the window, tells it from the model's own forward."""
    target, _ = build(FAMILIES[family])
    layout = AttentionLayout.of(target.config)
    blind = BatchedForward(target, _store(), AttentionLayout(tuple(GLOBAL for _ in layout.layers)))
    assert disagreement(blind, target, layout, CONTEXT, 512) > 100 * TOLERANCE
    assert disagreement(BatchedForward(target, _store()), target, layout, CONTEXT, 512) < TOLERANCE


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3-text"])
def test_in_bfloat16_the_batched_forward_is_chosen_and_an_ignored_window_still_caught(family):
    """bfloat16 rounds a stepped forward and a whole one apart by a few units of its resolution (the
    check's tolerance scales with it); a forward that ignores a window is off by far more."""
    target = build(FAMILIES[family])[0].to(torch.bfloat16)
    store = BlockStore(torch.device("cpu"), torch.bfloat16, CONTEXT)
    assert isinstance(choose_forward(target, store), BatchedForward)
    layout = AttentionLayout.of(target.config)
    if any(layer.span for layer in layout.layers):
        blind = BatchedForward(target, store, AttentionLayout(tuple(GLOBAL for _ in layout.layers)))
        assert disagreement(blind, target, layout, CONTEXT, 512) > 4 * tolerance(torch.bfloat16)


def test_the_fallback_rolls_back_across_the_window_and_profiles():
    """Hugging Face's sliding-window cache refuses to crop once its window is full; the fallback keeps
    what a rollback needs, so the start-up cost profile (a 32-token prefix, rolled back after every
    timed forward) runs on a window of 8."""
    target, _ = build(FAMILIES["mistral-window"])
    serial = SerialForward(target, _store())
    costs = forward_costs(serial, VOCAB, [1, 2, 4], (1, 3, 5))
    assert costs and all(seconds > 0 for _, seconds in costs)


def test_a_fallback_is_logged_with_the_feature_that_caused_it():
    target, _ = build(FAMILIES["falcon-alibi"])
    with structlog.testing.capture_logs() as logs:
        forward = choose_forward(target, _store())
    assert isinstance(forward, SerialForward)
    (warning,) = [entry for entry in logs if entry["event"] == "batched_forward_unavailable"]
    assert "ALiBi" in warning["attention"] and "exact" in warning["fallback"], warning


def _recurrent_model() -> PreTrainedModel:
    config = AutoConfig.for_model(
        "qwen3_next",
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=CONTEXT, eos_token_id=0, bos_token_id=0,
        pad_token_id=0, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_model_whose_cache_cannot_roll_back_is_refused_naming_the_layer_type(tmp_path, monkeypatch):
    """A recurrent layer's state cannot drop its last tokens: the service exits at start-up with a
    message naming the layer type, before it listens."""
    with pytest.raises(ModelNotServable, match="linear_attention on layer 0"):
        choose_forward(_recurrent_model(), _store())
    _recurrent_model().save_pretrained(tmp_path)
    word_tokenizer(VOCAB).save_pretrained(tmp_path)
    monkeypatch.setattr(runtime, "configure_logging", lambda level: None)  # keep the suite's logging
    argv = ["--model", str(tmp_path), "--host", "127.0.0.1", "--port", "0"]
    with pytest.raises(SystemExit, match="its linear_attention layers keep a state that cannot be rolled back"):
        runtime.run_model_service("target_service", argv, TargetServicer, register_target, TARGET_SERVICE)


# --- through the services --------------------------------------------------------------------------


class SerialTarget(TargetServicer):
    def make_forward(self) -> Forward:
        return SerialForward(self.loaded.model, self.block_store)


class SerialDraft(DraftServicer):
    def make_forward(self) -> Forward:
        return SerialForward(self.loaded.model, self.block_store)


@dataclass
class Stack:
    target: LoadedModel
    orchestrator: OrchestratorThread
    forwards: tuple[str, str]  # the target's and the draft's


def _serve(loaded: LoadedModel, servicer_class: type, register: object, name: str) -> ModelServer:
    config = replace(SERVICE_DEFAULTS, model=loaded.model_id, max_sessions=32)
    return start_model_server(servicer_class(loaded, config), register, name, config)  # type: ignore[arg-type]


@contextmanager
def _stack(target_path: Path, draft_path: Path, serial: bool = False) -> Iterator[Stack]:
    """Target, draft and orchestrator over these checkpoints; `serial` forces the fallback."""
    target, draft = load(target_path), load(draft_path)
    target_server = _serve(target, SerialTarget if serial else TargetServicer, register_target, TARGET_SERVICE)
    draft_server = _serve(draft, SerialDraft if serial else DraftServicer, register_draft, DRAFT_SERVICE)
    orchestrator = OrchestratorThread(orchestrator_config(target_server, draft_server))
    try:
        forwards = (target_server.servicer.engine.forward.name, draft_server.servicer.engine.forward.name)
        yield Stack(target, orchestrator, forwards)
    finally:
        orchestrator.stop()
        draft_server.stop()
        target_server.stop()


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Lengths from below the window to the context's end (less the tokens to generate)."""
    lengths = [3, WINDOW + 1, 2 * WINDOW + 5, 40, 90, CONTEXT - MAX_NEW_TOKENS - 8, 17, 61][:count]
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for length in lengths]


def _generate(stack: Stack, prompt: list[int], k: int) -> list[int]:
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=MAX_NEW_TOKENS,
        num_speculative_tokens=k,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
    )
    return collect(stack.orchestrator.stub, request)[0]


def _compare(stack: Stack, prompt: list[int], got: list[int], expected: list[int], near_ties: list[float]) -> None:
    """Identical, or the first difference is a near tie of the target's own logits (reported)."""
    if got == expected:
        return
    first = next(i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b)
    gap = logit_gap(stack.target, prompt + expected[:first])
    assert gap < NEAR_TIE, f"prompt of {len(prompt)}: first difference at output {first}, logit gap {gap:.3g}"
    near_ties.append(gap)


@pytest.mark.parametrize(("family", "serial"), _served())
def test_greedy_output_equals_the_target_alone_through_the_services(family, serial, tmp_path):
    spec = FAMILIES[family]
    with _stack(*save_pair(spec, tmp_path), serial) as stack:
        if serial or family in SERIAL_ONLY:
            assert stack.forwards == ("serial", "serial"), stack.forwards
        else:
            assert stack.forwards[0] == "batched", stack.forwards
        rng = random.Random(family)
        alone, concurrent = _prompts(rng, 6), _prompts(rng, 8)
        expected = {tuple(p): hf_greedy(stack.target, p, MAX_NEW_TOKENS) for p in alone + concurrent}
        near_ties: list[float] = []
        for k in (0, 4):
            for prompt in alone:
                _compare(stack, prompt, _generate(stack, prompt, k), expected[tuple(prompt)], near_ties)
            with ThreadPoolExecutor(len(concurrent)) as pool:
                outputs = list(pool.map(lambda p, k=k: _generate(stack, p, k), concurrent))
            for prompt, got in zip(concurrent, outputs, strict=True):
                _compare(stack, prompt, got, expected[tuple(prompt)], near_ties)
        print(f"{family} {stack.forwards}: near ties {near_ties}")


# --- sampling ----------------------------------------------------------------------------------


SAMPLED_VOCAB = 8
SAMPLED_WINDOW = 4
SAMPLED_PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # past the window
SAMPLES = 800


def test_sampled_outputs_of_a_sliding_window_target_follow_its_distribution(tmp_path):
    """The first two tokens after a prompt longer than the window, sampled at temperature 1 with K = 2
    through the services, eight at a time: the target's own distribution (from its own forward), and
    not the one of the same weights with the window removed (the power check)."""
    fields = dict(
        vocab_size=SAMPLED_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, eos_token_id=0, bos_token_id=0, pad_token_id=0,
        sliding_window=SAMPLED_WINDOW, initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(11)
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", **fields)).eval()
    draft = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("mistral", **{**fields, "num_hidden_layers": 1})
    ).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    tokenizer = word_tokenizer(SAMPLED_VOCAB)
    for model, name in ((target, "target"), (draft, "draft")):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)

    def two_tokens(stub: orchestrator_pb2_grpc.OrchestratorStub, seed: int) -> tuple[tuple[int, ...], int, int]:
        """The output, and the tokens accepted and drafted."""
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=SAMPLED_PROMPT),
            max_new_tokens=2,
            temperature=1.0,
            seed=seed,
            num_speculative_tokens=2,
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
            overlap_drafting=False,
        )
        ids, _, last = collect(stub, request)
        return tuple(ids), last.stats.accepted_tokens, last.stats.draft_tokens

    with _stack(tmp_path / "target", tmp_path / "draft") as stack, ThreadPoolExecutor(8) as pool:
        assert stack.forwards[0] == "batched"
        results = list(pool.map(lambda seed: two_tokens(stack.orchestrator.stub, seed), range(SAMPLES)))
    counts = Counter(output for output, _, _ in results)
    accepted, drafted = sum(r[1] for r in results), sum(r[2] for r in results)
    assert 0 < accepted < drafted, (accepted, drafted)  # proposals accepted and rejected

    def distribution(model: torch.nn.Module) -> dict[tuple[int, ...], float]:
        with torch.no_grad():
            first = model(torch.tensor([SAMPLED_PROMPT])).logits[0, -1].softmax(-1).double()
            seconds = model(torch.tensor([[*SAMPLED_PROMPT, t] for t in range(SAMPLED_VOCAB)])).logits[:, -1]
            second = seconds.softmax(-1).double()
        # Token 0 is EOS: a first EOS ends the output there.
        expected: dict[tuple[int, ...], float] = {(0,): float(first[0])}
        expected.update(
            {(a, b): float(first[a] * second[a, b]) for a in range(1, SAMPLED_VOCAB) for b in range(SAMPLED_VOCAB)}
        )
        return expected

    assert set(counts) <= set(distribution(target)), set(counts) - set(distribution(target))
    pvalue = chi_square_pvalue(counts, distribution(target), SAMPLES)
    assert pvalue > 0.01, pvalue
    unwindowed = AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", **{**fields, "sliding_window": None}))
    unwindowed.load_state_dict(target.state_dict())
    assert chi_square_pvalue(counts, distribution(unwindowed.eval()), SAMPLES) < 1e-3
