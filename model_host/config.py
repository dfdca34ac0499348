"""One configuration object per model service, parsed from flags and SPECDEC_* environment variables."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from serving.config import add_config_arguments


@dataclass(frozen=True)
class ModelServiceConfig:
    """Settings of a draft or target service; the defaults live here and nowhere else."""

    model: str = ""
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    dtype: str = "auto"
    max_sessions: int = 64
    max_cached_tokens: str = "sessions"  # or "auto", or a number (model_host/kv_memory.py)
    kv_block_tokens: int = 16
    prefix_caching: bool = True
    session_idle_timeout_s: float = 300.0
    max_streams_per_peer: int = 16
    max_speculative_tokens: int = 16
    max_batch_size: int = 32
    max_batch_tokens: int = 2048
    prefill_chunk_tokens: int = 512
    max_queue_wait_s: float = 30.0
    batch_hold_fraction: float = 0.5
    lean_draft: bool = True
    speculation_cache_tokens: int = 2048
    target_tokenizer: str = ""
    metrics_port: int = 0
    health_port: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    threads: int = 0
    grace_period_s: float = 30.0
    log_level: str = "info"
    simulated_device: str = ""  # benchmarks only: a modeled GPU's clock (model_host/simulated.py)


_HELP: dict[str, str] = {
    "model": "checkpoint: a local folder or a Hugging Face hub id (AutoModelForCausalLM)",
    "host": "address to listen on (0.0.0.0 or :: in a container)",
    "port": "gRPC port (0 picks a free one)",
    "device": "cpu, cuda, cuda:N, or auto (spread over all GPUs with accelerate's device map)",
    "dtype": "float32, float16, bfloat16, or auto (the checkpoint's dtype on GPU, float32 on CPU)",
    "max_sessions": "most sessions held at once (RESOURCE_EXHAUSTED beyond)",
    "max_cached_tokens": "most tokens cached over all sessions (RESOURCE_EXHAUSTED beyond): the key-value blocks, "
    "allocated and written at start-up with the gather windows' buffers (start-up fails, naming this flag, when "
    "the memory cannot hold them); sessions (the default): --max-sessions sessions at the model's full context, "
    "capped as auto; auto: what 90%% of the GPU memory free after loading the weights holds (on CPU, half of the "
    "memory available), less the gather windows; or a number of tokens",
    "kv_block_tokens": "tokens per key-value block: the unit of allocation and of prefix reuse",
    "prefix_caching": "keep full blocks indexed by their prefix, so a session whose tokens begin alike starts "
    "from them (--no-prefix-caching: every session computes its prompt; a seed then reproduces exactly)",
    "session_idle_timeout_s": "an idle session's cache is freed after this many seconds",
    "max_streams_per_peer": "most open streams from one client (its mTLS name, else its address); one stream "
    "carries every session of an orchestrator, so this bounds idle or hostile connections, not sessions",
    "max_speculative_tokens": "largest K a step may ask for (draft tokens; a verify returns at most K + 1 rows)",
    "max_batch_size": "most sessions (rows) in one batched forward pass",
    "max_batch_tokens": "most tokens fed in one engine iteration, over all rows",
    "prefill_chunk_tokens": "a longer prompt is prefilled in chunks of this many tokens, so decoding keeps moving",
    "max_queue_wait_s": "a step not started within this many seconds is refused as busy (RESOURCE_EXHAUSTED)",
    "batch_hold_fraction": "wait at most this fraction of a forward for sessions expected back before one (0: never)",
    "lean_draft": "draft service: run Llama-family drafts with the lean forward pass (checked at start-up)",
    "speculation_cache_tokens": "draft service: most tokens drafted ahead for the likely verdicts of the steps under "
    "verification, over all sessions (the speculation cache; 0: none); each also holds a row of q under sampling. "
    "Blocks drafted ahead take forward rows and key-value blocks that live sessions leave free, and are dropped "
    "first",
    "target_tokenizer": "draft service: the target's tokenizer (a local folder or hub id) when it differs from the "
    "draft's: the draft then proposes only the tokens both share, by bytes (token-level intersection), and the "
    "orchestrator needs --draft-tokenizer; no speculation cache or token trees for such a draft in this version",
    "metrics_port": "Prometheus metrics port (0 disables)",
    "health_port": "a plaintext port serving gRPC health checks only, for probes that cannot speak TLS (0: none)",
    "tls_cert": "PEM certificate chain: serve TLS (with --tls-key)",
    "tls_key": "PEM private key for --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it (mutual TLS)",
    "threads": "torch CPU threads (0: the cores this process may use, from its CPU affinity and cgroup quota)",
    "grace_period_s": "seconds open sessions get to finish after SIGTERM",
    "log_level": "debug, info, warning or error",
    "simulated_device": "FOR BENCHMARKS ONLY: release each forward at a modeled GPU's clock (a roofline of a GPU "
    "and a model shape), its logits computed on the CPU as always; one of the profiles of model_host/simulated.py "
    "(h100-llama-3.1-8b, h100-llama-3.2-1b, 4xh100-llama-3.3-70b, h200-gpu-bench-1b); refused with a GPU device",
}


def parse_model_service_config(prog: str, argv: Sequence[str] | None = None) -> ModelServiceConfig:
    parser = argparse.ArgumentParser(prog=prog, description=f"specdec {prog}")
    add_config_arguments(parser, ModelServiceConfig, _HELP)
    args = parser.parse_args(argv)
    config = ModelServiceConfig(**vars(args))
    if not config.model:
        parser.error("--model is required (a local checkpoint folder or a hub id), or set SPECDEC_MODEL")
    positive = (
        "max_sessions",
        "max_streams_per_peer",
        "kv_block_tokens",
        "max_speculative_tokens",
        "max_batch_size",
        "prefill_chunk_tokens",
    )
    for name in positive:
        if getattr(config, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if config.max_cached_tokens not in ("auto", "sessions") and not (
        config.max_cached_tokens.isdigit() and int(config.max_cached_tokens)
    ):
        parser.error(
            "--max-cached-tokens must be a positive number of tokens, sessions or auto; "
            f"got {config.max_cached_tokens!r}"
        )
    if config.speculation_cache_tokens < 0:
        parser.error("--speculation-cache-tokens must be at least 0 (0: no speculation cache)")
    if not 0.0 <= config.batch_hold_fraction <= 1.0:
        parser.error("--batch-hold-fraction must be in [0, 1]")
    if config.max_batch_tokens < config.prefill_chunk_tokens:
        parser.error("--max-batch-tokens must be at least --prefill-chunk-tokens")
    if config.simulated_device:
        from model_host.simulated import profile_named

        try:
            profile_named(config.simulated_device)
        except ValueError as exc:
            parser.error(str(exc))
        if config.device != "cpu":
            parser.error(
                f"--simulated-device models a GPU on the CPU; it cannot run with --device {config.device} "
                "(drop one of them)"
            )
    return config
