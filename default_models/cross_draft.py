"""Train the cross-tokenizer demo draft: a draft with a tokenizer of its own for the default target.

    python -m default_models.cross_draft --out default_models/cross_draft     (make cross-models)

1. Its tokenizer is SentencePiece-style, in Llama 2's layout: BPE over text whose spaces are ▁
   (a `Prepend`/`Replace` normalizer, so the map's normalising is exercised), byte fallback (the
   256 `<0xNN>` pieces), `<unk>`, `<s>`, `</s>`; pieces never cross a space. It is trained on the same
   library text as the default pair, and shares only part of the target's byte-level vocabulary.
2. The model has the default draft's shape. Its body (layers, final norm) starts from the default
   draft's (`--init draft`, the default: a trained small model whose vocabulary is replaced, as one
   would re-vocabulary a small model of another family) or from the target's first layers
   (`--init target`); each piece's embedding (tied to the head) is the mean of that model's
   embeddings of the target tokens that spell its bytes.
3. It is trained by sequence-level distillation: next-token loss on the target's own continuations
   (greedy and sampled, as the default draft's second stage), half and half with library text.
   Logit distillation needs one vocabulary; this needs only the target's text.

The text is written in the draft's ids the way the orchestrator spells it in service
(orchestrator/translation.py): each target token as its shared piece, else the draft's longest
pieces for its bytes. That is what the draft reads in service, so it is what it learns on.

It writes a Hugging Face checkpoint (model, tokenizer) and training.json, through a staging folder,
so OUT is never half-written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from default_models.corpus import load_corpus, read_text
from default_models.train import (
    TrainConfig,
    _optimise,
    _tail_mean,
    batches,
    build_model,
    encode_corpus,
    generation_prompts,
    mixed_batches,
    next_token_loss,
    save,
    target_generations,
)
from orchestrator.translation import Translation
from serving.vocab_map import check_overlap, ids_by_bytes, spell_longest, token_bytes

METASPACE = "\u2581"
SPECIALS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class CrossConfig:
    """Every knob of the recipe, with its default."""

    vocab_size: int = 4096  # all pieces: the 3 specials and 256 bytes included
    limit_alphabet: int = 160  # rarer characters are written in byte pieces
    init: str = "draft"  # whose body the draft starts from: the default draft's, or the target's first layers
    steps: int = 1800
    learning_rate: float = 3e-3
    generations: int = 2048
    seed: int = 4321
    threads: int = 2


def sentencepiece_layout(model: Tokenizer) -> None:
    """Llama 2's normalizer and decoder on `model`, whose pieces write spaces as ▁ and bytes it has no
    piece for as `<0xNN>`: ▁ is prepended and stands for every space; decoding reads them back."""
    model.normalizer = normalizers.Sequence([normalizers.Prepend(METASPACE), normalizers.Replace(" ", METASPACE)])
    model.decoder = decoders.Sequence(
        [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )


def train_tokenizer(texts: list[str], cfg: CrossConfig) -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE with byte fallback, in Llama 2's layout (see the module's docstring)."""
    # A piece is a run of ▁, or ▁s and what follows up to the next ▁ or line break, or line breaks.
    splitter = pre_tokenizers.Split(Regex(f"{METASPACE}*[^{METASPACE}\n]+|{METASPACE}+|\n+"), behavior="isolated")
    learner = Tokenizer(models.BPE())
    sentencepiece_layout(learner)
    learner.pre_tokenizer = splitter
    learner.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=cfg.vocab_size - len(SPECIALS) - 256, limit_alphabet=cfg.limit_alphabet, show_progress=False
        ),
    )
    learnt = json.loads(learner.to_str())["model"]
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
    for piece, _ in sorted(learnt["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges: list[tuple[str, str]] = [
        (m.split(" ", 1)[0], m.split(" ", 1)[1]) if isinstance(m, str) else (m[0], m[1]) for m in learnt["merges"]
    ]
    model = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    sentencepiece_layout(model)
    model.pre_tokenizer = splitter
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def init_from(draft: LlamaForCausalLM, source: LlamaForCausalLM, translation: Translation) -> None:
    """`source`'s first layers and final norm (a model of the target's vocabulary); each piece's
    embedding the mean of its embeddings of the target tokens that spell the piece's bytes (the EOS
    and BOS: the target's EOS)."""
    draft.model.norm.load_state_dict(source.model.norm.state_dict())
    for draft_layer, source_layer in zip(draft.model.layers, source.model.layers, strict=False):
        draft_layer.load_state_dict(source_layer.state_dict())
    target_rows = source.get_input_embeddings().weight.detach()
    rows = target_rows.mean(dim=0).repeat(draft.config.vocab_size, 1)
    target_index = ids_by_bytes(translation.target)
    longest = max(map(len, target_index))
    for draft_id, data in token_bytes(translation.draft).items():
        ids = spell_longest(data, target_index, longest)
        if ids:
            rows[draft_id] = target_rows[ids].mean(dim=0)
    eos = source.config.eos_token_id
    rows[translation.draft.eos_token_id] = rows[translation.draft.bos_token_id] = target_rows[eos]
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(rows)


def spelled(stream: torch.Tensor, translation: Translation, target_eos: int) -> torch.Tensor:
    """A target-id stream in the draft's ids, spelled as the orchestrator spells it; EOS to EOS."""
    eos = translation.draft.eos_token_id
    ids: list[int] = []
    for token in stream.tolist():
        ids.extend((eos,) if token == target_eos else translation.spell(token))
    return torch.tensor(ids, dtype=torch.long)


def train(cfg: CrossConfig, pair: Path, out: Path) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    corpus = load_corpus()
    texts = [read_text(p) for p in corpus.train_files]
    target_tokenizer = PreTrainedTokenizerFast.from_pretrained(pair / "target")
    target = LlamaForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    tokenizer = train_tokenizer(texts, cfg)
    translation = Translation(target_tokenizer, tokenizer)
    overlap = check_overlap(translation.pair, target_tokenizer, 0.0)
    print(f"tokenizer: {len(tokenizer)} pieces, {len(translation.to_target)} shared; weighted overlap {overlap:.1%}")

    shape = TrainConfig(seed=cfg.seed, threads=cfg.threads, generations=cfg.generations)
    target_stream = encode_corpus(target_tokenizer, texts)
    generator = torch.Generator().manual_seed(cfg.seed)
    prompts = generation_prompts(target_tokenizer, target_stream, corpus.train_files, shape, generator)
    generated = target_generations(target, target_tokenizer, prompts, shape)
    eos = target_tokenizer.eos_token_id
    text_ids, generated_ids = spelled(target_stream, translation, eos), spelled(generated, translation, eos)
    print(f"training text: {text_ids.numel():,} draft tokens; target continuations: {generated_ids.numel():,}")

    draft = build_model(shape.draft, shape, tokenizer)
    source = target if cfg.init == "target" else LlamaForCausalLM.from_pretrained(pair / "draft", dtype=torch.float32)
    init_from(draft, source, translation)
    half = dataclasses.replace(shape, batch_size=shape.batch_size // 2)
    losses = _optimise(
        draft,
        cfg.steps,
        cfg.learning_rate,
        shape,
        mixed_batches(batches(text_ids, half, generator), batches(generated_ids, half, generator)),
        next_token_loss,
        "cross draft (sequence-level distillation)",
    )
    record = {
        "config": asdict(cfg),
        "shape": asdict(shape.draft),
        "pieces": len(tokenizer),
        "shared_tokens": len(translation.to_target),
        "weighted_overlap": overlap,
        "training_tokens": text_ids.numel(),
        "generated_tokens": generated_ids.numel(),
        "final_loss": _tail_mean(losses),
        "parameters": draft.num_parameters(),
        "minutes": (time.perf_counter() - started) / 60,
    }
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    save(draft, tokenizer, staging)
    (staging / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=Path, default=Path("default_models/pair"))
    parser.add_argument("--out", type=Path, default=Path("default_models/cross_draft"))
    parser.add_argument("--steps", type=int, default=CrossConfig.steps)
    parser.add_argument("--init", choices=("draft", "target"), default=CrossConfig.init)
    parser.add_argument("--generations", type=int, default=CrossConfig.generations)
    parser.add_argument("--threads", type=int, default=CrossConfig.threads)
    args = parser.parse_args(argv)
    cfg = CrossConfig(init=args.init, steps=args.steps, generations=args.generations, threads=args.threads)
    record = train(cfg, args.pair, args.out)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
