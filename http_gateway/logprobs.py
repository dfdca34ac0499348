"""Logprobs and echo in OpenAI's shapes: chat's `logprobs.content`, completions' legacy `logprobs`
object (with `echo`, the prompt's tokens first, as lm-evaluation-harness reads them), and vLLM's
`prompt_logprobs` extension. Values are the target's (see orchestrator/logprobs.py); a probability of
0 is written as -9999.0, as vLLM does, since JSON has no -Infinity."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from http_gateway.openai_api import invalid
from serving.logits import MAX_TOP_LOGPROBS
from specdec.v1 import orchestrator_pb2

FLOOR = -9999.0
LOGPROB_FIELDS = {"logprobs", "top_logprobs", "echo", "prompt_logprobs"}


@dataclass(frozen=True)
class LogprobRequest:
    """What a request asked for: which shape (chat, completions or none) and the counts."""

    shape: str | None = None  # "chat", "completions", or None (no logprobs)
    top: int = 0
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens) first
    prompt_top: int | None = None  # vLLM's prompt_logprobs: the alternatives per prompt token

    @property
    def wants_prompt(self) -> bool:
        return self.prompt_top is not None or (self.echo and self.shape is not None)


def _top(body: dict[str, Any], name: str) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(f"`{name}` must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {value!r}", name)
    return value


def parse(body: dict[str, Any], chat: bool) -> LogprobRequest:
    """The body's logprobs fields, checked (400 naming the field)."""
    prompt_top = _top(body, "prompt_logprobs") if body.get("prompt_logprobs") is not None else None
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("`echo` must be true or false", "echo")
    if chat:
        if echo:
            raise invalid("`echo` is a completions field; chat completions do not echo", "echo")
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise invalid("`logprobs` must be true or false on chat completions", "logprobs")
        top = _top(body, "top_logprobs") if body.get("top_logprobs") is not None else 0
        if top and not wanted:
            raise invalid("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        return LogprobRequest("chat" if wanted else None, top, False, prompt_top)
    if body.get("top_logprobs") is not None:
        raise invalid("`top_logprobs` is a chat field; completions take `logprobs: N` alternatives", "top_logprobs")
    if body.get("logprobs") is None:
        return LogprobRequest(None, 0, bool(echo), prompt_top)
    return LogprobRequest("completions", _top(body, "logprobs"), bool(echo), prompt_top)


def apply(wanted: LogprobRequest, request: orchestrator_pb2.GenerateRequest) -> None:
    """Set the gRPC request's logprobs fields."""
    if wanted.shape is not None:
        request.logprobs, request.top_logprobs = True, wanted.top
    if wanted.wants_prompt:
        request.prompt_logprobs = max(wanted.top if wanted.echo else 0, wanted.prompt_top or 0)


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


@dataclass
class Formatter:
    """Turns entries into OpenAI's shapes, decoding each token alone (as OpenAI's `token` field is)."""

    tokenizer: PreTrainedTokenizerBase
    wanted: LogprobRequest
    offset: int = 0  # completions: the text offset of the next token
    _cache: dict[int, str] = field(default_factory=dict)

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._cache[token_id] = text
        return text

    def chat(self, entries: Sequence[orchestrator_pb2.TokenLogprob]) -> dict[str, Any]:
        """`{"content": [...]}` for a chat choice or chunk."""

        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}

        return {
            "content": [
                {**one(e.token_id, e.logprob), "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                for e in entries
            ]
        }

    def completions(
        self, entries: Sequence[orchestrator_pb2.TokenLogprob], first_token: int | None = None
    ) -> dict[str, Any]:
        """The legacy object: tokens, token_logprobs, top_logprobs, text_offset. With `first_token` (echo
        of the prompt), that token leads with a null logprob: no row scores a sequence's first token."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if first_token is not None:
            tokens.append(self.token(first_token))
            values.append(None)
            tops.append(None)
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        for entry in entries:
            text = self.token(entry.token_id)
            tokens.append(text)
            values.append(_value(entry.logprob))
            tops.append({self.token(t.token_id): _value(t.logprob) for t in entry.top[: self.wanted.top]})
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def prompt(self, prompt_ids: Sequence[int], entries: Sequence[orchestrator_pb2.TokenLogprob]) -> list[Any]:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map from each id
        (the prompt's own and the alternatives) to its logprob and decoded text."""
        assert self.wanted.prompt_top is not None
        out: list[Any] = [None] if prompt_ids else []
        for entry in entries:
            ranked = {entry.token_id: entry.logprob}
            ranked.update({t.token_id: t.logprob for t in entry.top[: self.wanted.prompt_top]})
            out.append({str(i): {"logprob": _value(v), "decoded_token": self.token(i)} for i, v in ranked.items()})
        return out
