"""The committed default pair: loads offline, shares one vocabulary, fits its budget, generates."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.vocab import tokenizer_fingerprint
from specdec.v1 import orchestrator_pb2
from tests.conftest import collect, hf_greedy
from tests.servers import OrchestratorThread, load, orchestrator_config, start_draft, start_target

PAIR = Path(__file__).resolve().parents[1] / "default_models" / "pair"
MAX_BYTES = 40 * 1024 * 1024


def test_pair_is_committed_with_card_and_files():
    for side in ("target", "draft"):
        names = {p.name for p in (PAIR / side).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names, names
    assert (PAIR / "README.md").is_file() and (PAIR / "training.json").is_file()


def test_total_size_within_budget():
    total = sum(p.stat().st_size for p in PAIR.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, f"{total / 2**20:.1f} MiB"


def test_loads_offline_and_shares_the_vocabulary(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = AutoModelForCausalLM.from_pretrained(PAIR / "target")
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft")
    target_tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    draft_tokenizer = AutoTokenizer.from_pretrained(PAIR / "draft")
    assert tokenizer_fingerprint(target_tokenizer) == tokenizer_fingerprint(draft_tokenizer)
    assert target.config.vocab_size == draft.config.vocab_size == len(target_tokenizer)
    # Sized for the product (the forward-cost ratio itself is measured by `make evaluate`).
    assert 4_000_000 <= target.num_parameters() <= 20_000_000
    assert draft.num_parameters() * 2 <= target.num_parameters()
    assert draft.config.num_hidden_layers * 3 <= target.config.num_hidden_layers
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"
    assert target_tokenizer.decode(target_tokenizer(text)["input_ids"]) == text  # byte-level: round-trips


def test_short_generation_through_the_services():
    target_model, draft_model = load(PAIR / "target"), load(PAIR / "draft")
    target, draft = start_target(target_model), start_draft(draft_model)
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    try:
        prompt = "def is_even(n):"
        request = orchestrator_pb2.GenerateRequest(text=prompt, max_new_tokens=24, num_speculative_tokens=4)
        ids, text, last = collect(orchestrator.stub, request)
        assert text and last.stats.draft_tokens > 0 and last.stats.accepted_tokens > 0
        assert target_model.tokenizer is not None
        prompt_ids = target_model.tokenizer(prompt)["input_ids"]
        assert ids == hf_greedy(target_model, prompt_ids, 24)
    finally:
        orchestrator.stop()
        target.stop()
        draft.stop()


CROSS = PAIR.parent / "cross_draft"


def test_the_cross_tokenizer_demo_draft_is_committed_small_and_of_another_tokenizer():
    names = {p.name for p in CROSS.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "training.json"} <= names, names
    assert sum(p.stat().st_size for p in CROSS.rglob("*") if p.is_file()) <= 10 * 1024 * 1024
    target, draft = AutoTokenizer.from_pretrained(PAIR / "target"), AutoTokenizer.from_pretrained(CROSS)
    assert tokenizer_fingerprint(target) != tokenizer_fingerprint(draft)
    vocab = draft.get_vocab()
    assert "<0x0A>" in vocab and sum(piece.startswith("\u2581") for piece in vocab) > 500  # SentencePiece-style


@pytest.mark.parametrize("rule", ["tli", "slem"])
def test_the_cross_tokenizer_demo_draft_serves_the_default_target_exactly(rule):
    """The shipped draft with its own tokenizer against the default target: the pair check passes (the
    overlap is above the default floor), and greedy outputs are the target alone's, by either rule."""
    target_model, draft_model = load(PAIR / "target"), load(CROSS)
    target = start_target(target_model)
    draft = start_draft(draft_model, target_tokenizer=str(PAIR / "target"))
    orchestrator = OrchestratorThread(orchestrator_config(target, draft, draft_tokenizer=str(CROSS), cross_greedy=rule))
    try:
        prompt = "def is_even(n):"
        request = orchestrator_pb2.GenerateRequest(text=prompt, max_new_tokens=32, num_speculative_tokens=4)
        ids, _, last = collect(orchestrator.stub, request)
        assert last.stats.draft_tokens > 0 and last.stats.accepted_tokens > 0
        assert target_model.tokenizer is not None
        assert ids == hf_greedy(target_model, target_model.tokenizer(prompt)["input_ids"], 32)
    finally:
        orchestrator.stop()
        target.stop()
        draft.stop()
