"""What a Generate request may ask, checked before any service sees it: each fault an INVALID_ARGUMENT
(or FAILED_PRECONDITION) that names the field and what to send instead."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from orchestrator import metrics
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import GenerationRequest
from orchestrator.proposals import MODEL
from serving.constraints import ConstraintSpec, Grammars, TokenBan
from serving.errors import failed_precondition, invalid_argument
from serving.logits import MAX_TOP_LOGPROBS
from serving.protocol import (
    DRAFT_METHOD_BY_ENUM,
    DRAFT_METHODS,
    MAX_PROMPT_CHARS_PER_TOKEN,
    POLICIES,
    POLICY_BY_ENUM,
)
from serving.sampling import SamplingParams
from specdec.v1 import common_pb2, orchestrator_pb2

_MAX_STOP_STRINGS = 16
_MAX_STOP_CHARS = 256
MAX_CACHE_SALT_BYTES = 256
MAX_STOP_TOKEN_IDS = 256
_MAX_REQUEST_ID_CHARS = 128


def check_request_id(request_id: str) -> None:
    """A request id travels in gRPC metadata and logs: printable ASCII, at most 128 characters."""
    if len(request_id) > _MAX_REQUEST_ID_CHARS or not all(" " <= c <= "~" for c in request_id):
        raise invalid_argument(
            f"request_id must be at most {_MAX_REQUEST_ID_CHARS} printable ASCII characters (no control or "
            "non-ASCII characters)"
        )


class RequestCheck:
    """Turns a GenerateRequest into a GenerationRequest and its K policy, for one orchestrator's target
    (and whether it has a draft service); compiles structured outputs off the event loop."""

    def __init__(
        self,
        config: OrchestratorConfig,
        target_info: common_pb2.ModelInfo,
        tokenizer: PreTrainedTokenizerBase,
        has_draft: bool,
    ) -> None:
        self.config = config
        self.target_info = target_info
        self.tokenizer = tokenizer
        self.has_draft = has_draft
        # Structured outputs: the orchestrator checks every committed token with a matcher of its own.
        self.grammars: Grammars | None = None
        if target_info.structured_output_kinds:
            self.grammars = Grammars.for_tokenizer(
                tokenizer, target_info.vocab_size, target_info.eos_token_ids, "orchestrator"
            )
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)

    async def _prompt_ids(self, request: orchestrator_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        context = self.target_info.max_context
        if which == "text":
            most = context * MAX_PROMPT_CHARS_PER_TOKEN
            if len(request.text) > most:
                raise invalid_argument(
                    f"the prompt text has {len(request.text)} characters; at most {most} are accepted for a "
                    f"context of {context} tokens"
                )
            # Tokenizing is CPU work: off the event loop, so other streams keep moving.
            ids = list((await asyncio.to_thread(self.tokenizer, request.text))["input_ids"]) if request.text else []
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = self.target_info.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise invalid_argument(f"token_ids holds {bad[0]}, outside the vocabulary [0, {vocab})")
        else:
            ids = []
        if not ids:
            raise invalid_argument("the prompt is empty: set `text` or `token_ids` to at least one token")
        if len(ids) >= context:
            raise invalid_argument(
                f"the prompt has {len(ids)} tokens but the target model's context is {context}; "
                f"shorten it to at most {context - 1} tokens"
            )
        return ids

    async def check(self, request: orchestrator_pb2.GenerateRequest) -> tuple[GenerationRequest, str]:
        """A GenerationRequest and the policy name, or INVALID_ARGUMENT naming the field and range.

        Everything a request can get wrong is checked here, before any service sees it."""
        cfg = self.config
        check_request_id(request.request_id)
        prompt = await self._prompt_ids(request)
        if not 1 <= request.max_new_tokens <= cfg.max_new_tokens_cap:
            raise invalid_argument(
                f"max_new_tokens must be in [1, {cfg.max_new_tokens_cap}]; got {request.max_new_tokens}"
            )
        sampling = SamplingParams(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p if request.HasField("top_p") else 1.0,
        ).validated()
        if request.speculation_policy and request.speculation_policy not in POLICY_BY_ENUM:
            raise invalid_argument(
                f"speculation_policy {request.speculation_policy} is unknown; use one of {', '.join(POLICIES)}"
            )
        policy = POLICY_BY_ENUM.get(request.speculation_policy, cfg.speculation_policy)
        if request.draft_method and request.draft_method not in DRAFT_METHOD_BY_ENUM:
            raise invalid_argument(
                f"draft_method {request.draft_method} is unknown; use one of {', '.join(DRAFT_METHODS)}"
            )
        method = DRAFT_METHOD_BY_ENUM.get(request.draft_method, cfg.draft_method)
        can_draft = self.has_draft or method != MODEL  # the lookup needs no draft service
        # Under load_aware, K is an upper bound, by default the server's cap.
        default_k = cfg.max_speculative_tokens if policy == "load_aware" else cfg.num_speculative_tokens
        k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else default_k * can_draft
        if not 0 <= k <= cfg.max_speculative_tokens:
            raise invalid_argument(f"num_speculative_tokens must be in [0, {cfg.max_speculative_tokens}]; got {k}")
        if k > 0 and not can_draft:
            raise failed_precondition(
                "num_speculative_tokens > 0 with the model draft method needs a draft service, and this "
                "orchestrator has none (start it with --draft HOST:PORT, use draft_method NGRAM, or send "
                "num_speculative_tokens = 0)"
            )
        if len(request.stop) > _MAX_STOP_STRINGS or any(not 0 < len(s) <= _MAX_STOP_CHARS for s in request.stop):
            raise invalid_argument(
                f"stop takes at most {_MAX_STOP_STRINGS} non-empty strings of at most {_MAX_STOP_CHARS} characters"
            )
        seed = request.seed if request.HasField("seed") else random.getrandbits(64)
        overlap = request.overlap_drafting if request.HasField("overlap_drafting") else cfg.overlap_drafting
        tree = request.speculation_tree if request.HasField("speculation_tree") else cfg.speculation_tree == "auto"
        request_id = request.request_id or uuid.uuid4().hex
        salt = request.cache_salt.encode()
        if len(salt) > MAX_CACHE_SALT_BYTES:
            raise invalid_argument(f"cache_salt has {len(salt)} bytes; at most {MAX_CACHE_SALT_BYTES} are accepted")
        constraint, template = await self._constraint(request)
        extras = self._vllm_extras(request, len(prompt), constraint is not None)
        generation_request = GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_new_tokens=request.max_new_tokens,
            sampling=sampling,
            seed=seed,
            num_speculative_tokens=k,
            overlap_drafting=overlap and k > 0,
            min_confidence=cfg.min_confidence,
            draft_method=method,
            ngram_min=cfg.ngram_min,
            ngram_max=cfg.ngram_max,
            cache_salt=salt,
            constraint=constraint,
            constraint_template=template,
            tree=tree and k > 0,
            **extras,
        )
        return generation_request, policy

    def _vllm_extras(
        self, request: orchestrator_pb2.GenerateRequest, prompt_tokens: int, constrained: bool
    ) -> dict[str, Any]:
        """ignore_eos, min_tokens, stop_token_ids and the logprobs fields, checked (INVALID_ARGUMENT naming
        the field and its range), as GenerationRequest's fields."""
        vocab = self.target_info.vocab_size
        stop_ids = frozenset(request.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab for t in stop_ids):
            raise invalid_argument(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, each in [0, {vocab})")
        if request.ignore_eos and constrained:
            raise invalid_argument(
                "ignore_eos cannot be combined with structured_output: a constrained output ends at EOS once "
                "it is complete"
            )
        if request.min_tokens > request.max_new_tokens:
            raise invalid_argument(
                f"min_tokens must be in [0, max_new_tokens = {request.max_new_tokens}]; got {request.min_tokens}"
            )
        banned = stop_ids | (frozenset() if request.ignore_eos else frozenset(self.target_info.eos_token_ids))
        ban = None
        if request.min_tokens and banned:
            ban = TokenBan(tuple(sorted(banned)), prompt_tokens + request.min_tokens)
        for name in ("top_logprobs", "prompt_logprobs"):
            if getattr(request, name) > MAX_TOP_LOGPROBS:
                raise invalid_argument(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]; got {getattr(request, name)}")
        if request.top_logprobs and not request.logprobs:
            raise invalid_argument("top_logprobs needs logprobs = true")
        prompt_logprobs = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        if prompt_logprobs is not None and prompt_tokens > self.target_info.max_batch_tokens:
            raise invalid_argument(
                f"prompt_logprobs scores the whole prompt in one forward: at most the target's max_batch_tokens = "
                f"{self.target_info.max_batch_tokens} prompt tokens; got {prompt_tokens}"
            )
        return {
            "ignore_eos": request.ignore_eos,
            "stop_token_ids": stop_ids,
            "ban": ban,
            "logprobs": request.logprobs,
            "top_logprobs": request.top_logprobs,
            "prompt_logprobs": prompt_logprobs,
        }

    async def _constraint(self, request: orchestrator_pb2.GenerateRequest) -> tuple[ConstraintSpec | None, Any]:
        """The request's structured output, compiled (off the event loop), or None; INVALID_ARGUMENT with
        the compiler's message when it does not compile."""
        if not request.HasField("structured_output"):
            return None, None
        spec = ConstraintSpec.from_proto(request.structured_output)
        if spec is None:
            return None, None
        if self.grammars is None or spec.kind not in self.target_info.structured_output_kinds:
            raise failed_precondition(
                f"structured_output.{spec.kind} is not supported by this server's target service "
                f"(it supports: {', '.join(self.target_info.structured_output_kinds) or 'none'})"
            )
        if not self.target_info.eos_token_ids:
            raise failed_precondition("structured_output needs an EOS token to end on, and the target model has none")
        template = self.grammars.cached(spec)
        if template is None:
            template = await asyncio.get_running_loop().run_in_executor(self._compiler, self.grammars.compile, spec)
        metrics.STRUCTURED_OUTPUT_REQUESTS.labels(spec.kind).inc()
        return spec, template
