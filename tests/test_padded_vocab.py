"""Padded pairs (Qwen's shape): one tokenizer, embeddings of different widths. The draft proposes over
its own width (narrower: q = 0 past it; wider: restricted to the target's), the target's row is always
its own; outputs are the target alone's, greedy and sampled, also when the target emits a padding id."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from model_host.loading import LoadedModel
from model_host.runtime import ModelServer
from orchestrator.pair import PairMismatch, check_pair
from specdec.v1 import common_pb2, orchestrator_pb2
from tests.conftest import collect, hf_greedy
from tests.servers import OrchestratorThread, load, orchestrator_config, start_draft, start_target
from tests.test_sampling_exactness import first_token_request, first_tokens_pvalue
from tests.tiny_models import perturbed_copy, save, tiny_llama, word_tokenizer

TOKENIZER_TOKENS = 96  # ids past this are padding
WIDE, NARROW = TOKENIZER_TOKENS + 256, TOKENIZER_TOKENS + 128  # Qwen-like: widths differing by 128
PADDING_ID = NARROW + 20  # an id the narrow draft has no row for


def padded(model: LlamaForCausalLM, width: int) -> LlamaForCausalLM:
    """The model with its embeddings padded to `width` rows; padding rows are zero (logit 0), as an
    untrained padding row's logit is small."""
    resized = copy.deepcopy(model)
    resized.resize_token_embeddings(width, mean_resizing=False)
    with torch.no_grad():
        resized.get_input_embeddings().weight[TOKENIZER_TOKENS:] = 0
        resized.get_output_embeddings().weight[TOKENIZER_TOKENS:] = 0
    return resized


@dataclass
class Pair:
    target: LoadedModel
    orchestrator: OrchestratorThread


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    root: Path = tmp_path_factory.mktemp("padded")
    tokenizer = word_tokenizer(TOKENIZER_TOKENS)
    base = tiny_llama(TOKENIZER_TOKENS, seed=1, hidden=48, layers=3)
    emitting = padded(base, WIDE)
    with torch.no_grad():  # the target prefers a padding id wherever it would say token 9
        head = emitting.get_output_embeddings().weight
        head[PADDING_ID] = 1.5 * head[9]
    paths = {
        "wide_target": save(padded(base, WIDE), tokenizer, root / "wide_target"),
        "narrow_target": save(padded(base, NARROW), tokenizer, root / "narrow_target"),
        "emitting_target": save(emitting, tokenizer, root / "emitting_target"),
        "narrow_draft": save(perturbed_copy(padded(base, NARROW), 0.02, 2), tokenizer, root / "narrow_draft"),
        "wide_draft": save(perturbed_copy(padded(base, WIDE), 0.02, 2), tokenizer, root / "wide_draft"),
    }
    loaded = {name: load(path) for name, path in paths.items()}
    servers: list[ModelServer] = [
        *(start_target(loaded[name]) for name in ("wide_target", "narrow_target", "emitting_target")),
        *(start_draft(loaded[name]) for name in ("narrow_draft", "wide_draft")),
    ]
    wide_target, narrow_target, emitting_target, narrow_draft, wide_draft = servers
    started = {
        "narrow draft": Pair(loaded["wide_target"], OrchestratorThread(orchestrator_config(wide_target, narrow_draft))),
        "wide draft": Pair(loaded["narrow_target"], OrchestratorThread(orchestrator_config(narrow_target, wide_draft))),
        "emitting target": Pair(
            loaded["emitting_target"], OrchestratorThread(orchestrator_config(emitting_target, narrow_draft))
        ),
    }
    yield started
    for pair in started.values():
        pair.orchestrator.stop()
    for server in servers:
        server.stop()


def greedy_request(prompt: list[int], k: int = 4) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=24,
        num_speculative_tokens=k,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
    )


PROMPTS = [[5, 6, 7], [11, 3], [40, 41, 42, 43], [9, 9, 2, 17, 30]]


@pytest.mark.parametrize("name", ["narrow draft", "wide draft"])
def test_a_padded_pair_starts_and_is_greedy_identical_to_the_target(pairs, name):
    pair = pairs[name]
    drafted = accepted = 0
    for prompt in PROMPTS:
        got, _, last = collect(pair.orchestrator.stub, greedy_request(prompt))
        assert got == hf_greedy(pair.target, prompt, 24)
        drafted += last.stats.draft_tokens
        accepted += last.stats.accepted_tokens
    assert drafted and accepted / drafted > 0.3  # the padded draft really drafts, and agrees often


@pytest.mark.parametrize("name", ["narrow draft", "wide draft", "emitting target"])
def test_a_padded_pair_keeps_the_target_distribution(pairs, name):
    pair = pairs[name]
    prompt, samples = [5, 6, 7], 400

    def first_token(seed: int) -> int:
        tokens, _, last = collect(pair.orchestrator.stub, first_token_request(prompt, seed, overlap_drafting=False))
        # The draft's rows were usable at the target's width (a wide draft's padding ids masked).
        assert last.stats.draft_fallback_rounds == 0 and last.stats.draft_tokens
        return tokens[0]

    pvalue = first_tokens_pvalue(pair.target, prompt, first_token, samples)
    assert pvalue > 0.01, pvalue


def test_a_target_that_emits_a_padding_id_stops_drafting_past_the_narrow_drafts_width(pairs):
    """The narrow draft has no row for the padding id: once the sequence holds one, the request goes on
    at K = 0 (the target alone); the id streams with empty text."""
    pair = pairs["emitting target"]
    emitted = 0
    for prompt in PROMPTS:
        expected = hf_greedy(pair.target, prompt, 24)
        got, text, last = collect(pair.orchestrator.stub, greedy_request(prompt))
        assert got == expected
        if PADDING_ID in got:
            emitted += 1
            after = len(got) - got.index(PADDING_ID) - 1
            assert last.stats.rounds >= after  # one token a round after it: no more drafting
            assert "w" + str(PADDING_ID) not in text
    assert emitted, "the emitting target never emitted its padding id"
    # A prompt that holds a padding id drafts nothing at all.
    got, _, last = collect(pair.orchestrator.stub, greedy_request([5, PADDING_ID, 7]))
    assert got == hf_greedy(pair.target, [5, PADDING_ID, 7], 24)
    assert last.stats.draft_tokens == 0 and last.stats.draft_fallback_rounds == 0


def test_widths_may_differ_only_under_one_tokenizer():
    target = common_pb2.ModelInfo(model="t", vocab_size=WIDE, tokenizer_fingerprint="abc")
    check_pair(target, common_pb2.ModelInfo(model="d", vocab_size=NARROW, tokenizer_fingerprint="abc"))
    for draft in (
        common_pb2.ModelInfo(model="d", vocab_size=NARROW, tokenizer_fingerprint=""),
        common_pb2.ModelInfo(model="d", vocab_size=NARROW, tokenizer_fingerprint="xyz"),
    ):
        with pytest.raises(PairMismatch):
            check_pair(target, draft)
