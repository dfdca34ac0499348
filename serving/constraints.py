"""Structured outputs: constraints compiled by llguidance, a matcher per session, masks over logits.

Shared by the orchestrator (it checks every committed token) and both model services (they mask their
logits). A constraint is a sampling parameter: both services mask their rows before temperature, top-k
and top-p, so rejection sampling stays exact for the constrained distribution; exactness rests on the
target's mask alone (a draft that cannot mask only proposes worse tokens, which the target's p = 0
rejects).

Positions: a constraint starts at sequence length `start` (the prompt's). The matcher's state "at q"
has consumed the tokens at positions start .. q - 1; the token at position q is allowed by the state
at q, and so is the row of logits computed at position q - 1. EOS is kept out of the matcher: every
one of the model's EOS ids is allowed exactly when the matcher accepts, and is never consumed (a
generation ends at EOS).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import llguidance
import llguidance.hf
import numpy as np
import structlog
import torch

from serving.errors import ServiceError, invalid_argument, resource_exhausted
from serving.json_schema import prepared_schema
from specdec.v1 import common_pb2

log = structlog.get_logger(__name__)

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# Bounds on what a client may send: the compile's work grows with the text, and llguidance's own parser
# limits (its defaults: grammar symbols, lexer fuel, Earley items per step) bound the rest.
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_CHOICES = 1024
# Compiled constraints kept per process, least recently used dropped first.
COMPILED_CACHE_SIZE = 128
# JSON is compiled compact (no whitespace between tokens): llguidance's default allows unbounded
# whitespace, and small models loop in it.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
_MAX_MESSAGE_CHARS = 2000  # of the compiler's message, in an error
_LIMIT_WORDS = ("too big", "limit", "fuel", "too many", "too large")


@dataclass(frozen=True)
class ConstraintSpec:
    """A validated StructuredOutput: its kind and its text (a schema, regex or grammar; a choice's
    options as a JSON list; "" for json_object)."""

    kind: str
    text: str
    lenient: bool = False  # json_schema: ignore keywords llguidance cannot enforce (not strict)

    @classmethod
    def from_proto(
        cls, message: common_pb2.StructuredOutput, field: str = "structured_output"
    ) -> ConstraintSpec | None:
        """The spec, None for no constraint, or INVALID_ARGUMENT naming the field and the bound."""
        kind = message.WhichOneof("kind")
        if kind is None or (kind == "json_object" and not message.json_object):
            return None
        if kind == "choice":
            options = list(message.choice.options)
            if not 1 <= len(options) <= MAX_CHOICES or not all(options):
                raise invalid_argument(
                    f"{field}.choice.options must hold 1 to {MAX_CHOICES} non-empty strings; got {len(options)}"
                )
            text = json.dumps(options)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(message, kind)
            if not text:
                raise invalid_argument(f"{field}.{kind} is empty")
        size = len(text.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise invalid_argument(f"{field}.{kind} has {size} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted")
        return cls(kind, text)

    def to_proto(self) -> common_pb2.StructuredOutput:
        message = common_pb2.StructuredOutput()
        if self.kind == "choice":
            message.choice.options.extend(json.loads(self.text))
        elif self.kind == "json_object":
            message.json_object = True
        elif self.kind == "json_schema" and self.lenient and isinstance(schema := json.loads(self.text), dict):
            schema["x-guidance"] = {**schema.get("x-guidance", {}), "lenient": True}
            message.json_schema = json.dumps(schema)
        else:
            setattr(message, self.kind, self.text)
        return message

    def grammar(self) -> str:
        """The llguidance grammar; INVALID_ARGUMENT when the text is not even of the kind's form."""
        field = f"structured_output.{self.kind}"
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise invalid_argument(f"{field} is not JSON: {exc}") from exc
            if self.lenient and isinstance(schema, dict):
                schema["x-guidance"] = {**schema.get("x-guidance", {}), "lenient": True}
            schema = prepared_schema(schema, field)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        options = json.loads(self.text)
        return llguidance.LLMatcher.grammar_from_regex("(" + "|".join(re.escape(o) for o in options) + ")")


class Grammars:
    """One process's constraint compiler: the tokenizer's llguidance view, built once, and a bounded
    cache of compiled constraints. `compile` may take a while on a large schema: call it off the event
    loop and off the engine's thread (llguidance drops the GIL while it compiles)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        self.limits = limits  # llguidance's parser limits (None: its defaults)
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's length
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._compiled: OrderedDict[ConstraintSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], role: str) -> Grammars | None:
        """A compiler over `tokenizer`, or None (logged) when llguidance cannot read it: it reads fast
        tokenizers whose decoder it knows (byte-level BPE, SentencePiece and others; not WordPiece)."""
        reason = ""
        if tokenizer is None or not getattr(tokenizer, "is_fast", False):
            reason = "the checkpoint has no fast tokenizer"
        else:
            try:
                return cls(tokenizer, vocab_size, eos_token_ids)
            except (ValueError, RuntimeError, TypeError) as exc:
                reason = f"llguidance cannot read the tokenizer: {exc}"
        log.warning("structured_outputs_unavailable", role=role, reason=reason)
        return None

    def cached(self, spec: ConstraintSpec) -> llguidance.LLMatcher | None:
        with self._lock:
            template = self._compiled.get(spec)
            if template is not None:
                self._compiled.move_to_end(spec)
            return template

    def compile(self, spec: ConstraintSpec) -> llguidance.LLMatcher:
        """The constraint's matcher in its initial state (a template: sessions take `deep_copy`s);
        INVALID_ARGUMENT with the compiler's message when it does not compile, RESOURCE_EXHAUSTED when
        it exceeds the parser's limits."""
        template = self.cached(spec)
        if template is not None:
            return template
        template = llguidance.LLMatcher(self.tokenizer, spec.grammar(), log_level=0, limits=self.limits)
        if template.is_error():
            message = template.get_error().strip()[:_MAX_MESSAGE_CHARS]
            field = f"structured_output.{spec.kind}"
            if any(word in message.lower() for word in _LIMIT_WORDS):
                raise resource_exhausted(f"{field} exceeds the constraint compiler's limits: {message}")
            raise invalid_argument(f"{field} does not compile: {message}")
        with self._lock:
            self._compiled[spec] = template
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template

    def session(self, template: llguidance.LLMatcher, start: int) -> SessionConstraint:
        return SessionConstraint(template.deep_copy(), start, self.vocab_size, self.eos_token_ids)


class SessionConstraint:
    """One session's matcher, kept in step with its sequence: `rollback(length)` as the session's cache
    is cropped, `consume` as tokens are fed, `allowed()` for the next row's mask."""

    def __init__(
        self, matcher: llguidance.LLMatcher, start: int, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.matcher = matcher
        self.start = start  # the sequence length at which the constraint starts
        self.vocab_size = vocab_size
        self.eos = np.array(sorted(eos_token_ids), dtype=np.int64)  # [eos]
        self._eos = frozenset(eos_token_ids)
        self.consumed: list[int] = []  # the tokens at positions start .. start + len - 1
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)  # llguidance's bitmask

    def copy(self) -> SessionConstraint:
        """An independent matcher in the same state (a fork of the session's)."""
        twin = SessionConstraint(self.matcher.deep_copy(), self.start, self.vocab_size, sorted(self._eos))
        twin.consumed = list(self.consumed)
        return twin

    @property
    def length(self) -> int:
        """The sequence length the matcher's state is at."""
        return self.start + len(self.consumed)

    def rollback(self, length: int) -> None:
        """Back to the state at sequence length `length` (no-op when it is not past it). A rollback the
        matcher refuses resets it and replays what stays."""
        keep = max(0, length - self.start)
        drop = len(self.consumed) - keep
        if drop <= 0:
            return
        del self.consumed[keep:]
        if not self.matcher.rollback(drop):
            self.matcher.reset()
            if self.consumed and not self.matcher.consume_tokens(self.consumed):
                raise self._failure("replaying the kept tokens after a reset")

    def is_eos(self, token: int) -> bool:
        return token in self._eos

    def allows(self, token: int) -> bool:
        """Whether `token` may come next: an EOS when the matcher accepts, another token when the grammar
        allows it (checked without consuming: a matcher that consumes a forbidden token never recovers)."""
        if token in self._eos:
            return self.matcher.is_accepting()
        return self.matcher.validate_tokens([token]) == 1

    def consume(self, token: int) -> None:
        """Advance by a token `allows` has passed (never an EOS)."""
        if not self.matcher.consume_token(token):
            raise self._failure(f"consuming token {token}")
        self.consumed.append(token)

    def feed(self, tokens: Sequence[int], at: int) -> None:
        """Advance over `tokens` placed at sequence positions at .. at + len - 1 (rolled back to `at`
        first); positions before the constraint's start are not constrained. INVALID_ARGUMENT for a
        token the constraint does not allow (fed tokens are committed ones, which it allowed)."""
        self.rollback(at)
        for offset, token in enumerate(tokens):
            position = at + offset
            if position < self.start:
                continue
            if position != self.length:
                raise invalid_argument(f"token at {position} fed to a constraint at {self.length}")
            if self.is_eos(token) or not self.allows(token):
                raise invalid_argument(
                    f"append_token_ids: token {token} at position {position} is not allowed by the session's "
                    "structured_output constraint"
                )
            self.consume(token)

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens allowed next (the model's EOS ids exactly when the matcher accepts)."""
        if self.matcher.is_error():
            raise self._failure("computing a mask")
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        # One bit a token, little-endian within each 32-bit word: numpy unpacks it in microseconds.
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size].view(np.bool_)  # [vocab]
        if self.eos.size:
            allowed[self.eos] = self.matcher.is_accepting()
        if not allowed.any():  # a dead end of the grammar for this tokenizer (or no EOS to end with)
            raise invalid_argument(
                f"the structured_output constraint allows no token after {len(self.consumed)} generated tokens; "
                "it cannot be completed with this model's tokenizer"
            )
        return torch.from_numpy(allowed)

    def _failure(self, doing: str) -> ServiceError:
        # llguidance's first line says what failed; the rest dumps its state and the whole grammar.
        error = (self.matcher.get_error().strip() or "the matcher refused").splitlines()[0]
        code = grpc.StatusCode.INVALID_ARGUMENT
        if any(word in error.lower() for word in _LIMIT_WORDS):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        return ServiceError(code, f"the structured_output constraint failed {doing}: {error}")


MAX_BANNED_TOKENS = 512  # a TokenBan's ids: the model's EOS ids and a request's stop_token_ids


@dataclass(frozen=True)
class TokenBan:
    """Ids masked out of the rows that score positions below `until` (min_tokens), in both services."""

    token_ids: tuple[int, ...]
    until: int  # a sequence length

    @classmethod
    def from_proto(cls, message: common_pb2.TokenBan, vocab_size: int) -> TokenBan | None:
        """The ban, None when it bans nothing, or INVALID_ARGUMENT naming the field."""
        ids = tuple(sorted(set(message.token_ids)))
        if not ids or not message.until:
            return None
        if len(ids) > MAX_BANNED_TOKENS:
            raise invalid_argument(f"ban.token_ids holds {len(ids)} ids; at most {MAX_BANNED_TOKENS} are accepted")
        if ids[0] < 0 or ids[-1] >= vocab_size:
            raise invalid_argument(f"ban.token_ids must be in [0, {vocab_size}); got {ids[0]}..{ids[-1]}")
        return cls(ids, message.until)

    def to_proto(self) -> common_pb2.TokenBan:
        return common_pb2.TokenBan(token_ids=self.token_ids, until=self.until)

    def restrict(self, allowed: torch.Tensor | None, positions: Sequence[int], vocab_size: int) -> torch.Tensor | None:
        """allowed [rows, vocab] bool (None: all allowed) with the banned ids cleared in the rows scoring
        `positions` below `until`; INVALID_ARGUMENT when that leaves a row nothing (a constraint that can
        only end there)."""
        banned_rows = [row for row, position in enumerate(positions) if position < self.until]
        if not banned_rows:
            return allowed
        if allowed is None:
            allowed = torch.ones((len(positions), vocab_size), dtype=torch.bool)
        index = torch.tensor(banned_rows)
        allowed[index[:, None], torch.tensor(self.token_ids)[None, :]] = False
        if not bool(allowed[index].any(dim=-1).all()):
            raise invalid_argument(
                "min_tokens cannot be met: the structured_output constraint allows only end-of-sequence or stop "
                "tokens before that many tokens are generated; lower min_tokens"
            )
        return allowed


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] with -inf where allowed [rows, vocab] is False (a new tensor)."""
    return torch.where(allowed.to(logits.device), logits, float("-inf"))


def block_masks(constraint: SessionConstraint, token_ids: Sequence[int], keep: int, num_rows: int) -> torch.Tensor:
    """[num_rows, vocab] bool: the allowed tokens of each row a verify step returns, for a step feeding
    `token_ids` after `keep` tokens, whose last num_rows - 1 tokens are a proposal. The committed tokens
    before it advance the matcher; the proposal's tokens advance it while they are allowed. Rows past a
    forbidden token (its p is 0: it is rejected there) or an EOS (the generation ends) are left
    unmasked: nothing reads them."""
    end = keep + len(token_ids)
    first = end - num_rows  # the position of the first row; it is masked by the state at first + 1
    constraint.feed(token_ids[: first + 1 - keep], keep)
    allowed = torch.ones((num_rows, constraint.vocab_size), dtype=torch.bool)
    for row in range(num_rows):
        position = first + 1 + row  # the token this row scores
        if position < constraint.start:
            continue  # a prompt position: unconstrained (only with num_rows reaching into the prompt)
        allowed[row] = constraint.allowed()
        if row == num_rows - 1:
            break
        token = token_ids[position - keep]
        if constraint.is_eos(token) or not bool(allowed[row, token]):
            break
        constraint.consume(token)
    return allowed
