"""Train specdec's default model pair from the Python standard library's source.

    python -m default_models.train --out default_models/pair

Three steps, all with fixed seeds:
1. a byte-level BPE tokenizer shared by both models;
2. the target, a small Llama-architecture model, trained on next-token prediction;
3. the draft, a much smaller model distilled from the target: trained to match the target's
   next-token distributions (KL divergence), not only the text, because acceptance rate is what a
   draft is for.
It writes ordinary Hugging Face checkpoints (`target/`, `draft/`, each with the tokenizer files).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from default_models.corpus import load_corpus, read_text

EOS_TOKEN = "<|endoftext|>"
# (model, window [batch, seq_len + 1]) -> scalar loss
LossFn = Callable[[LlamaForCausalLM, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of one Llama-architecture model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of the recipe, with its default; `--scale` multiplies the model widths."""

    vocab_size: int = 4096
    max_position_embeddings: int = 1024
    target: ModelShape = field(default_factory=lambda: ModelShape(320, 864, 6, 5))
    # The draft has the target's width so that it can start from the target's embeddings, first layers
    # and head; two layers, because copying from context (induction) needs two.
    draft: ModelShape = field(default_factory=lambda: ModelShape(320, 864, 2, 5))
    seq_len: int = 256
    batch_size: int = 16
    target_steps: int = 1500
    draft_steps: int = 1200
    learning_rate: float = 2e-3
    draft_learning_rate: float = 3e-3
    warmup_steps: int = 60
    seed: int = 1234
    threads: int = 2


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE, so every string round-trips and no text is out of vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All files as one token stream, each followed by EOS.  # [num_tokens]"""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, cfg: TrainConfig, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Random windows of `seq_len + 1` tokens, forever.  yields [batch, seq_len + 1]"""
    span = cfg.seq_len + 1
    while True:
        starts = torch.randint(0, stream.numel() - span, (cfg.batch_size,), generator=generator)
        yield torch.stack([stream[s : s + span] for s in starts.tolist()])


def build_model(shape: ModelShape, cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def init_draft_from_target(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Start the draft as a truncated target: its embeddings, its first layers, its final norm and
    head (tied to the embeddings). Distillation then teaches the short stack to finish the job."""
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for draft_layer, target_layer in zip(draft.model.layers, target.model.layers, strict=False):
        draft_layer.load_state_dict(target_layer.state_dict())


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimise(
    model: LlamaForCausalLM,
    steps: int,
    peak_lr: float,
    cfg: TrainConfig,
    data: Iterator[torch.Tensor],
    loss_fn: LossFn,
    desc: str,
) -> list[float]:
    optimiser = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    losses: list[float] = []
    started = time.perf_counter()
    bar = tqdm(range(steps), desc=desc, mininterval=5.0)
    for step in bar:
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, cfg.warmup_steps)
        window = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, window)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.item())
        tokens_per_s = (step + 1) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - started)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", tok_s=f"{tokens_per_s:.0f}")
    model.eval()
    return losses


def next_token_loss(model: LlamaForCausalLM, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1]).logits  # [batch, seq, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


class DistillLoss:
    """KL(target || draft) on every position, plus a little next-token loss on the text itself."""

    def __init__(self, target: LlamaForCausalLM, text_weight: float = 0.1) -> None:
        self.target = target
        self.text_weight = text_weight

    def __call__(self, model: LlamaForCausalLM, window: torch.Tensor) -> torch.Tensor:
        inputs = window[:, :-1]
        with torch.no_grad():
            target_logits = self.target(input_ids=inputs).logits.float()  # [batch, seq, vocab]
        draft_logits = model(input_ids=inputs).logits.float()  # [batch, seq, vocab]
        kl = F.kl_div(
            F.log_softmax(draft_logits, dim=-1).flatten(0, 1),
            F.log_softmax(target_logits, dim=-1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
        text = F.cross_entropy(draft_logits.flatten(0, 1), window[:, 1:].flatten())
        return kl + self.text_weight * text


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Weights in bfloat16 (half the bytes; loading upcasts them to float32 exactly)."""
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("default_models/pair"))
    parser.add_argument("--target-steps", type=int, default=TrainConfig.target_steps)
    parser.add_argument("--draft-steps", type=int, default=TrainConfig.draft_steps)
    parser.add_argument("--threads", type=int, default=TrainConfig.threads)
    parser.add_argument(
        "--draft-only", action="store_true", help="keep OUT/target and its tokenizer; retrain the draft"
    )
    args = parser.parse_args(argv)
    cfg = TrainConfig(target_steps=args.target_steps, draft_steps=args.draft_steps, threads=args.threads)

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    corpus = load_corpus()
    texts = [read_text(p) for p in corpus.train_files]
    print(f"corpus: {len(corpus.train_files)} training files, {len(corpus.held_out_files)} held out")

    generator = torch.Generator().manual_seed(cfg.seed)
    if args.draft_only:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out / "target")
        stream = encode_corpus(tokenizer, texts)
        target = LlamaForCausalLM.from_pretrained(args.out / "target", dtype=torch.float32).eval()
        previous = json.loads((args.out / "training.json").read_text())
        target_losses = [previous["target_final_loss"]] * 50
        cfg = TrainConfig(
            target_steps=previous["config"]["target_steps"], draft_steps=args.draft_steps, threads=args.threads
        )
    else:
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
        stream = encode_corpus(tokenizer, texts)
        target = build_model(cfg.target, cfg, tokenizer)
        target_losses = _optimise(
            target, cfg.target_steps, cfg.learning_rate, cfg, batches(stream, cfg, generator), next_token_loss, "target"
        )
        save(target, tokenizer, args.out / "target")
    print(f"tokenizer: {len(tokenizer)} tokens; training stream: {stream.numel():,} tokens")

    draft = build_model(cfg.draft, cfg, tokenizer)
    init_draft_from_target(draft, target)
    draft_losses = _optimise(
        draft,
        cfg.draft_steps,
        cfg.draft_learning_rate,
        cfg,
        batches(stream, cfg, generator),
        DistillLoss(target),
        "draft (distil)",
    )
    save(draft, tokenizer, args.out / "draft")

    record = {
        "config": asdict(cfg),
        "training_tokens": stream.numel(),
        "target_parameters": target.num_parameters(),
        "draft_parameters": draft.num_parameters(),
        "target_final_loss": sum(target_losses[-50:]) / 50,
        "draft_final_distill_loss": sum(draft_losses[-50:]) / 50,
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
