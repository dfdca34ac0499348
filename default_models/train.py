"""Train specdec's default model pair from the Python standard library's source.

    python -m default_models.train --out default_models/pair

Two stages, all with fixed seeds.

Stage 1:
1. a byte-level BPE tokenizer shared by both models;
2. the target, a small Llama-architecture model, trained on next-token prediction;
3. the draft, a much smaller model started from the target's embeddings and first layers and
   distilled from it: trained to match the target's next-token distributions (KL divergence), not
   only the text, because acceptance rate is what a draft is for.

Stage 2:
4. the target grows by a layer that starts as the identity (so nothing learnt is lost) and trains on;
5. the target writes continuations of training-set function headers and text, greedy and sampled;
6. the draft is distilled again from the grown target, on a mix of library text and those
   continuations: the contexts a draft meets in service are the target's own output.

It writes ordinary Hugging Face checkpoints (`target/`, `draft/`, each with the tokenizer files) and
`training.json`: after stage 1, after the grown target and after every draft round, so a run can
stop anywhere: `--resume DIR` goes on from the pair saved in DIR, from the step its training.json
says comes next.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from default_models.corpus import load_corpus, read_text
from default_models.prompts import function_headers

EOS_TOKEN = "<|endoftext|>"
PROMPT_WINDOW = 48  # tokens of training text that prompt a target generation
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
    """Every knob of the recipe, with its default."""

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
    # Stage 2.
    grown_layers: int = 1
    target_steps_2: int = 1500
    learning_rate_2: float = 1e-3
    generations: int = 2048
    generation_tokens: int = 192
    generation_batch: int = 64
    # Each round: fresh target continuations, then this many distillation steps.
    draft_rounds: tuple[int, ...] = (1500, 1800)
    draft_learning_rate_2: float = 1.5e-3


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


def grow(model: LlamaForCausalLM, extra_layers: int) -> LlamaForCausalLM:
    """A deeper model computing the same function: each new layer is a copy of the last one with its
    two output projections zeroed, so it adds nothing to the residual stream until training moves them."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers += extra_layers
    grown = LlamaForCausalLM(config)
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".layers." in key for key in missing), (missing, unexpected)
    for layer in grown.model.layers[model.config.num_hidden_layers :]:
        layer.load_state_dict(model.model.layers[-1].state_dict())
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    probe = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()
        grown.eval()
        assert torch.allclose(model(probe).logits, grown(probe).logits, atol=1e-5), "growth changed the model"
    return grown


def generation_prompts(
    tokenizer: PreTrainedTokenizerFast,
    stream: torch.Tensor,
    train_files: list[Path],
    cfg: TrainConfig,
    generator: torch.Generator,
) -> list[list[int]]:
    """Half training-set function headers, half PROMPT_WINDOW-token windows of training text, shuffled."""
    headers = function_headers(train_files)
    picks = torch.randperm(len(headers), generator=generator)[: cfg.generations // 2].tolist()
    prompts = [tokenizer(headers[i], add_special_tokens=False)["input_ids"] for i in picks]
    starts = torch.randint(0, stream.numel() - PROMPT_WINDOW, (cfg.generations - len(prompts),), generator=generator)
    prompts += [stream[s : s + PROMPT_WINDOW].tolist() for s in starts.tolist()]
    order = torch.randperm(len(prompts), generator=generator).tolist()
    return [prompts[i] for i in order]


def target_generations(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[list[int]], cfg: TrainConfig
) -> torch.Tensor:
    """The target's own continuations of `prompts`, alternately greedy and sampled at temperature 0.8,
    each prompt plus continuation followed by EOS, as one token stream.  # [num_tokens]"""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    bar = tqdm(range(0, len(prompts), cfg.generation_batch), desc="target generations", mininterval=5.0)
    for batch_index, first in enumerate(bar):
        group = prompts[first : first + cfg.generation_batch]
        width = max(map(len, group))
        # Left padding, so every row's continuation starts at the same column.
        input_ids = torch.tensor([[eos] * (width - len(p)) + p for p in group])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        sampled = batch_index % 2 == 1
        with torch.inference_mode():
            out = target.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=cfg.generation_tokens,
                do_sample=sampled,
                temperature=0.8 if sampled else None,
                top_p=None,
                top_k=None,
                pad_token_id=eos,
            )
        for prompt, row in zip(group, out[:, width:].tolist(), strict=True):
            continuation = row[: row.index(eos)] if eos in row else row
            ids += [*prompt, *continuation, eos]
        bar.set_postfix(tokens=f"{len(ids):,}")
    return torch.tensor(ids, dtype=torch.long)


def mixed_batches(first: Iterator[torch.Tensor], second: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each batch: one batch from each source, stacked."""
    while True:
        yield torch.cat([next(first), next(second)])


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Weights in bfloat16 (half the bytes; loading upcasts them to float32 exactly)."""
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _tail_mean(losses: list[float]) -> float:
    tail = losses[-50:]
    return sum(tail) / len(tail)


@dataclass
class Stage1:
    target: LlamaForCausalLM
    draft: LlamaForCausalLM
    losses: dict[str, float]  # final (last-50-step mean) loss of each


def stage1(
    cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast, stream: torch.Tensor, generator: torch.Generator
) -> Stage1:
    target = build_model(cfg.target, cfg, tokenizer)
    target_losses = _optimise(
        target, cfg.target_steps, cfg.learning_rate, cfg, batches(stream, cfg, generator), next_token_loss, "target"
    )
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
    losses = {"target_final_loss": _tail_mean(target_losses), "draft_final_distill_loss": _tail_mean(draft_losses)}
    return Stage1(target, draft, losses)


def distil_round(
    index: int,
    steps: int,
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    stream: torch.Tensor,
    train_files: list[Path],
    cfg: TrainConfig,
) -> dict[str, float]:
    """One round of stage 2 for the draft: fresh target continuations, then distillation on a mix of
    library text and those continuations. Seeded by the round's index, so a resumed run matches."""
    generator = torch.Generator().manual_seed(cfg.seed + 2 + index)
    torch.manual_seed(cfg.seed + 2 + index)  # generate() samples from the global generator
    prompts = generation_prompts(tokenizer, stream, train_files, cfg, generator)
    generated = target_generations(target, tokenizer, prompts, cfg)
    half = dataclasses.replace(cfg, batch_size=cfg.batch_size // 2)
    losses = _optimise(
        draft,
        steps,
        cfg.draft_learning_rate_2,
        cfg,
        mixed_batches(batches(stream, half, generator), batches(generated, half, generator)),
        DistillLoss(target),
        f"draft round {index + 1} (distil on target output)",
    )
    return {"steps": steps, "generated_tokens": generated.numel(), "final_loss": _tail_mean(losses)}


def write_pair(
    out: Path,
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    record: dict[str, Any],
) -> None:
    """Both checkpoints and training.json, written in full beside OUT and then moved in, so a run that stops
    part-way leaves OUT a loadable pair whose training.json says how far it got (what `--resume` reads)."""
    record = {**record, "target_parameters": target.num_parameters(), "draft_parameters": draft.num_parameters()}
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    save(target, tokenizer, staging / "target")
    save(draft, tokenizer, staging / "draft")
    (staging / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "draft", "training.json"):  # the record last: it vouches for the weights
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        os.replace(staging / name, out / name)
    staging.rmdir()


def train(cfg: TrainConfig, out: Path, resume: Path | None = None) -> dict[str, Any]:
    """Run the recipe into OUT, writing the pair after stage 1, after the grown target and after every
    draft round; with `resume`, go on from the pair saved there. Returns training.json's record."""
    done: dict[str, Any] = {}
    if resume is not None:  # checked first: encoding the corpus takes a minute
        done = json.loads((resume / "training.json").read_text())
        if "stage1" not in done:
            raise SystemExit(f"{resume}/training.json was not written by this recipe; train from scratch instead")
        if "target_final_loss" in done and len(done["rounds"]) >= len(cfg.draft_rounds):
            raise SystemExit(f"{resume} has finished every stage of the recipe; there is nothing to resume")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    corpus = load_corpus()
    texts = [read_text(p) for p in corpus.train_files]
    print(f"corpus: {len(corpus.train_files)} training files, {len(corpus.held_out_files)} held out")
    if resume is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(resume / "target")
    else:
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
    stream = encode_corpus(tokenizer, texts)
    print(f"tokenizer: {len(tokenizer)} tokens; training stream: {stream.numel():,} tokens")
    record: dict[str, Any] = {"config": asdict(cfg), "training_tokens": stream.numel(), "rounds": []}
    record.update({key: done[key] for key in ("stage1", "target_final_loss", "rounds") if key in done})

    if resume is not None:
        target = LlamaForCausalLM.from_pretrained(resume / "target", dtype=torch.float32)
        draft = LlamaForCausalLM.from_pretrained(resume / "draft", dtype=torch.float32)
    else:
        first = stage1(cfg, tokenizer, stream, torch.Generator().manual_seed(cfg.seed))
        target, draft, record["stage1"] = first.target, first.draft, first.losses
        write_pair(out, target, draft, tokenizer, record)

    if "target_final_loss" not in record:
        target = grow(target, cfg.grown_layers)
        target_losses = _optimise(
            target,
            cfg.target_steps_2,
            cfg.learning_rate_2,
            cfg,
            batches(stream, cfg, torch.Generator().manual_seed(cfg.seed + 1)),
            next_token_loss,
            "target (grown)",
        )
        record["target_final_loss"] = _tail_mean(target_losses)
        write_pair(out, target, draft, tokenizer, record)
    for index in range(len(record["rounds"]), len(cfg.draft_rounds)):
        steps = cfg.draft_rounds[index]
        record["rounds"].append(distil_round(index, steps, draft, target, tokenizer, stream, corpus.train_files, cfg))
        write_pair(out, target, draft, tokenizer, record)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("default_models/pair"))
    parser.add_argument(
        "--resume", type=Path, help="a pair this script saved part-way (its training.json says how far) to go on from"
    )
    parser.add_argument("--threads", type=int, default=TrainConfig.threads)
    args = parser.parse_args(argv)
    record = train(TrainConfig(threads=args.threads), args.out, args.resume)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
