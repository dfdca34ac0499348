"""Prefix caching through the services: shared prefixes are reused on both services, outputs stay the
target's own (greedy identity, and the target's distribution when sampling), salts never share, a
cache miss reopens from the replica's cached blocks, and the budget holds."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from model_host.kv_blocks import DEFAULT_BLOCK_TOKENS
from model_host.loading import LoadedModel
from specdec.v1 import common_pb2, orchestrator_pb2, target_pb2, target_pb2_grpc
from tests.conftest import RawSession, collect, hf_greedy
from tests.servers import OrchestratorThread, orchestrator_config, start_target
from tests.test_greedy_exactness import logit_gap
from tests.test_sampling_exactness import chi_square_pvalue, first_token_request

SHARED = 40  # prompt tokens every request of a test shares: two full blocks of 16


def _shared_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(SHARED)]
    return [shared + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 6))] for _ in range(count)]


def _request(prompt: list[int], **fields) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=prompt),
        max_new_tokens=20,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
        **fields,
    )


def test_greedy_outputs_with_prefix_hits_at_8_streams_are_the_targets_own(orchestrators, target_model):
    """16 prompts behind one shared prefix, 8 at a time, at K = 4: both services reuse the shared
    blocks, and every output is the target's greedy decoding (a difference must be a proven near tie)."""
    prompts = _shared_prompts(target_model.vocab_size, 16, seed=7)
    stub = orchestrators["close"].stub
    collect(stub, _request(prompts[0], num_speculative_tokens=4))  # caches the shared blocks
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: collect(stub, _request(p, num_speculative_tokens=4)), prompts))
    near_ties = []
    for prompt, (got, _, last) in zip(prompts, results, strict=True):
        assert last.stats.target_reused_prompt_tokens >= 2 * DEFAULT_BLOCK_TOKENS
        assert last.stats.draft_reused_prompt_tokens >= 2 * DEFAULT_BLOCK_TOKENS
        expected = hf_greedy(target_model, prompt, 20)
        if got != expected:
            first = next(i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b)
            gap = logit_gap(target_model, prompt + expected[:first])
            assert gap < 1e-4, f"output {first}: expected {expected[first]}, got {got[first]}; logit gap {gap:.3g}"
            near_ties.append(gap)
    print(f"near ties: {near_ties}")


def test_sampled_first_tokens_with_prefix_hits_follow_the_targets_distribution(orchestrators, target_model):
    prompt = _shared_prompts(target_model.vocab_size, 1, seed=8)[0]
    stub = orchestrators["random"].stub
    samples = 600

    def first_token(seed: int) -> tuple[int, int]:
        ids, _, last = collect(stub, first_token_request(prompt, seed))
        return ids[0], last.stats.target_reused_prompt_tokens

    collect(stub, first_token_request(prompt, samples))  # caches the prompt's blocks

    with ThreadPoolExecutor(8) as pool:
        drawn = list(pool.map(first_token, range(samples)))
    assert all(reused >= 2 * DEFAULT_BLOCK_TOKENS for _, reused in drawn)
    with torch.no_grad():
        probs = target_model.model(torch.tensor([prompt])).logits[0, -1].softmax(-1).double().numpy()
    counts = Counter((token,) for token, _ in drawn)
    pvalue = chi_square_pvalue(counts, {(t,): float(p) for t, p in enumerate(probs)}, samples)
    assert pvalue > 0.01, pvalue


def test_salts_never_share_cached_prefixes(orchestrators, target_model):
    prompt = _shared_prompts(target_model.vocab_size, 1, seed=9)[0]
    stub = orchestrators["none"].stub

    def reused(salt: str) -> int:
        _, _, last = collect(stub, _request(prompt, num_speculative_tokens=0, cache_salt=salt))
        return last.stats.target_reused_prompt_tokens

    assert reused("tenant-a") == 0
    assert reused("tenant-b") == 0
    assert reused("") == 0
    assert reused("tenant-a") >= 2 * DEFAULT_BLOCK_TOKENS
    assert reused("") >= 2 * DEFAULT_BLOCK_TOKENS
    with pytest.raises(grpc.RpcError) as error:
        collect(stub, _request(prompt, cache_salt="x" * 257))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in error.value.details()


def _argmax_step(session: RawSession, keep: int, tokens: list[int]) -> target_pb2.VerifyResponse:
    return session.step(target_pb2.VerifyRequest(keep=keep, append_token_ids=tokens[keep:], num_rows=1))


def test_a_cache_miss_reopens_from_the_blocks_the_replica_still_holds(target_model: LoadedModel):
    """The session's cache is evicted mid-generation; the resend with keep = 0 starts from its own
    blocks, still cached, and answers what the target alone computes."""
    server = start_target(target_model)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            session = RawSession(target_pb2_grpc.TargetServiceStub(channel).Verify)
            tokens = _shared_prompts(target_model.vocab_size, 1, seed=10)[0][:SHARED]
            first = _argmax_step(session, 0, tokens)
            assert first.timing.reused_tokens == 0 and first.cached_tokens == SHARED
            assert server.servicer.store.evict_all() == 1
            tokens = [*tokens, first.argmax_token_ids[0]]
            missed = _argmax_step(session, SHARED, tokens)
            assert missed.result == common_pb2.SESSION_RESULT_CACHE_MISS
            reopened = _argmax_step(session, 0, tokens)
            assert reopened.timing.reused_tokens == 2 * DEFAULT_BLOCK_TOKENS
            assert reopened.cached_tokens == len(tokens)
            with torch.no_grad():
                want = int(target_model.model(torch.tensor([tokens])).logits[0, -1].argmax())
            assert reopened.argmax_token_ids[0] == want
            session.close()
    finally:
        server.stop()


def test_rollback_into_a_reused_prefix_leaves_the_other_sessions_blocks_alone(target_model: LoadedModel):
    """Session B starts from A's blocks and rolls back into them; A's next step still sees its own."""
    server = start_target(target_model)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            a, b = RawSession(stub.Verify), RawSession(stub.Verify)
            rng = random.Random(11)
            tokens = [rng.randrange(1, target_model.vocab_size) for _ in range(36)]
            _argmax_step(a, 0, tokens)
            other = [*tokens[:34], 1, 2]
            assert _argmax_step(b, 0, other).timing.reused_tokens == 32
            rolled = [*other[:20], 3, 4, 5]  # into B's second block, which is A's
            got_b = _argmax_step(b, 20, rolled).argmax_token_ids[0]
            extended = [*tokens, 6]
            got_a = _argmax_step(a, 36, extended).argmax_token_ids[0]
            with torch.no_grad():
                for sequence, got in ((rolled, got_b), (extended, got_a)):
                    assert got == int(target_model.model(torch.tensor([sequence])).logits[0, -1].argmax())
            a.close()
            b.close()
    finally:
        server.stop()


def test_no_prefix_caching_reuses_nothing_and_a_seed_reproduces(target_model: LoadedModel):
    server = start_target(target_model, prefix_caching=False)
    orchestrator = OrchestratorThread(orchestrator_config(server))
    try:
        prompt = _shared_prompts(target_model.vocab_size, 1, seed=12)[0]
        request = _request(prompt, num_speculative_tokens=0, temperature=1.0, seed=5)
        outputs = [collect(orchestrator.stub, request) for _ in range(3)]
        assert all(last.stats.target_reused_prompt_tokens == 0 for _, _, last in outputs)
        assert len({tuple(ids) for ids, _, _ in outputs}) == 1
    finally:
        orchestrator.stop()
        server.stop()


def test_turns_of_a_conversation_follow_its_blocks_across_replicas(target_model: LoadedModel):
    """Two target replicas: with cache-aware routing, every later turn of each conversation reuses
    its history (it is sent where that history is cached)."""
    servers = [start_target(target_model), start_target(target_model)]
    address = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    orchestrator = OrchestratorThread(orchestrator_config(address))
    try:
        rng = random.Random(13)
        conversations = [[rng.randrange(1, target_model.vocab_size) for _ in range(20)] for _ in range(6)]
        for turn in range(3):
            for history in conversations:
                history += [rng.randrange(1, target_model.vocab_size) for _ in range(4)]
                ids, _, last = collect(orchestrator.stub, _request(list(history), num_speculative_tokens=0))
                if turn:
                    assert last.stats.target_reused_prompt_tokens >= len(history) - 2 * DEFAULT_BLOCK_TOKENS
                history += ids
    finally:
        orchestrator.stop()
        for server in servers:
            server.stop()
