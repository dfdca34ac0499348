"""The big-vocabulary pair (`bench --pair big-vocab`): Llama 3's vocabulary size, 128,256 tokens, with
a word-level tokenizer of that size (ids beyond the default tokenizer's 4,096 could not be detokenized).

What a sampled round costs on the wire grows with the vocabulary, so this pair is where the rows'
bytes show. Random initialisation would give near-uniform rows, p close to q and an acceptance near 1:
an artefact. So the pair is built to behave like a real one:
- rows are peaked: the output layer is scaled so that the top token takes most of the mass;
- the draft agrees only partly: the target is the draft's one-layer bigram model embedded in a wider,
  deeper model (hidden 256, 4 layers), whose layers move its logits away from the draft's. Their
  output projections are scaled by DISAGREEMENT; `python -m bench.link` reports the acceptance.
- the target costs what a target does relative to its draft: on CPU a 128k-row output layer dominates
  a step, and the target's is four times as wide.
Neither model has an end-of-sequence token, so every request runs to max_new_tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 128_256
DRAFT_HIDDEN, TARGET_HIDDEN = 64, 256
# The output layer's scale: rows whose top token takes about 0.8 of the mass at temperature 1.
PEAK_SCALE = 150.0
# The target's layers' output projections, scaled: an acceptance of about 0.75 at temperature 1.
DISAGREEMENT = 1.0


def _config(hidden: int, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", pad_token="<unk>")


def build_big_vocab_pair(folder: Path) -> Path:
    """Write folder/target and folder/draft once; returns `folder`."""
    if (folder / "draft" / "config.json").exists():
        return folder
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(0)
        draft = LlamaForCausalLM(_config(DRAFT_HIDDEN, 1)).eval()
        target = LlamaForCausalLM(_config(TARGET_HIDDEN, 4)).eval()
        embedding = torch.randn(VOCAB, DRAFT_HIDDEN)
        head = torch.randn(VOCAB, DRAFT_HIDDEN) * draft.config.initializer_range * PEAK_SCALE
        draft.model.embed_tokens.weight.copy_(embedding)
        draft.lm_head.weight.copy_(head)
        for layer in draft.model.layers:  # the draft is a bigram model: its layer adds nothing
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # The target holds the draft in its first DRAFT_HIDDEN dimensions. RMSNorm over the wider state
        # (zeros elsewhere) scales it by sqrt(TARGET_HIDDEN / DRAFT_HIDDEN), which the head undoes.
        target.model.embed_tokens.weight.zero_()
        target.model.embed_tokens.weight[:, :DRAFT_HIDDEN].copy_(embedding)
        target.lm_head.weight.zero_()
        target.lm_head.weight[:, :DRAFT_HIDDEN].copy_(head * (DRAFT_HIDDEN / TARGET_HIDDEN) ** 0.5)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(DISAGREEMENT)
            layer.mlp.down_proj.weight.mul_(DISAGREEMENT)
    tokenizer = _tokenizer()
    partial = folder.with_name(folder.name + ".partial")  # renamed whole: a crash leaves no half-written pair
    shutil.rmtree(partial, ignore_errors=True)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.eos_token_id = None
        model.generation_config.bos_token_id = None
        model.save_pretrained(partial / name)
        tokenizer.save_pretrained(partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
