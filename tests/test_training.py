"""The default pair's training recipe: the growth step keeps the function, target generations are well formed,
and a run stopped part-way leaves a whole pair that `--resume` goes on from."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from default_models import cross_draft as cross_recipe
from default_models import train as recipe
from default_models.corpus import Corpus
from default_models.train import ModelShape, TrainConfig, build_model, grow, target_generations, train_tokenizer
from orchestrator.translation import Translation

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n    y: int = 0\n"] * 20


@pytest.fixture(scope="module")
def tiny():
    cfg = TrainConfig(
        vocab_size=300, target=ModelShape(32, 64, 2, 2), generations=6, generation_batch=4, generation_tokens=5
    )
    tokenizer = train_tokenizer(TEXTS, cfg.vocab_size)
    torch.manual_seed(0)
    return cfg, tokenizer, build_model(cfg.target, cfg, tokenizer).eval()


def test_grow_adds_identity_layers_that_then_train(tiny):
    _, tokenizer, model = tiny
    grown = grow(model, 2)
    assert grown.config.num_hidden_layers == model.config.num_hidden_layers + 2
    ids = torch.tensor([tokenizer(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(grown(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    grown.train()
    grown(ids, labels=ids).loss.backward()
    new_layer = grown.model.layers[-1]
    assert new_layer.mlp.down_proj.weight.grad.abs().sum() > 0  # the zeroed projections do learn
    assert new_layer.self_attn.o_proj.weight.grad.abs().sum() > 0


def test_target_generations_form_one_stream_of_prompt_continuation_eos(tiny):
    cfg, tokenizer, model = tiny
    prompts = [tokenizer(t)["input_ids"] for t in ("def add(a, b):", "class", "x: int = 0\n", "def")]
    prompts += prompts[:2]
    stream = target_generations(model, tokenizer, prompts, cfg).tolist()
    eos = tokenizer.eos_token_id
    pieces: list[list[int]] = []
    current: list[int] = []
    for token in stream:
        if token == eos:
            pieces.append(current)
            current = []
        else:
            current.append(token)
    assert not current and len(pieces) == len(prompts)
    for prompt, piece in zip(prompts, pieces, strict=True):
        assert piece[: len(prompt)] == prompt  # left padding never leaks into the stream
        assert len(prompt) < len(piece) <= len(prompt) + cfg.generation_tokens
    # The first batch is greedy: each row continues exactly as its prompt would alone, unpadded.
    for prompt, piece in zip(prompts[: cfg.generation_batch], pieces, strict=False):
        alone = model.generate(
            torch.tensor([prompt]), max_new_tokens=cfg.generation_tokens, do_sample=False, pad_token_id=eos
        )[0].tolist()
        alone = alone[: alone.index(eos, len(prompt))] if eos in alone[len(prompt) :] else alone
        assert piece == alone


def test_a_run_stopped_mid_recipe_leaves_a_whole_pair_that_resume_finishes(tmp_path, monkeypatch):
    source = tmp_path / "lib.py"
    source.write_text(
        "".join(f"def add_{i}(first_number, second_number):\n    return first_number + {i}\n" for i in range(40))
    )
    monkeypatch.setattr(recipe, "load_corpus", lambda: Corpus(train_files=[source], held_out_files=[]))
    cfg = TrainConfig(
        vocab_size=300, target=ModelShape(32, 64, 2, 2), draft=ModelShape(32, 64, 1, 2), seq_len=32, batch_size=4,
        target_steps=2, draft_steps=2, warmup_steps=1, target_steps_2=2, generations=4, generation_tokens=4,
        generation_batch=2, draft_rounds=(2, 2), threads=torch.get_num_threads(),
    )  # fmt: skip
    out = tmp_path / "pair"
    real_round = recipe.distil_round

    def round_that_dies_second(index: int, *args):
        if index == 1:
            raise KeyboardInterrupt  # the run is stopped during the second draft round
        return real_round(index, *args)

    monkeypatch.setattr(recipe, "distil_round", round_that_dies_second)
    with pytest.raises(KeyboardInterrupt):
        recipe.train(cfg, out)
    saved = json.loads((out / "training.json").read_text())
    assert len(saved["rounds"]) == 1 and "target_final_loss" in saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib.py", "pair"]  # no staging folder left behind
    target = AutoModelForCausalLM.from_pretrained(out / "target")
    assert target.config.num_hidden_layers == 3  # the grown target was saved before the rounds began
    assert target.num_parameters() == saved["target_parameters"]

    monkeypatch.setattr(recipe, "distil_round", real_round)
    record = recipe.train(cfg, out, resume=out)
    assert [r["steps"] for r in record["rounds"]] == [2, 2]
    assert record["rounds"][0] == saved["rounds"][0] and record["stage1"] == saved["stage1"]
    assert record["target_final_loss"] == saved["target_final_loss"]  # the target was not trained again
    written = json.loads((out / "training.json").read_text())
    assert written == json.loads(json.dumps(record)) | {
        "target_parameters": target.num_parameters(),
        "draft_parameters": AutoModelForCausalLM.from_pretrained(out / "draft").num_parameters(),
    }
    with pytest.raises(SystemExit, match="nothing to resume"):
        recipe.train(cfg, out, resume=out)


def test_the_cross_drafts_tokenizer_is_sentencepiece_style_and_its_pieces_start_from_the_targets_rows(tiny):
    """default_models/cross_draft.py: a Llama 2 layout (specials, 256 byte pieces, ▁ for spaces) that the
    vocabulary map reads by bytes; the text the draft learns on is spelled as the orchestrator spells
    it; each piece's embedding starts as the mean of the source's rows for the target tokens of its bytes."""
    cfg, target_tokenizer, model = tiny
    draft_tokenizer = cross_recipe.train_tokenizer(TEXTS, cross_recipe.CrossConfig(vocab_size=330, limit_alphabet=40))
    assert draft_tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 258]) == ["<unk>", "<s>", "</s>", "<0x00>", "<0xFF>"]
    text = "def add(a, b):\n    return a + b  # é\n"
    ids = draft_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert draft_tokenizer.decode(ids) == text
    assert "<0xC3>" in draft_tokenizer.convert_ids_to_tokens(ids)  # é, a character it has no piece for
    translation = Translation(target_tokenizer, draft_tokenizer)
    assert translation.to_target  # they share pieces, by bytes (▁ is a space)
    stream = torch.tensor([*target_tokenizer(text)["input_ids"], target_tokenizer.eos_token_id])
    spelled = cross_recipe.spelled(stream, translation, target_tokenizer.eos_token_id).tolist()
    assert spelled[-1] == draft_tokenizer.eos_token_id
    assert draft_tokenizer.decode(spelled[:-1]) == text
    draft = build_model(cfg.target, cfg, draft_tokenizer)
    cross_recipe.init_from(draft, model, translation)
    rows, source = draft.get_input_embeddings().weight, model.get_input_embeddings().weight
    for draft_id, target_id in list(translation.to_target.items())[:20]:
        assert torch.equal(rows[draft_id], source[target_id])  # a shared piece: its one target token's row
    assert torch.equal(rows[draft_tokenizer.eos_token_id], source[target_tokenizer.eos_token_id])
    for mine, theirs in zip(draft.model.layers, model.model.layers, strict=True):
        assert torch.equal(mine.mlp.up_proj.weight, theirs.mlp.up_proj.weight)
