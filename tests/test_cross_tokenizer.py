"""Drafts with another tokenizer (token-level intersection, orchestrator/translation.py): a byte-level
BPE target and a SentencePiece-style draft that shares part of its vocabulary. The draft proposes the
shared tokens alone; its context spells each target token in its own tokens, a token it does not share
as several. Outputs are the target alone's, greedy and sampled."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from model_host.loading import LoadedModel
from model_host.runtime import ModelServer
from orchestrator.context import Context
from orchestrator.pair import PairMismatch, check_pair, translation_for
from orchestrator.translation import DraftContext, Translation
from serving.tensors import WireFormatError
from serving.vocab_map import check_overlap, token_bytes
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2
from tests.conftest import RawSession, StepFailed, collect, hf_greedy, wait_until
from tests.servers import LOOPBACK, OrchestratorThread, load, orchestrator_config, start_draft, start_target
from tests.test_sampling_exactness import first_token_request, first_tokens_pvalue, target_first_token_probs
from tests.tiny_models import byte_level_bpe, save, sentencepiece_from, tiny_llama

TEXTS = [
    "def parse_args(self, args=None, namespace=None):\n    return",
    "class Namespace(_AttributeHolder):\n    def __init__(self, **kwargs):",
    "import json\nimport re\n\ndef dumps(obj, *, skipkeys=False):",
    "    if not isinstance(s, str):\n        raise TypeError(",
]
TOKENS = 24


def mapped_draft(target: LlamaForCausalLM, translation: Translation, vocab_size: int, eos: int) -> LlamaForCausalLM:
    """A draft that agrees with the target where it can: the target's layers, and each shared token's
    embedding and output rows at its draft id. Its own tokens' rows stay random, and often win: only
    the draft service's mask keeps its proposals to the shared tokens."""
    draft = tiny_llama(vocab_size, seed=2, hidden=48, layers=3, init_range=0.5, eos=eos)
    state = {k: v for k, v in target.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    draft.load_state_dict(state, strict=False)
    with torch.no_grad():
        for draft_id, target_id in translation.to_target.items():
            draft.model.embed_tokens.weight[draft_id] = target.model.embed_tokens.weight[target_id]
            draft.lm_head.weight[draft_id] = target.lm_head.weight[target_id]
    return draft


def prefers_shared(target: LlamaForCausalLM, translation: Translation) -> LlamaForCausalLM:
    """The target with the rows of the tokens the draft cannot propose scaled down, so that, as in a
    real pair of high overlap, its likeliest token is more often a shared one (not always: the test
    pair's outputs hold tokens the draft must split)."""
    shared = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    shared[list(translation.to_target.values())] = True
    with torch.no_grad():
        target.lm_head.weight[~shared] *= 0.7
    return target


@dataclass
class CrossPair:
    target_tokenizer: PreTrainedTokenizerFast
    draft_tokenizer: PreTrainedTokenizerFast
    translation: Translation
    target: LoadedModel
    target_path: Path
    draft_path: Path
    orchestrator: OrchestratorThread
    target_server: ModelServer
    draft_server: ModelServer


@pytest.fixture(scope="module")
def cross(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrossPair]:
    root: Path = tmp_path_factory.mktemp("cross")
    target_tokenizer = byte_level_bpe()
    draft_tokenizer = sentencepiece_from(target_tokenizer)
    translation = Translation(target_tokenizer, draft_tokenizer)
    target_model = prefers_shared(
        tiny_llama(len(target_tokenizer), seed=1, hidden=48, layers=3, init_range=0.5, eos=0), translation
    )
    draft_model = mapped_draft(target_model, translation, len(draft_tokenizer), draft_tokenizer.eos_token_id)
    target_path = save(target_model, target_tokenizer, root / "target")
    draft_path = save(draft_model, draft_tokenizer, root / "draft")
    target = load(target_path)
    target_server = start_target(target)
    draft_server = start_draft(load(draft_path), target_tokenizer=str(target_path))
    orchestrator = OrchestratorThread(
        orchestrator_config(target_server, draft_server, draft_tokenizer=str(draft_path), cross_greedy="tli")
    )
    yield CrossPair(
        target_tokenizer,
        draft_tokenizer,
        translation,
        target,
        target_path,
        draft_path,
        orchestrator,
        target_server,
        draft_server,
    )
    orchestrator.stop()
    draft_server.stop()
    target_server.stop()


def test_a_target_token_the_draft_does_not_share_is_spelled_in_several_of_its_tokens(cross):
    translation = cross.translation
    target_bytes, draft_bytes = token_bytes(cross.target_tokenizer), token_bytes(cross.draft_tokenizer)
    split = 0
    for token in cross.target_tokenizer.encode("".join(TEXTS)):
        spelled = translation.spell(token)
        assert b"".join(draft_bytes[d] for d in spelled) == target_bytes[token]
        split += len(spelled) > 1
    assert split >= 5  # the texts hold tokens the draft must split
    # A sequence's spelling is its tokens' spellings in order; a shorter context (an older block's, a
    # rollback) is a prefix of it, ending where a target token's spelling ends.
    ids = cross.target_tokenizer.encode(TEXTS[0])
    spelled = DraftContext(translation)
    whole = spelled.of(Context(ids, ids[:3]))
    assert whole[:] == [d for t in ids + ids[:3] for d in translation.spell(t)]
    cut = spelled.of(Context(ids[:7]))
    assert cut[:] == [d for t in ids[:7] for d in translation.spell(t)]
    assert cut.base is whole.base  # no copy: the spelled sequence only grows


def test_rows_and_tokens_move_to_the_targets_ids(cross):
    translation = cross.translation
    width = len(cross.target_tokenizer)
    row = torch.zeros(len(cross.draft_tokenizer))
    shared = sorted(translation.to_target)
    row[shared[:4]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    moved = translation.target_row(row, width)
    assert moved.shape == (width,) and float(moved.sum()) == pytest.approx(1.0)
    for draft_id in shared[:4]:
        assert moved[translation.to_target[draft_id]] == row[draft_id]
    own = next(d for d in range(len(cross.draft_tokenizer)) if d not in translation.to_target)
    row[own] = 0.5
    with pytest.raises(WireFormatError, match="does not share"):
        translation.target_row(row, width)
    with pytest.raises(WireFormatError, match="does not share"):
        translation.target_ids([shared[0], own])


def greedy_request(prompt: list[int], k: int = 4) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=TOKENS,
        num_speculative_tokens=k,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
    )


def shared_prompt(cross: CrossPair, seed: int) -> list[int]:
    """Six target tokens the draft shares: where a tiny random draft agrees with its target (it is no
    language model, so a context it sees spelled differently changes its guesses)."""
    shared = sorted(cross.translation.to_target.values())
    return [shared[(seed * 7919 + i * 104729) % len(shared)] for i in range(6)]


def test_a_cross_tokenizer_pair_is_greedy_identical_to_the_target_at_8_streams(cross):
    texts = [cross.target_tokenizer.encode(text) for text in TEXTS]
    shared = [shared_prompt(cross, seed) for seed in range(8)]

    def run(prompt: list[int]) -> tuple[list[int], orchestrator_pb2.GenerateResponse]:
        tokens, _, last = collect(cross.orchestrator.stub, greedy_request(prompt))
        return tokens, last

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, texts + shared))
    split_then_rejected = drafted = accepted = 0
    for index, (prompt, (tokens, last)) in enumerate(zip(texts + shared, results, strict=True)):
        assert tokens == hf_greedy(cross.target, prompt, TOKENS)
        assert last.stats.draft_fallback_rounds == 0  # every drafted token was a shared one
        splits = [i for i, t in enumerate(tokens) if len(cross.translation.spell(t)) > 1]
        split_then_rejected += bool(splits) and last.stats.accepted_tokens < last.stats.draft_tokens
        if index >= len(texts):
            drafted += last.stats.draft_tokens
            accepted += last.stats.accepted_tokens
    assert drafted and accepted / drafted > 0.3, (accepted, drafted)  # the draft really drafts, and agrees
    # Outputs that hold a token the draft must split, from requests with rejections: their draft sessions
    # rolled back to target positions past split tokens.
    assert split_then_rejected >= 2


def test_a_cross_tokenizer_pair_keeps_the_target_distribution_at_8_streams(cross):
    """The first sampled token (its round drafts a shared token) follows the target's distribution:
    q travels in the draft's ids and is moved to the target's, zeros at the tokens it cannot propose."""
    # A prompt where q is close to p but not equal (about 13% of first tokens come from the residual
    # max(0, p - q)): a q row moved to the wrong ids is caught in 40 of 40 simulated runs at 800
    # samples (27 of 40 at 400), and was caught here when planted.
    prompt, samples = shared_prompt(cross, 0), 800

    def first_token(seed: int) -> int:
        tokens, _, last = collect(cross.orchestrator.stub, first_token_request(prompt, seed, overlap_drafting=False))
        assert last.stats.draft_fallback_rounds == 0 and last.stats.draft_tokens
        return tokens[0]

    assert float(target_first_token_probs(cross.target, prompt).max()) > 0.1  # one a wrong q would visibly bend
    pvalue = first_tokens_pvalue(cross.target, prompt, first_token, samples)
    assert pvalue > 0.01, pvalue


def test_a_pair_is_refused_unless_both_sides_name_the_others_tokenizer(cross):
    target, draft = cross.target_server.servicer.model_info(), cross.draft_server.servicer.model_info()
    assert draft.target_tokenizer_fingerprint == target.tokenizer_fingerprint
    check_pair(target, draft, cross.translation)
    with pytest.raises(PairMismatch, match="start the orchestrator with --draft-tokenizer"):
        check_pair(target, draft)
    unrestricted = common_pb2.ModelInfo()
    unrestricted.CopyFrom(draft)
    unrestricted.target_tokenizer_fingerprint = ""
    with pytest.raises(PairMismatch, match="start it with --target-tokenizer"):
        check_pair(target, unrestricted, cross.translation)
    other = Translation(cross.target_tokenizer, cross.target_tokenizer)  # the wrong --draft-tokenizer
    with pytest.raises(PairMismatch, match="is not draft model"):
        check_pair(target, draft, other)
    plain = common_pb2.ModelInfo(model="d", vocab_size=draft.vocab_size, tokenizer_fingerprint="abc")
    with pytest.raises(PairMismatch, match="or draft across tokenizers"):
        check_pair(target, plain)


def test_a_pair_below_the_overlap_floor_is_refused_at_start_naming_both(cross):
    overlap = check_overlap(cross.translation.pair, cross.target_tokenizer, 0.0)
    config = orchestrator_config(
        cross.target_server, cross.draft_server, draft_tokenizer=str(cross.draft_path), min_vocab_overlap=0.99
    )
    with pytest.raises(PairMismatch, match=rf"shares {overlap:.0%} of target tokenizer .* below the floor of 99%"):
        translation_for(cross.target_tokenizer, config)  # what the orchestrator's start-up runs


def test_a_cancel_mid_generation_leaves_both_sessions_freed_and_the_next_request_exact(cross):
    """A request whose prompt and output hold split tokens, cancelled after its first messages: both
    services end its sessions, and the same prompt again (the draft's prefix cache now holding its
    spelled prompt) is still the target's output."""
    prompt = cross.target_tokenizer.encode(TEXTS[2])
    assert any(len(cross.translation.spell(t)) > 1 for t in prompt)
    request = greedy_request(prompt)
    request.max_new_tokens = 64
    call = cross.orchestrator.stub.Generate(request)
    next(call)
    next(call)
    call.cancel()
    target, draft = cross.target_server.servicer, cross.draft_server.servicer
    assert wait_until(lambda: target.store.open_sessions == 0 == draft.store.open_sessions)
    tokens, _, last = collect(cross.orchestrator.stub, greedy_request(prompt))
    assert tokens == hf_greedy(cross.target, prompt, TOKENS) and last.stats.draft_tokens


def test_a_constrained_request_drafts_unconstrained_and_keeps_the_targets_output(cross):
    """The draft gets no constraint (it is compiled for the target's tokens); the target masks its rows
    and the orchestrator checks every token, so the output is the target alone's under the constraint."""
    assert cross.target_server.servicer.model_info().structured_output_kinds
    constraint = common_pb2.StructuredOutput(regex=r"(def|class) [a-z_]{1,12}\((self|args)?\):")
    prompt = cross.target_tokenizer.encode(TEXTS[3])

    def run(k: int) -> tuple[list[int], orchestrator_pb2.GenerateResponse]:
        request = greedy_request(prompt, k)
        request.structured_output.CopyFrom(constraint)
        tokens, _, last = collect(cross.orchestrator.stub, request)
        return tokens, last

    alone, _ = run(0)
    tokens, last = run(4)
    assert tokens == alone and last.stats.draft_tokens and last.stats.draft_fallback_rounds == 0


def test_a_freely_drafted_block_is_re_tokenized_by_the_targets_tokenizer(cross):
    """SLEM's map: the drafted text in the target's tokens, as the target's tokenizer writes it; a
    trailing partial character is left out, the draft's EOS is the target's, another special cuts."""
    translation, draft = cross.translation, cross.draft_tokenizer
    text = " return self._parse(args)\n"
    expected = cross.target_tokenizer(text, add_special_tokens=False)["input_ids"]
    drafted = [d for t in expected for d in translation.spell(t)]  # the text in draft pieces, some unshared
    assert len(drafted) > len(expected) and translation.retokenized(drafted) == expected
    target = cross.target_tokenizer
    accented = [d for t in target(" café", add_special_tokens=False)["input_ids"] for d in translation.spell(t)]
    assert translation.retokenized(accented[:-1]) == target(" caf", add_special_tokens=False)["input_ids"]  # é cut
    eos = target.eos_token_id
    assert translation.retokenized([*drafted, draft.eos_token_id, *drafted]) == [*expected, eos]
    assert translation.retokenized([draft.bos_token_id, *drafted]) == []


def _draft_step(prompt: list[int], whole_vocabulary: bool, temperature: float = 0.0) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(
        request_id="slem",
        append_token_ids=prompt,
        num_speculative_tokens=6,
        sampling=common_pb2.SamplingParams(temperature=temperature),
        whole_vocabulary=whole_vocabulary,
    )


def test_a_whole_vocabulary_step_drafts_the_drafts_own_tokens_greedy_only(cross):
    """The draft's own tokens win often on the test pair; the mask keeps them out of a TLI step, and a
    whole_vocabulary step (SLEM) proposes them. A sampled step cannot ask for it: q must stay over the
    shared tokens."""
    shared = cross.translation.to_target
    own = {True: 0, False: 0}
    with grpc.insecure_channel(f"{LOOPBACK}:{cross.draft_server.port}") as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        for seed in range(4):
            prompt = [d for t in shared_prompt(cross, seed) for d in cross.translation.spell(t)]
            for whole in (True, False):
                session = RawSession(stub.Draft)
                drafted = session.step(_draft_step(prompt, whole)).draft_token_ids
                own[whole] += sum(d not in shared for d in drafted)
                session.close()
        session = RawSession(stub.Draft)
        with pytest.raises(StepFailed, match="greedy steps only") as failed:
            session.step(_draft_step([1, 2, 3], True, temperature=0.8))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        session.close()
    assert own[False] == 0 and own[True] > 0, own


def test_string_level_exact_match_is_greedy_identical_to_the_target_at_8_streams(cross):
    """--cross-greedy slem: the draft drafts from its whole vocabulary, its text is re-tokenized for the
    target, and the outputs are the target alone's; sampled requests on the same orchestrator stay TLI."""
    config = orchestrator_config(
        cross.target_server, cross.draft_server, draft_tokenizer=str(cross.draft_path), cross_greedy="slem"
    )
    orchestrator = OrchestratorThread(config)
    try:
        prompts = [cross.target_tokenizer.encode(text) for text in TEXTS]
        prompts += [shared_prompt(cross, seed) for seed in range(4)]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: collect(orchestrator.stub, greedy_request(p)), prompts))
        drafted = accepted = 0
        for prompt, (tokens, _, last) in zip(prompts, results, strict=True):
            assert tokens == hf_greedy(cross.target, prompt, TOKENS)
            assert last.stats.draft_fallback_rounds == 0
            drafted += last.stats.draft_tokens
            accepted += last.stats.accepted_tokens
        assert drafted and accepted, (accepted, drafted)
        prompt = shared_prompt(cross, 0)
        tokens, _, last = collect(orchestrator.stub, first_token_request(prompt, 7, overlap_drafting=False))
        assert last.stats.draft_tokens and last.stats.draft_fallback_rounds == 0  # a sampled round: TLI
    finally:
        orchestrator.stop()
