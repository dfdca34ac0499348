"""What benchmark tools and evaluation harnesses send: ignore_eos, min_tokens, stop_token_ids, and the
target's logprobs (generated and prompt), held to the target alone through the three services."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from model_host.loading import LoadedModel
from specdec.v1 import orchestrator_pb2
from tests.conftest import RawSession, collect, hf_generate, hf_greedy
from tests.test_sampling_exactness import first_token_pvalue

EOS = 0
FIXED = orchestrator_pb2.SPECULATION_POLICY_FIXED


def request(prompt: list[int], max_new_tokens: int = 24, k: int = 4, **fields: Any) -> Any:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=max_new_tokens,
        num_speculative_tokens=k,
        speculation_policy=FIXED,
        **fields,
    )


def generate(stub: Any, message: Any) -> tuple[list[int], list[Any], Any]:
    """Token ids, logprob entries (all messages') and the last message of a Generate call."""
    ids: list[int] = []
    logprobs: list[Any] = []
    last = None
    for response in stub.Generate(message):
        ids.extend(response.token_ids)
        logprobs.extend(response.logprobs)
        assert len(response.logprobs) in (0, len(response.token_ids))
        last = response
    assert last is not None
    return ids, logprobs, last


def greedy_alone(model: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """The target decoding alone with no end at EOS: argmax of its own forward, n times."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            sequence.append(int(model.model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt) :]


@pytest.fixture(scope="module")
def eos_prompts(target_model: LoadedModel) -> list[list[int]]:
    """Prompts whose greedy continuation reaches EOS within 20 tokens."""
    rng = random.Random(7)
    found = []
    for _ in range(400):
        prompt = [rng.randrange(1, target_model.vocab_size) for _ in range(rng.randrange(2, 10))]
        if EOS in hf_greedy(target_model, prompt, 20):
            found.append(prompt)
        if len(found) == 3:
            break
    assert found, "no prompt of the tiny target reaches EOS"
    return found


@pytest.mark.parametrize("k", [0, 4])
def test_ignore_eos_generates_past_eos_as_the_target_alone(orchestrators, target_model, eos_prompts, k):
    for prompt in eos_prompts:
        plain, _, last = generate(orchestrators["close"].stub, request(prompt, 30, k))
        assert plain[-1] == EOS and last.finish_reason == orchestrator_pb2.FINISH_REASON_EOS
        got, _, last = generate(orchestrators["close"].stub, request(prompt, 30, k, ignore_eos=True))
        assert got == greedy_alone(target_model, prompt, 30)
        assert EOS in got[:-1] and last.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("k", [0, 4])
def test_stop_token_ids_and_min_tokens_are_hf_generates(orchestrators, target_model, k):
    rng = random.Random(11)
    for _ in range(4):
        prompt = [rng.randrange(1, target_model.vocab_size) for _ in range(5)]
        stop = hf_greedy(target_model, prompt, 3)[1]  # the greedy path's second token
        expected, _ = hf_generate(target_model, prompt, 24, eos_token_id=[EOS, stop])
        got, _, last = generate(orchestrators["close"].stub, request(prompt, 24, k, stop_token_ids=[stop]))
        assert got == expected and got[-1] == stop
        assert last.finish_reason == orchestrator_pb2.FINISH_REASON_STOP
        # min_tokens masks the stop token (and EOS) in both models' rows until 8 tokens are out.
        expected, _ = hf_generate(target_model, prompt, 24, eos_token_id=[EOS, stop], min_new_tokens=8)
        got, _, _ = generate(orchestrators["close"].stub, request(prompt, 24, k, stop_token_ids=[stop], min_tokens=8))
        assert got == expected and len(got) >= 8 and stop not in got[:7] and EOS not in got[:7]


def test_min_tokens_keeps_the_target_distribution_under_sampling(orchestrators, target_model):
    """The three most likely first tokens are stop tokens, banned by min_tokens = 2: the first token
    follows the target's distribution with them masked (chi-square), drafted by the close draft."""
    prompt = [5, 6, 7]
    with torch.no_grad():
        logits = target_model.model(torch.tensor([prompt])).logits[0, -1]
    banned = logits.topk(3).indices.tolist()
    logits[banned] = float("-inf")
    logits[EOS] = float("-inf")
    samples = 400
    stub = orchestrators["close"].stub

    def first_token(seed: int) -> int:
        message = request(prompt, 2, 2, temperature=1.0, seed=seed, stop_token_ids=banned, min_tokens=2)
        message.overlap_drafting = False
        tokens, _, _ = generate(stub, message)
        assert not set(tokens[:2]) & {*banned, EOS}
        return tokens[0]

    with ThreadPoolExecutor(8) as pool:
        counts = Counter(pool.map(first_token, range(samples)))
    pvalue = first_token_pvalue(counts, logits.softmax(-1), samples)
    assert pvalue > 0.01, pvalue


def test_the_draft_masks_banned_tokens_below_the_position(close_draft_server):
    """A draft step with a ban never proposes a banned id where the ban applies, and may after it."""
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{close_draft_server.port}")
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    prompt = [5, 6, 7]

    def draft(ban: common_pb2.TokenBan | None, session: int) -> list[int]:
        raw = RawSession(stub.Draft, session)
        step = draft_pb2.DraftRequest(keep=0, append_token_ids=prompt, num_speculative_tokens=4)
        if ban is not None:
            step.ban.CopyFrom(ban)
        response = raw.step(step)
        raw.close()
        return list(response.draft_token_ids)

    free = draft(None, 1)
    banned = draft(common_pb2.TokenBan(token_ids=free[:2], until=len(prompt) + 2), 2)
    assert banned[0] not in free[:2] and banned[1] not in free[:2]
    channel.close()


def test_bad_extras_are_refused_naming_the_field(orchestrators, target_model):
    stub = orchestrators["close"].stub
    vocab = target_model.vocab_size
    cases = [
        (request([3, 4], 4, min_tokens=5), "min_tokens"),
        (request([3, 4], 4, stop_token_ids=[vocab]), "stop_token_ids"),
        (request([3, 4], 4, stop_token_ids=list(range(1, 258))), "stop_token_ids"),
        (request([3, 4], 4, logprobs=True, top_logprobs=21), "top_logprobs"),
        (request([3, 4], 4, top_logprobs=2), "top_logprobs needs logprobs"),
        (request([3, 4], 4, prompt_logprobs=21), "prompt_logprobs"),
    ]
    for message, words in cases:
        with pytest.raises(grpc.RpcError) as failure:
            collect(stub, message)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in failure.value.details()


def processed_logprobs(model: LoadedModel, prompt: list[int], output: list[int], **sampling: Any) -> torch.Tensor:
    """[len(output), vocab] the target alone's log-softmax at each output position, over the same
    sequence, after Hugging Face's own warpers (greedy: none)."""
    sequence = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model.model(sequence).logits[0, len(prompt) - 1 : -1].float()
    warpers: list[Any] = []
    if sampling:
        warpers = [TemperatureLogitsWarper(sampling["temperature"])]
        if sampling.get("top_k"):
            warpers.append(TopKLogitsWarper(sampling["top_k"]))
        if sampling.get("top_p", 1.0) < 1.0:
            warpers.append(TopPLogitsWarper(sampling["top_p"]))
    rows = []
    for position, row in enumerate(logits):
        scores = row[None]
        for warper in warpers:
            scores = warper(sequence[:, : len(prompt) + position], scores)
        rows.append(scores[0].log_softmax(-1))
    return torch.stack(rows)


def check_entries(entries: list[Any], output: list[int], expected: torch.Tensor, top: int) -> None:
    assert [e.token_id for e in entries] == output
    for entry, row in zip(entries, expected, strict=True):
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert len(entry.top) == top
        values = row.topk(top).values.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values, abs=1e-4)
        for alternative in entry.top:  # ids may differ only among tied values
            assert float(row[alternative.token_id]) == pytest.approx(alternative.logprob, abs=1e-4)


@pytest.mark.parametrize("k", [0, 4])
def test_greedy_logprobs_are_hf_generates_output_scores(orchestrators, target_model, k):
    rng = random.Random(3)
    for _ in range(3):
        prompt = [rng.randrange(1, target_model.vocab_size) for _ in range(6)]
        expected_ids, scores = hf_generate(target_model, prompt, 16)
        got, entries, _ = generate(orchestrators["close"].stub, request(prompt, 16, k, logprobs=True, top_logprobs=5))
        assert got == expected_ids
        check_entries(entries, got, torch.stack([s[0].float().log_softmax(-1) for s in scores]), 5)


@pytest.mark.parametrize("k", [0, 4])
def test_sampled_logprobs_are_the_targets_processed_distribution(orchestrators, target_model, k):
    sampling = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    for seed in range(3):
        prompt = [4 + seed, 9, 17]
        message = request(prompt, 16, k, logprobs=True, top_logprobs=3, seed=seed, **sampling)
        got, entries, _ = generate(orchestrators["close"].stub, message)
        check_entries(entries, got, processed_logprobs(target_model, prompt, got, **sampling), 3)


def test_prompt_logprobs_are_the_targets_raw_log_softmax(orchestrators, target_model):
    prompt = [5, 11, 23, 42, 8, 19]
    with torch.no_grad():
        rows = target_model.model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    for k in (0, 4):
        responses = list(orchestrators["close"].stub.Generate(request(prompt, 6, k, prompt_logprobs=2)))
        entries = list(responses[0].prompt_logprobs)
        assert all(not r.prompt_logprobs for r in responses[1:])
        check_entries(entries, prompt[1:], rows, 2)
        assert not responses[0].logprobs  # generated tokens' logprobs were not asked for
