"""How much memory the key-value pool takes, decided once at start.

The pool is the blocks (model_host/kv_blocks.py) and the gather windows' buffers
(model_host/windows.py). Both are allocated and written when the service starts, so that its memory
after start-up is its memory: a budget the host or the device cannot hold fails then, naming the
flag, not an hour later when the last block is first used.

`--max-cached-tokens`:
- `sessions` (the default): `--max-sessions` sessions at the model's full context, capped by what the
  memory holds (as `auto`). No session can then be refused for the pool while under `--max-sessions`.
- `auto`: what the memory free after loading the weights holds: 90% of the GPU's (vLLM's default
  gpu_memory_utilization), on a host half of what is available, since it shares it.
- a number of tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model_host.windows import BUFFER_SETS, window_positions

if TYPE_CHECKING:
    from model_host.loading import LoadedModel

GPU_SHARE = 0.9
HOST_SHARE = 0.5


class PoolTooLarge(ValueError):
    """The memory cannot hold the pool `--max-cached-tokens` asks for: the service refuses to start."""


@dataclass(frozen=True)
class PoolSize:
    """What the pool takes: its tokens, each window's positions, and the bytes of both."""

    tokens: int
    window_positions: int
    bytes_per_token: int

    @property
    def bytes(self) -> int:
        return (self.tokens + BUFFER_SETS * self.window_positions) * self.bytes_per_token


def kv_bytes_per_token(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of keys and values one token takes over all layers: read off the model's own cache
    after a one-token forward, so that any architecture's layout (grouped heads, head sizes) counts."""
    with torch.inference_mode():
        output = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
    total = 0
    for layer in getattr(output.cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return max(1, total)


def pool_size(
    setting: str | int, loaded: LoadedModel, max_sessions: int, max_rows: int, block_tokens: int, least: int = 0
) -> PoolSize:
    """The pool for `--max-cached-tokens setting` (at least `least` tokens: what the start-up check
    caches at once); PoolTooLarge naming the flag when the memory cannot hold it."""
    per_token = kv_bytes_per_token(loaded.model, loaded.input_device)
    context = loaded.max_context
    usable = _usable_bytes(loaded.input_device)
    full_batch = window_positions(max_rows, context, block_tokens, 1 << 62)
    holds = max(0, usable // per_token - BUFFER_SETS * full_batch)  # tokens the memory holds beside the windows
    setting = str(setting)
    if setting == "auto":
        tokens = holds
    elif setting == "sessions":
        tokens = min(max_sessions * context, holds)
    else:
        tokens = int(setting)
    tokens = max(tokens, least)
    size = PoolSize(tokens, window_positions(max_rows, context, block_tokens, tokens), per_token)
    where = "of the GPU's free memory" if loaded.input_device.type == "cuda" else "of the host's available memory"
    if size.bytes > usable:
        raise PoolTooLarge(
            f"--max-cached-tokens {setting}: {tokens} tokens of keys and values ({per_token} bytes each) and the "
            f"gather windows take {size.bytes / 2**30:.2f} GiB, more than the {usable / 2**30:.2f} GiB "
            f"({_share(loaded.input_device):.0%} {where}) this service may use; lower --max-cached-tokens, "
            "--max-batch-size or --max-sessions, or free memory"
        )
    if setting in ("auto", "sessions") and tokens < context:
        raise PoolTooLarge(
            f"--max-cached-tokens {setting}: {tokens} tokens hold less than one full context of {context}; "
            "free memory, or give a larger number"
        )
    return size


def _share(device: torch.device) -> float:
    return GPU_SHARE if device.type == "cuda" else HOST_SHARE


def _usable_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE)
    return int(host_available_bytes() * HOST_SHARE)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
