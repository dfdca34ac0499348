"""A model service's start: its key-value pool, the forward it runs, and the engine around it.

The pool is sized once (model_host/kv_memory.py) and taken whole here, after the start-up check has
chosen the forward, so that the service's memory after start-up is its memory. The forward's cost
curve is measured (or, under `--simulated-device`, modeled) before the engine starts: the K policy
and the engine's grouping read it.
"""

from __future__ import annotations

import structlog

from model_host.attention import AttentionLayout
from model_host.config import ModelServiceConfig
from model_host.engine import DEFAULT_OVERHEAD_TOKENS, Engine
from model_host.forward import Forward, check_lengths
from model_host.job import EngineLimits
from model_host.kv_blocks import BlockStore, blocks_for
from model_host.kv_memory import PoolSize, pool_size
from model_host.loading import LoadedModel
from model_host.metrics import SIMULATED_DEVICE
from model_host.profile import PROFILE_PREFIX_TOKENS, forward_costs, modeled_costs, overhead_tokens, profile_shapes
from model_host.simulated import SimulatedForward, profile_named, simulate

log = structlog.get_logger(__name__)


def open_block_store(loaded: LoadedModel, config: ModelServiceConfig, role: str) -> tuple[BlockStore, PoolSize]:
    """The service's block store, its budget `--max-cached-tokens` (PoolTooLarge naming the flag when
    the memory cannot hold it); its tensors are allocated by the start-up check's forward."""
    pool = pool_size(
        config.max_cached_tokens, loaded, config.max_sessions, config.max_batch_size, config.kv_block_tokens
    )
    store = BlockStore(
        loaded.input_device,
        loaded.dtype,
        loaded.max_context,
        max(pool.tokens, _startup_tokens(loaded, config, role)),
        config.kv_block_tokens,
        config.prefix_caching,
        role,
        config.max_batch_size,
        budget_tokens=pool.tokens,
    )
    return store, pool


def _startup_tokens(loaded: LoadedModel, config: ModelServiceConfig, role: str) -> int:
    """What the start-up check and the forward-cost profile cache at once, in whole blocks: the store
    holds at least that, whatever the budget (admission still keeps to the budget)."""
    span = config.kv_block_tokens
    layout = AttentionLayout.of(loaded.model.config)
    check = check_lengths(layout, loaded.max_context, config.prefill_chunk_tokens)
    batch_sizes, widths = profile_shapes(config.device, role, config.max_batch_size, config.max_speculative_tokens)
    profile = [PROFILE_PREFIX_TOKENS + max(widths)] * batch_sizes[-1]
    return max(sum(blocks_for(n, span) for n in lengths) for lengths in (check, profile)) * span


def start_engine(
    forward: Forward, store: BlockStore, pool: PoolSize, loaded: LoadedModel, config: ModelServiceConfig, role: str
) -> tuple[Engine, list[tuple[int, float]]]:
    """The engine over `forward` (chosen by the start-up check), with the pool taken, and the
    forward's cost curve."""
    if forward.batched:
        store.take_pool()  # RSS from here on is the service's memory
    log.info(
        "kv_blocks",
        role=role,
        blocks=store.num_blocks - 2,
        block_tokens=config.kv_block_tokens,
        max_cached_tokens=pool.tokens,
        window_positions=store.windows.positions,
        pool_gib=round(pool.bytes / 2**30, 3) if forward.batched else 0,
        prefix_caching=config.prefix_caching,
    )
    if config.simulated_device:
        profile = profile_named(config.simulated_device)
        forward = simulate(forward, profile, loaded.model, loaded.vocab_size, role)
        SIMULATED_DEVICE.labels(role, profile.name).set(1)
    log.info("engine_forward", forward=forward.name, role=role)
    limits = EngineLimits(
        max_batch_size=config.max_batch_size,
        max_batch_tokens=config.max_batch_tokens,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        max_queue_wait_s=config.max_queue_wait_s,
        batch_hold_fraction=config.batch_hold_fraction,
    )
    if isinstance(forward, SimulatedForward):  # the modeled clock's own curve, to the largest verify
        costs = modeled_costs(forward, config.max_batch_size, config.max_speculative_tokens)
    else:
        batch_sizes, widths = profile_shapes(config.device, role, config.max_batch_size, config.max_speculative_tokens)
        costs = forward_costs(forward, loaded.vocab_size, batch_sizes, widths)
    overhead = overhead_tokens(costs, DEFAULT_OVERHEAD_TOKENS)
    log.info("engine_forward_overhead", tokens=round(overhead, 1), role=role)
    return Engine(forward, limits, role, overhead), costs
