"""The draft's lean forward pass computes the model's own function, batched over sessions, through
prefill, steps and rollback."""

from __future__ import annotations

import random

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from draft_service.lean import LeanDraft
from draft_service.servicer import DraftServicer
from model_host.config import ModelServiceConfig
from model_host.kv_blocks import BlockStore
from model_host.rows import Row
from tests.tiny_models import tiny_llama


def _store(model) -> BlockStore:
    return BlockStore(torch.device("cpu"), torch.float32, model.config.max_position_embeddings)


def test_matches_hugging_face_forward_under_random_rollbacks_in_batches():
    model = tiny_llama(96, seed=4, hidden=48, layers=3)  # grouped-query attention: 4 heads, 2 kv heads
    lean = LeanDraft.attach(model, _store(model))
    assert lean is not None
    rng = random.Random(0)
    sequences: list[list[int]] = [[], [], []]
    with torch.inference_mode():
        for _ in range(30):
            rows = []
            chosen = rng.sample(range(3), rng.randrange(1, 4))  # a changing subset of sessions, any slot order
            for slot in chosen:
                sequence = sequences[slot]
                del sequence[rng.randrange(0, len(sequence) + 1) :]
                new = [rng.randrange(96) for _ in range(rng.choice([1, 1, 2, 5]))]
                rows.append(Row(slot=slot, start=len(sequence), token_ids=new, num_logits=1))
                sequence += new
            for row, got in zip(rows, lean(rows), strict=True):
                want = model(torch.tensor([sequences[row.slot]])).logits[0, -1]
                assert got is not None
                assert torch.allclose(got[0], want, atol=1e-4), (got[0] - want).abs().max()


def test_a_long_row_over_many_blocks_and_a_prefix_reused_from_them():
    model = tiny_llama(64, seed=5, max_context=1024)
    store = _store(model)
    lean = LeanDraft.attach(model, store)
    assert lean is not None
    ids = list(range(1, 64)) * 8  # 504 tokens: 32 blocks
    with torch.inference_mode():
        got = lean([Row(slot=5, start=0, token_ids=ids, num_logits=1)])[0]
        want = model(torch.tensor([ids])).logits[0, -1]
        assert got is not None and torch.allclose(got[0], want, atol=1e-4)
        other = [*ids[:300], 7, 8]
        start = lean.store.reuse(6, other, len(other) - 1, b"")
        assert start == 288
        again = lean([Row(slot=6, start=start, token_ids=other[start:], num_logits=2)])[0]
        assert again is not None and torch.allclose(again, model(torch.tensor([other])).logits[0, -2:], atol=1e-4)


def test_fused_projections_keep_biases_and_the_models_own_forward():
    # Qwen2 has biases on its query, key and value projections; the lean pass fuses all three.
    torch.manual_seed(6)
    config = Qwen2Config(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    for layer in model.model.layers:
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(projection.bias, std=0.5)  # zero at initialisation: make them count
    ids = torch.randint(0, 80, (1, 20))
    with torch.inference_mode():
        before = model(ids).logits[0]
        lean = LeanDraft.attach(model, _store(model))
        assert lean is not None
        assert torch.equal(model(ids).logits[0], before)
        first = lean([Row(slot=0, start=0, token_ids=ids[0, :12].tolist(), num_logits=1)])[0]
        second = lean([Row(slot=0, start=12, token_ids=ids[0, 12:].tolist(), num_logits=1)])[0]
    assert first is not None and second is not None
    assert torch.allclose(torch.cat([first, second]), before[[11, 19]], atol=1e-4)


def test_unsupported_architectures_keep_the_ordinary_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert LeanDraft.attach(gpt2, _store(gpt2)) is None


def test_draft_service_uses_it_and_can_be_told_not_to(close_draft_model):
    with_lean = DraftServicer(close_draft_model, ModelServiceConfig(model="x"))
    without = DraftServicer(close_draft_model, ModelServiceConfig(model="x", lean_draft=False))
    try:
        assert with_lean.lean is not None and with_lean.engine.forward is with_lean.lean
        assert without.lean is None and without.engine.forward.name == "batched"
    finally:
        with_lean.stop()
        without.stop()
