"""Keys and values of every session on a model service, in fixed-size blocks, with prefix reuse.

Memory is allocated once, by the token budget: per layer, one tensor of `num_blocks x block_tokens`
token positions ([positions, kv_heads, head_dim]). A session (an engine slot) holds a block table:
its cached token at position p lives in block `table[p // block_tokens]` at offset
`p % block_tokens`. Nothing grows with a prompt; a long prompt takes its blocks and gives them back.

Prefix reuse (as vLLM's automatic prefix caching and nano-vllm's block manager): every full block is
indexed by a hash chained along the prefix (`chain(parent, tokens)`, rooted in the session's cache
salt), so equal prefixes under the same salt have equal hashes. An indexed block is immutable: a
session that writes into one (a rollback into a shared or cached prefix) first copies it to a block
of its own. A block no session holds keeps its hash until a new block is needed, least recently
freed first; a reservation never waits for one.

Block 0 is scratch: padding positions write there and short rows' tables are padded with it, and
no query ever sees it. Positions of a row's window that it does not hold are masked; they hold
finite values (a block is zeroed before its first use), as attention needs: the mask is added to
the scores, and a zero weight times a NaN value is NaN.

A forward reads and writes the store through a view (`BatchView`, model_host/batch_view.py), which
keeps the batch's keys and values gathered in windows between forwards (`BlockStore.place`).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model_host.config import ModelServiceConfig
from model_host.metrics import KV_BLOCKS, KV_RESIDENT_BYTES, PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES

if TYPE_CHECKING:
    from model_host.loading import LoadedModel

# vLLM's default block size; a session wastes at most one block's tail, and prefixes are shared in
# whole blocks. `--kv-block-tokens` changes it.
DEFAULT_BLOCK_TOKENS = 16
SCRATCH = 0
_ROOT = b"specdec-kv-v1"
# A window is kept with room for this many more positions a row, and at most this many windows (a
# target alternates decoding batches and verify batches; with overlapped drafting, batches of two widths),
# each of at most 1 / _WINDOWS_SHARE of the budget's positions.
_WINDOW_HEADROOM = 64
_WINDOWS = 2
_WINDOWS_SHARE = 8


@dataclass(frozen=True)
class Row:
    """One session's part of a batched forward."""

    slot: int
    start: int  # tokens already cached for this session (its valid length after rollback)
    token_ids: list[int]  # the tokens to feed, at cache positions start .. start + len - 1
    num_logits: int  # logits wanted for the last num_logits of token_ids (0: none)


class OutOfBlocks(RuntimeError):
    """No block is free or cached: admission let more through than the pool holds (a bug)."""


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full block of `tokens` after the prefix whose last block hashed to `parent`."""
    return hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=16).digest()


def root(salt: bytes) -> bytes:
    """The parent of a sequence's first block under `salt`: different salts never share a block."""
    return hashlib.blake2b(_ROOT + salt, digest_size=16).digest()


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def kv_bytes_per_token(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of keys and values one token takes over all layers: read off the model's own cache
    after a one-token forward, so that any architecture's layout (grouped heads, head sizes) counts."""
    with torch.inference_mode():
        output = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
    total = 0
    for layer in getattr(output.past_key_values, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return max(1, total)


def kv_budget_tokens(setting: str | int, loaded: LoadedModel) -> int:
    """`--max-cached-tokens`: a number of tokens, or `auto`: what the memory free after loading the
    weights holds (90% of the GPU's, as vLLM's default gpu_memory_utilization; on CPU half of what the
    host has available, since the host shares it with everything else), less what the gather buffers
    take (`_Buffers`)."""
    if str(setting) != "auto":
        return int(setting)
    device = loaded.input_device
    per_token = kv_bytes_per_token(loaded.model, device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        usable = int(free * 0.9)
    else:
        usable = int(_host_available_bytes() * 0.5)
    # Less the gather buffers: the kept windows' and a forward's own, an eighth of the budget each at most
    tokens = usable // per_token * _WINDOWS_SHARE // (_WINDOWS_SHARE + _WINDOWS + 1)
    if tokens < loaded.max_context:
        raise ValueError(
            f"--max-cached-tokens auto: {usable / 2**30:.1f} GiB free holds {tokens} tokens of keys and values "
            f"({per_token} bytes each), less than one full context of {loaded.max_context}; free memory, or give "
            "a number"
        )
    return tokens


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _Slot:
    """One session's part of the store."""

    __slots__ = ("hashes", "root", "table", "tokens", "writer")

    def __init__(self, salt: bytes = b"") -> None:
        self.table: list[int] = []  # block of each block_tokens positions
        self.tokens: list[int] = []  # the tokens cached, in order
        self.hashes: list[bytes] = []  # chain hash of each full block, in order (prefix caching only)
        self.root = root(salt)
        # The serial of the window of the last forward that wrote this slot (0: none). A number, not the
        # window: a slot must not keep a window alive, nor make a cycle with it that only the cyclic
        # garbage collector would free, holding its tensors until then.
        self.writer = 0


@dataclass(eq=False)
class _Window:
    """Sessions' keys and values as earlier forwards gathered them, kept for the next forwards over
    mostly the same sessions: a decoding batch writes its new tokens into it instead of gathering every
    row from the blocks again (a draft step feeds one token per forward for K forwards; a decoding
    target batch, one a round). Each session keeps its row while it stays in the batches that use the
    window; a session that joins takes a row freed by one that left, and only the rows that changed are
    gathered again: streams of different lengths end and start at different steps (docs/design.md,
    "Keys and values live in blocks")."""

    serial: int  # unique in its store (0: a forward's own, not kept)
    slots: list[_Slot]  # the session of each row, by identity: a slot id given to another session is another _Slot
    valid: list[int]  # per row: how many leading positions hold the session's cached keys and values
    rows: int  # rows its buffers hold
    capacity: int  # positions per row; the last is scratch (padding writes there)
    buffers: _Buffers  # where its keys and values live: [kv_heads, rows * capacity, head_dim] per layer
    finite: int = 0  # its leading rows that a forward has written whole (the rest may be uninitialised)


@dataclass(frozen=True)
class _Placement:
    """Where a forward's rows go in a window."""

    window: _Window
    order: list[int]  # the rows' index in the forward's list, by window row
    fresh: list[int] | None  # window rows to gather from the blocks (None: every row)


class _Buffers:
    """Per-layer key and value tensors kept from one forward to the next, grown when a batch needs more
    positions and never shrunk while kept. A fresh tensor per forward would cost the host a page fault
    a page (large allocations are mapped afresh each time), which at 32 rows cost more than the gather
    itself."""

    def __init__(self, most: int) -> None:
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._most = most  # positions of the largest window

    def get(self, layer: int, positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, positions, head_dim] tensors for the layer (`like`: the layer's block tensor)."""
        heads, _, dim = like.shape
        size = heads * positions * dim
        kept = self._tensors.get(layer)
        if kept is None or kept[0].numel() < size:
            # Room for the largest window at once, as the blocks (`kv_budget_tokens` counts it):
            # on a host its pages cost memory only once written, and a tensor reallocated as windows
            # grew paid its page faults again each time (a new window of 28 rows: 40 ms of a 70 ms forward).
            room = heads * max(self._most, positions) * dim
            kept = self._tensors[layer] = (like.new_empty(room), like.new_empty(room))
        shape = (heads, positions, dim)
        return kept[0][:size].view(shape), kept[1][:size].view(shape)


class BlockStore:
    """Per-layer key and value tensors of `num_blocks * block_tokens` positions, and every slot's table.

    Used from the engine's thread only (forwards, rollbacks, releases and lookups all run there)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        max_tokens: int | None = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        prefix_caching: bool = True,
        role: str = "model",
        max_rows: int = ModelServiceConfig.max_batch_size,
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.max_rows = max_rows  # rows of the largest batched forward (`--max-batch-size`)
        self.device = device
        self.dtype = dtype
        self.max_context = max_context
        self.block_tokens = block_tokens
        self.prefix_caching = prefix_caching
        budget = max_tokens if max_tokens is not None else 8 * max_context
        # The budget's blocks, plus scratch and one spare for a copy-on-write's moment of two blocks.
        self.num_blocks = blocks_for(budget, block_tokens) + 2
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, num_blocks * block_tokens, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self._slots: dict[int, _Slot] = {}
        self._refs = [0] * self.num_blocks
        self._hash: list[bytes | None] = [None] * self.num_blocks  # what each indexed block is indexed under
        self._index: dict[bytes, int] = {}  # chain hash -> block
        self._free: OrderedDict[int, None] = OrderedDict()  # held by no slot; evicted from the front
        self._untouched = list(range(self.num_blocks - 1, SCRATCH, -1))  # never handed out; popped from the end
        # Blocks below this have been handed out (scratch included); each layer zeroes them once, before
        # their first write (`_zeroed`: how far it has).
        self._high_water = SCRATCH + 1
        self._zeroed: dict[int, int] = {}
        self._bytes_per_position = 0  # keys and values over the layers allocated
        self._cached = 0  # free blocks that keep an index entry
        # Gather buffers (two windows' and a forward's own) hold an eighth of the budget's positions
        # each, reserved at once: `kv_budget_tokens` leaves them their share of `auto`.
        self._windows: OrderedDict[int, _Window] = OrderedDict()  # by serial, the least recently used first
        self._spare: list[_Buffers] = []  # buffers of windows gone, for the next ones
        self._window_positions = max(1, budget // _WINDOWS_SHARE)
        self.gathered = _Buffers(self._window_positions)  # a forward's gather when it keeps no window
        self._serial = 0  # the last window's
        self.windows_continued = 0  # forwards that gathered nothing
        self.rows_gathered = 0  # rows forwards gathered from the blocks
        self._blocks_gauges = {state: KV_BLOCKS.labels(role, state) for state in ("used", "cached", "free")}
        self._resident = KV_RESIDENT_BYTES.labels(role)
        self._queries = PREFIX_CACHE_QUERIES.labels(role)
        self._hits = PREFIX_CACHE_HITS.labels(role)
        self.publish()

    # --- blocks --------------------------------------------------------------------------------

    def _take(self) -> int:
        """A block for a slot to write: a free one that caches nothing, else a never-used one, else the
        least recently freed (its hash dropped). Never-used blocks cost memory on first use (on a host),
        so a block with nothing worth keeping goes first; a cached one only when no other is left."""
        if self._free and self._hash[next(iter(self._free))] is None:
            block, _ = self._free.popitem(last=False)
        elif self._untouched:
            block = self._untouched.pop()
            self._high_water = block + 1
        elif self._free:
            block, _ = self._free.popitem(last=False)
            digest = self._hash[block]
            if digest is not None:
                self._cached -= 1
                self._hash[block] = None
                del self._index[digest]
        else:
            raise OutOfBlocks(f"all {self.num_blocks - 2} key-value blocks are held by sessions")
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        """One holder fewer; a block nobody holds stays cached (when indexed) until it is needed."""
        self._refs[block] -= 1
        if self._refs[block]:
            return
        self._free[block] = None
        if self._hash[block] is None:
            self._free.move_to_end(block, last=False)  # nothing worth keeping: reused first
        else:
            self._cached += 1

    def _writable(self, slot: _Slot, index: int) -> None:
        """Make the slot's block `index` its own before a write into it (copy-on-write)."""
        block = slot.table[index]
        if self._refs[block] == 1 and self._hash[block] is None:
            return
        copy = self._take()
        span = self.block_tokens
        for layer in self.keys:
            self.zero_new_blocks(layer)
            for tensor in (self.keys[layer], self.values[layer]):
                tensor[:, copy * span : (copy + 1) * span] = tensor[:, block * span : (block + 1) * span]
        slot.table[index] = copy
        self._drop(block)

    # --- what the engine calls ------------------------------------------------------------------

    def truncate(self, slot_id: int, length: int) -> None:
        """Roll the slot back to its first `length` tokens; the blocks past them are freed."""
        slot = self._slots.get(slot_id)
        if slot is None or len(slot.tokens) <= length:
            return
        keep = blocks_for(length, self.block_tokens)
        for block in reversed(slot.table[keep:]):
            self._drop(block)
        del slot.table[keep:]
        del slot.tokens[length:]
        del slot.hashes[length // self.block_tokens :]

    def release(self, slot_id: int) -> None:
        """The slot's session is gone: its blocks are freed, the indexed ones kept as cache (the last
        block the first evicted)."""
        slot = self._slots.pop(slot_id, None)
        if slot is not None:
            for block in reversed(slot.table):
                self._drop(block)
            self.publish()

    def reuse(self, slot_id: int, tokens: Sequence[int], most: int, salt: bytes = b"") -> int:
        """Start an empty slot: its salt, and the longest run of cached full blocks that `tokens`
        begins with, at most `most` tokens. Returns the tokens reused (a multiple of block_tokens)."""
        slot = self._slots[slot_id] = _Slot(salt)
        if not self.prefix_caching:
            return 0
        span = self.block_tokens
        parent = slot.root
        for start in range(0, max(0, most) - span + 1, span):
            digest = chain(parent, tokens[start : start + span])
            block = self._index.get(digest)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._free[block]
                self._cached -= 1
            self._refs[block] += 1
            slot.table.append(block)
            slot.hashes.append(digest)
            parent = digest
        reused = len(slot.table) * span
        slot.tokens = list(tokens[:reused])
        self._queries.inc(len(tokens))
        self._hits.inc(reused)
        return reused

    def prepare(self, rows: list[Row]) -> None:
        """Blocks for every row's new tokens (rolled back first where a row starts earlier)."""
        span = self.block_tokens
        for row in rows:
            slot = self._slots.get(row.slot)
            if slot is None:
                if row.start:
                    raise ValueError(f"slot {row.slot} holds no tokens, and a step starts at {row.start}")
                slot = self._slots[row.slot] = _Slot()
            if row.start > len(slot.tokens):
                raise ValueError(f"slot {row.slot} holds {len(slot.tokens)} tokens, and a step starts at {row.start}")
            self.truncate(row.slot, row.start)
            end = row.start + len(row.token_ids)
            if end > self.max_context:
                raise ValueError(f"{end} positions exceed the model's context of {self.max_context}")
            if row.start % span:
                self._writable(slot, row.start // span)
            while len(slot.table) * span < end:
                slot.table.append(self._take())
            slot.tokens += row.token_ids

    def commit(self, rows: list[Row]) -> None:
        """After a forward wrote the rows' keys and values: index the blocks it filled."""
        if self.prefix_caching:
            span = self.block_tokens
            for row in rows:
                slot = self._slots[row.slot]
                for index in range(len(slot.hashes), len(slot.tokens) // span):
                    parent = slot.hashes[-1] if slot.hashes else slot.root
                    digest = chain(parent, slot.tokens[index * span : (index + 1) * span])
                    slot.hashes.append(digest)
                    block = slot.table[index]
                    if digest not in self._index and self._hash[block] is None:
                        self._index[digest] = block
                        self._hash[block] = digest
        self.publish()

    def place(self, rows: list[Row], kv_length: int) -> _Placement:
        """Where this forward's rows go (called after `prepare`): the kept window that holds most of
        their sessions, each continuing session in its own row; else a new window, or the forward's own
        buffers when a window would be too large or the forward is a prefill.

        A forward wider than a window's headroom (a long prompt's chunk) keeps no window: no next step
        of its sessions could continue in one (the next chunk outgrows it; a decoding step joins its
        batch's window), and keeping it would evict a decoding batch's window."""
        slots = [self._slots[row.slot] for row in rows]
        if max(len(row.token_ids) for row in rows) > _WINDOW_HEADROOM:
            return self._own(rows, slots, kv_length)
        batch = {id(slot): index for index, slot in enumerate(slots)}
        best, overlap = None, 0
        for window in self._windows.values():
            common = sum(id(slot) in batch for slot in window.slots)
            if common > overlap:
                best, overlap = window, common
        if best is not None and kv_length < best.capacity and len(rows) <= best.rows:
            self._windows.move_to_end(best.serial)
            return self._continue(best, rows, slots, batch)
        capacity = blocks_for(kv_length + _WINDOW_HEADROOM + 1, self.block_tokens) * self.block_tokens
        # Rows for the engine's largest batch where the positions allow: a batch that grows as streams
        # arrive joins the window instead of replacing it (docs/design.md, "Keys and values live in blocks")
        room = min(self.max_rows, self._window_positions // capacity)
        if room < len(rows):
            return self._own(rows, slots, kv_length)
        if best is not None:  # too short or too narrow now: a wider one replaces it
            self._spare.append(self._windows.pop(best.serial).buffers)
        self.rows_gathered += len(rows)
        while len(self._windows) >= _WINDOWS:
            self._spare.append(self._windows.popitem(last=False)[1].buffers)
        self._serial += 1
        buffers = self._spare.pop() if self._spare else _Buffers(self._window_positions)
        window = self._windows[self._serial] = _Window(
            self._serial, slots, [row.start for row in rows], room, capacity, buffers
        )
        for slot in slots:
            slot.writer = window.serial
        return _Placement(window, list(range(len(rows))), None)

    def _own(self, rows: list[Row], slots: list[_Slot], kv_length: int) -> _Placement:
        """A forward that keeps no window gathers into the store's scratch buffers; its sessions' rows
        in kept windows are stale from now on."""
        for slot in slots:
            slot.writer = 0
        self.rows_gathered += len(rows)
        own = blocks_for(kv_length, self.block_tokens) * self.block_tokens
        return _Placement(_Window(0, slots, [], len(rows), own, self.gathered), list(range(len(rows))), None)

    def _continue(self, window: _Window, rows: list[Row], slots: list[_Slot], batch: dict[int, int]) -> _Placement:
        """Place the rows in `window`: sessions it holds keep their rows; sessions that left free theirs,
        which joining sessions take first; the last rows move into the holes that remain. Rows that
        joined, moved, were rolled back past what the window holds or were written by another forward
        since are gathered again."""
        occupant: list[int | None] = [batch.get(id(slot)) for slot in window.slots]  # batch index per row
        stale = {  # batch indices
            index
            for row, index in enumerate(occupant)
            if index is not None and (slots[index].writer != window.serial or rows[index].start > window.valid[row])
        }
        placed = {index for index in occupant if index is not None}
        holes = [row for row, index in enumerate(occupant) if index is None]
        holes.reverse()  # popped lowest first
        fresh: set[int] = set()
        for index in range(len(rows)):
            if index in placed:
                continue
            if holes:
                row = holes.pop()
                occupant[row] = index
            else:
                row = len(occupant)
                occupant.append(index)
            fresh.add(row)
        while holes:  # fewer sessions than before: the last rows fill the holes
            row = holes.pop()
            while occupant[-1] is None:
                occupant.pop()
            if row >= len(occupant):
                break
            occupant[row] = occupant.pop()
            fresh.add(row)
        while occupant[-1] is None:
            occupant.pop()
        order = [index for index in occupant if index is not None]
        fresh |= {row for row, index in enumerate(order) if index in stale}
        window.slots = [slots[index] for index in order]
        window.valid = [rows[index].start for index in order]  # what this forward writes is valid once it ends
        for slot in window.slots:
            slot.writer = window.serial
        if not fresh:
            self.windows_continued += 1
        self.rows_gathered += len(fresh)
        return _Placement(window, order, None if len(fresh) == len(order) else sorted(fresh))

    def drop_windows(self) -> None:
        """The engine is idle: no window can be continued. Their buffers stay for the next busy spell
        (bounded: two windows of an eighth of the budget's positions at most), as a host would fault
        their pages in again (replayed: 0-2% of the forwards' time over a load run that stops between
        repetitions); the gather of long prompts' chunks goes back."""
        self._spare += [window.buffers for window in self._windows.values()]
        self._windows.clear()
        self.gathered = _Buffers(self._window_positions)

    def table(self, slot_id: int) -> list[int]:
        slot = self._slots.get(slot_id)
        return slot.table if slot is not None else []

    # --- accounting -----------------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        """Blocks no session holds that keep their contents for reuse."""
        return self._cached

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free) - len(self._untouched)

    def publish(self) -> None:
        cached = self.cached_blocks
        used = self.used_blocks
        self._blocks_gauges["used"].set(used)
        self._blocks_gauges["cached"].set(cached)
        self._blocks_gauges["free"].set(self.num_blocks - 1 - used - cached)
        self._resident.set(self._high_water * self.block_tokens * self._bytes_per_position)

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value tensors, allocated on first use for keys shaped like `like` [B, H, T, D].

        Uninitialised (`empty`): a block is zeroed before its first use (`zero_new_blocks`), so host
        memory grows with the blocks used, never past the budget."""
        if index not in self.keys:
            shape = (like.shape[1], self.num_blocks * self.block_tokens, like.shape[3])
            self.keys[index] = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.values[index] = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._zeroed[index] = 0
            self._bytes_per_position += 2 * shape[0] * shape[2] * self.keys[index].element_size()
        self.zero_new_blocks(index)
        return self.keys[index], self.values[index]

    def zero_new_blocks(self, layer: int) -> None:
        """Zero the layer's blocks handed out since it last did (each block once in its life)."""
        done, high = self._zeroed[layer], self._high_water
        if done < high:
            span = self.block_tokens
            self.keys[layer][:, done * span : high * span] = 0
            self.values[layer][:, done * span : high * span] = 0
            self._zeroed[layer] = high
