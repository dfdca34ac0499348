"""A generation's request and limits, and the messages its steps send to the model services."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator.context import Context
from orchestrator.proposals import MODEL
from serving.constraints import ConstraintSpec, TokenBan
from serving.sampling import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, orchestrator_pb2

if TYPE_CHECKING:
    from orchestrator.translation import Translation

_SEED_MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class GenerationRequest:
    """A validated Generate request."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    num_speculative_tokens: int  # K to start with; 0 is the target alone
    overlap_drafting: bool
    min_confidence: float
    draft_method: str = MODEL  # MODEL, NGRAM, or "hybrid" (the lookup when it matches, else the model)
    ngram_min: int = 2
    ngram_max: int = 4
    cache_salt: bytes = b""  # sent on each session's first step (keep = 0)
    constraint: ConstraintSpec | None = None  # structured output, sent on each session's first step
    # The constraint compiled (an llguidance matcher in its initial state): the orchestrator's own copy
    # checks every committed token.
    constraint_template: Any = field(default=None, compare=False, repr=False)
    ignore_eos: bool = False  # EOS tokens are ordinary tokens: no end there
    stop_token_ids: frozenset[int] = frozenset()  # generation ends after any of these (finish STOP)
    ban: TokenBan | None = None  # min_tokens: EOS and stop tokens masked below a sequence length
    logprobs: bool = False  # the target's logprob of each generated token
    top_logprobs: int = 0  # alternatives per generated token
    prompt_logprobs: int | None = None  # the prompt's logprobs with this many alternatives; None: none
    tree: bool = False  # greedy model rounds may draft a token tree (speculation_tree)


@dataclass(frozen=True)
class ModelLimits:
    """What the pair allows, from the services' ModelInfo."""

    vocab_size: int
    target_max_context: int
    draft_max_context: int
    eos_token_ids: frozenset[int]
    draft_max_speculative_tokens: int = 16  # the draft service's cap on one step's K
    draft_vocab_size: int = 0  # the draft's row width (0: the target's); a padded pair's may differ
    draft_constrains: bool = False  # the draft applies structured outputs (ModelInfo.structured_output_kinds)
    draft_speculates: bool = False  # the draft has a speculation cache (ModelInfo.speculation_cache_tokens)
    translation: Translation | None = None  # a draft with another tokenizer (orchestrator/translation.py)
    string_match: bool = False  # with `translation`: greedy requests draft by SLEM (--cross-greedy slem)
    trees: bool = False  # both services run the batched forward, which scores tree rows (ModelInfo.batched)


class StepFields:
    """What one request's steps carry besides their tokens: built once, read every round."""

    def __init__(self, request: GenerationRequest, limits: ModelLimits, constraint_fields: dict[str, Any]) -> None:
        self.request = request
        self.limits = limits
        self.sampling = request.sampling.to_proto()  # the same for every round
        self.constraint = constraint_fields  # sent on a session's first step (keep = 0)
        # A greedy request with a draft of another tokenizer under SLEM: drafts from its whole vocabulary.
        self.string_match = limits.string_match and request.sampling.greedy

    def draft(
        self, context: Context, keep: int, k: int, ahead_k: tuple[int, int] = (0, 0), tree: bool = False
    ) -> draft_pb2.DraftRequest:
        """A draft step of k tokens after `context`; `ahead_k`: the K of the blocks the draft drafts ahead
        for this step's verdicts, after a rejection and after the whole block (its speculation cache;
        0: none); `tree`: a token tree of k nodes instead of a chain."""
        request, limits, n = self.request, self.limits, len(context)
        base = request.seed * _SEED_MIX & _U64
        return draft_pb2.DraftRequest(
            request_id=request.request_id,
            keep=keep,
            append_token_ids=context[keep:],
            num_speculative_tokens=k,
            tree_budget=k if tree else 0,
            sampling=self.sampling,
            # Seeded by position, so a block drafted again after a lost session is the same block.
            seed=(base + n) & _U64,
            speculate=(
                draft_pb2.Speculate(next_k=ahead_k[0], next_k_whole=ahead_k[1], seed_base=base) if ahead_k[0] else None
            ),
            min_confidence=request.min_confidence,
            cache_salt=request.cache_salt if keep == 0 else b"",
            **(self.constraint if keep == 0 and limits.draft_constrains else {}),
            # A draft with another tokenizer gets no ban: its positions are not the target's (the target's
            # ban still holds, so a banned token it proposes is rejected).
            **(self.ban(n, limits.draft_vocab_size or limits.vocab_size) if limits.translation is None else {}),
            # A draft wider than the target (a padded pair) proposes over the target's width alone.
            vocab_limit=(
                limits.vocab_size if limits.translation is None and limits.draft_vocab_size > limits.vocab_size else 0
            ),
            whole_vocabulary=self.string_match,
        )

    def ban(self, first_position: int, width: int) -> dict[str, Any]:
        """min_tokens' ban for a step whose first row scores `first_position`, while it still applies
        (ids past a narrower draft's width are left out: it cannot propose them anyway)."""
        ban = self.request.ban
        if ban is None or first_position >= ban.until:
            return {}
        return {"ban": common_pb2.TokenBan(token_ids=[t for t in ban.token_ids if t < width], until=ban.until)}

    def logprobs(self, keep: int, prompt_pending: bool) -> dict[str, Any]:
        """What a verify step asks for the request's logprobs: the committed tokens', and on the first
        step (until answered: `prompt_pending`) the prompt's, with the larger count of alternatives."""
        request, fields = self.request, {}
        if request.logprobs:
            fields = {"logprobs": True, "top_logprobs": request.top_logprobs}
        if keep == 0 and request.prompt_logprobs is not None and prompt_pending:
            fields["prompt_logprobs"] = True
            fields["top_logprobs"] = max(request.top_logprobs if request.logprobs else 0, request.prompt_logprobs)
        return fields


def finish_of(token: int, limits: ModelLimits, request: GenerationRequest) -> int:
    """The finish reason a committed token gives (UNSPECIFIED: the generation goes on)."""
    if token in limits.eos_token_ids and not request.ignore_eos:
        return orchestrator_pb2.FINISH_REASON_EOS
    if token in request.stop_token_ids:
        return orchestrator_pb2.FINISH_REASON_STOP
    return orchestrator_pb2.FINISH_REASON_UNSPECIFIED
