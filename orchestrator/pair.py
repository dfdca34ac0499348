"""Draft and target as a pair, checked when the orchestrator connects: the token ids must mean the same
on both sides (one tokenizer, a padded pair, or a draft with its own tokenizer that proposes the tokens
the two share), and what the orchestrator learns of its services and where they run."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.config import OrchestratorConfig
from orchestrator.translation import Translation
from orchestrator.upstream import ReplicaPool
from serving.vocab_map import VocabularyError, check_overlap
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)

_INFO_POLL_S = 0.5


class PairMismatch(Exception):
    """Draft and target (or the orchestrator's tokenizer) do not share a vocabulary."""


def check_pair(
    target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo, translation: Translation | None = None
) -> None:
    """Refuse a draft whose token ids do not mean what the target's mean. Embedding widths may differ
    when both report the same tokenizer (Qwen pads its embeddings by model size): the ids past the
    tokenizer are padding, and the orchestrator pads or cuts the draft's rows to the target's width.
    With `translation` (--draft-tokenizer), the draft has its own tokenizer and proposes only the
    tokens it shares with the target's (--target-tokenizer on the draft service)."""
    if translation is not None or draft.target_tokenizer_fingerprint:
        _check_translated_pair(target, draft, translation)
        return
    same_tokenizer = bool(draft.tokenizer_fingerprint) and draft.tokenizer_fingerprint == target.tokenizer_fingerprint
    if draft.vocab_size != target.vocab_size and not same_tokenizer:
        raise PairMismatch(
            f"draft model {draft.model!r} has a vocabulary of {draft.vocab_size} tokens but target model "
            f"{target.model!r} has {target.vocab_size}, and they do not both report one tokenizer (a padded "
            "pair must ship the same tokenizer with each checkpoint); choose a draft that shares the target's "
            "tokenizer, or draft across tokenizers (--draft-tokenizer here, --target-tokenizer on the draft)"
        )
    if draft.vocab_size != target.vocab_size:
        log.info(
            "padded_pair",
            draft_vocab_size=draft.vocab_size,
            target_vocab_size=target.vocab_size,
            draft_rows=(
                f"padded with q = 0 for ids {draft.vocab_size}..{target.vocab_size - 1}"
                if draft.vocab_size < target.vocab_size
                else f"cut: the draft proposes below {target.vocab_size} only, q renormalised over those ids"
            ),
        )
    if (
        draft.tokenizer_fingerprint
        and target.tokenizer_fingerprint
        and (draft.tokenizer_fingerprint != target.tokenizer_fingerprint)
    ):
        raise PairMismatch(
            f"draft model {draft.model!r} and target model {target.model!r} have different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint[:12]} and {target.tokenizer_fingerprint[:12]}); "
            "choose a draft that shares the target's tokenizer, or draft across tokenizers (--draft-tokenizer "
            "here, --target-tokenizer on the draft service)"
        )


def _check_translated_pair(
    target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo, translation: Translation | None
) -> None:
    """A draft with another tokenizer: the orchestrator holds its tokenizer, and the draft proposes
    the target's shared tokens alone."""
    if translation is None:
        raise PairMismatch(
            f"draft service {draft.model!r} drafts for a target with another tokenizer (--target-tokenizer); "
            "start the orchestrator with --draft-tokenizer naming the draft's tokenizer"
        )
    if not draft.target_tokenizer_fingerprint:
        raise PairMismatch(
            f"--draft-tokenizer is set, but draft service {draft.model!r} proposes over its whole vocabulary: "
            "start it with --target-tokenizer naming the target's tokenizer"
        )
    if draft.tokenizer_fingerprint != translation.draft_fingerprint:
        raise PairMismatch(
            f"--draft-tokenizer {translation.pair.draft_name} is not draft model {draft.model!r}'s tokenizer "
            f"(fingerprints {translation.draft_fingerprint[:12]} and {draft.tokenizer_fingerprint[:12]}); "
            "name the draft checkpoint's tokenizer"
        )
    if target.tokenizer_fingerprint and draft.target_tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise PairMismatch(
            f"draft service {draft.model!r} proposes the tokens it shares with another tokenizer than target model "
            f"{target.model!r}'s (fingerprints {draft.target_tokenizer_fingerprint[:12]} and "
            f"{target.tokenizer_fingerprint[:12]}); start it with --target-tokenizer naming the target's tokenizer"
        )


def translation_for(target: PreTrainedTokenizerBase, config: OrchestratorConfig) -> Translation:
    """The map between the target's ids and those of --draft-tokenizer, its overlap checked against
    --min-vocab-overlap and logged. Raises PairMismatch naming both tokenizers."""
    draft = AutoTokenizer.from_pretrained(config.draft_tokenizer)
    try:
        translation = Translation(target, draft)
        overlap = check_overlap(translation.pair, target, config.min_vocab_overlap)
    except VocabularyError as exc:
        raise PairMismatch(str(exc)) from None
    log.info(
        "cross_tokenizer_draft",
        draft_tokenizer=config.draft_tokenizer,
        shared_tokens=len(translation.to_target),
        overlap=round(overlap, 4),
        overlap_floor=config.min_vocab_overlap,
        greedy_rule=config.cross_greedy,
    )
    return translation


async def fetch_model_info(pool: ReplicaPool, timeout_s: float) -> common_pb2.ModelInfo:
    """GetModelInfo from the first replica that answers, waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    last_error = "no replicas"
    while True:
        for replica in pool.replicas:
            try:
                info: common_pb2.ModelInfo = await replica.stub.GetModelInfo(
                    common_pb2.GetModelInfoRequest(), timeout=5.0
                )
                return info
            except grpc.aio.AioRpcError as exc:
                last_error = f"{replica.address}: {exc.code().name} {exc.details()}"
        if time.monotonic() >= deadline:
            raise ConnectionError(f"{pool.name} service did not answer within {timeout_s:.0f} s ({last_error})")
        await asyncio.sleep(_INFO_POLL_S)


def one_host(config: OrchestratorConfig) -> bool:
    """Whether every target and draft replica is at one address (`dns:///` names: never known)."""
    hosts = {address.strip().rpartition(":")[0] for address in f"{config.target},{config.draft}".split(",") if address}
    return bool(config.draft) and len(hosts) == 1 and not any(h.startswith("dns:") for h in hosts)
