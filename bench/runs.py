"""What the benchmark runs: configurations over the services, and Hugging Face's in-process anchor."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from model_host.loading import LoadedModel
from serving.protocol import DRAFT_METHOD_BY_NAME, POLICY_BY_NAME
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tools.client import GenerateResult, generate


@dataclass(frozen=True)
class Config:
    """One row of the table."""

    name: str
    kind: str  # "target" (K = 0 through the services), "specdec", or "hf" (in-process)
    k: int = 0
    policy: str = "fixed"
    overlap: bool = False
    method: str = "model"  # who proposes: model, ngram or hybrid


@dataclass
class Sample:
    """One generation of one prompt under one config."""

    config: str
    mode: str  # greedy | sampling
    prompt: int
    repetition: int
    tokens: int
    seconds: float
    rounds: int = 0
    draft_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    wire_bytes: int = 0
    ngram_draft_tokens: int = 0
    ngram_accepted_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def default_configs(max_k: int) -> list[Config]:
    configs = [Config("target alone", "target")]
    configs += [Config(f"specdec K={k}", "specdec", k) for k in range(1, max_k + 1)]
    configs += [
        Config("specdec heuristic", "specdec", 4, "heuristic"),
        Config("specdec cost_model", "specdec", 4, "cost_model"),
        Config("specdec K=4 overlap", "specdec", 4, "fixed", overlap=True),
        Config("specdec heuristic overlap", "specdec", 4, "heuristic", overlap=True),
        Config("specdec load_aware", "specdec", 16, "load_aware"),
        Config("ngram K=4", "specdec", 4, method="ngram"),
        Config("ngram load_aware", "specdec", 16, "load_aware", method="ngram"),
        Config("hybrid K=4", "specdec", 4, method="hybrid"),
        Config("hybrid load_aware", "specdec", 16, "load_aware", method="hybrid"),
        Config("HF target alone", "hf", 0),
        Config("HF assisted K=4", "hf", 4, "fixed"),
        Config("HF assisted heuristic", "hf", 4, "heuristic"),
    ]
    return configs


def sampling_fields(mode: str, seed: int) -> dict[str, Any]:
    return {"temperature": 0.8, "seed": seed} if mode == "sampling" else {"temperature": 0.0}


class ServiceRunner:
    """Runs configurations through the orchestrator over gRPC."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def run(self, config: Config, mode: str, prompt: str, max_new_tokens: int, seed: int) -> GenerateResult:
        request = orchestrator_pb2.GenerateRequest(
            text=prompt,
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=config.k,
            speculation_policy=POLICY_BY_NAME[config.policy],
            overlap_drafting=config.overlap,
            draft_method=DRAFT_METHOD_BY_NAME[config.method],
            **sampling_fields(mode, seed),
        )
        return generate(self.stub, request)

    def close(self) -> None:
        self.channel.close()


class HuggingFaceRunner:
    """`generate(assistant_model=...)` in one process: the anchor users know."""

    def __init__(self, target: LoadedModel, draft: LoadedModel) -> None:
        assert target.tokenizer is not None
        self.target = target
        self.draft = draft
        self.tokenizer = target.tokenizer

    def run(self, config: Config, mode: str, prompt: str, max_new_tokens: int, seed: int) -> tuple[list[int], float]:
        input_ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "attention_mask": torch.ones_like(input_ids),
            "pad_token_id": self.tokenizer.eos_token_id,
        }
        if mode == "sampling":
            kwargs.update(do_sample=True, temperature=0.8, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False)
        if config.k:
            kwargs.update(
                assistant_model=self.draft.model,
                num_assistant_tokens=config.k,
                num_assistant_tokens_schedule="heuristic" if config.policy == "heuristic" else "constant",
                assistant_confidence_threshold=0.0,
            )
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.target.model.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - started
        return output[0, input_ids.shape[1] :].tolist(), seconds
