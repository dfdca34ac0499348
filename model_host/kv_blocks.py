"""Keys and values of every session on a model service, in fixed-size blocks, with prefix reuse and
forks; and the one budget they are taken against.

Memory is allocated once, at start: per layer, one tensor of `num_blocks x block_tokens` token
positions ([kv_heads, positions, head_dim]), zeroed (model_host/kv_memory.py sizes it). A session
(an engine slot) holds a block table: its cached token at position p lives in block
`table[p // block_tokens]` at offset `p % block_tokens`. Nothing grows with a prompt; a long prompt
takes its blocks and gives them back.

Prefix reuse (as vLLM's automatic prefix caching and nano-vllm's block manager): every full block is
indexed by a hash chained along the prefix (`chain(parent, tokens)`, rooted in the session's cache
salt), so equal prefixes under the same salt have equal hashes. An indexed block is immutable: a
session that writes into one (a rollback into a shared or cached prefix) first copies it to a block
of its own. A block no session holds keeps its hash until a new block is needed, least recently
freed first.

A fork (`fork`) starts a branch that shares every block of its session; a write into a shared block
copies it first, as above. A branch is reclaimable: dropped before a live session is refused.

Admission (`reserve`): a step reserves, before its first forward, the blocks it may take; what slots
hold is counted from the blocks themselves, so a block many sessions share counts once.

Block 0 is scratch: padding positions write there and short rows' tables are padded with it, and
no query ever sees it. Positions of a row's window that it does not hold are masked; they hold
finite values (zeroed at start), as attention needs.

A forward reads and writes the store through a view (`BatchView`, model_host/batch_view.py), which
keeps the batch's keys and values gathered in windows between forwards (model_host/windows.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from model_host.config import ModelServiceConfig
from model_host.metrics import CACHED_TOKENS, KV_BLOCKS, KV_RESIDENT_BYTES, PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES
from model_host.rows import Row
from model_host.windows import Placement, Windows, window_positions

# vLLM's default block size; a session wastes at most one block's tail, and prefixes are shared in
# whole blocks. `--kv-block-tokens` changes it.
DEFAULT_BLOCK_TOKENS = 16
SCRATCH = 0
_ROOT = b"specdec-kv-v1"


class OutOfBlocks(RuntimeError):
    """No block is free or cached: for a branch's copy of its partial block (the pool is full), or
    because admission let more through than the pool holds (a bug)."""


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full block of `tokens` after the prefix whose last block hashed to `parent`."""
    return hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=16).digest()


def root(salt: bytes) -> bytes:
    """The parent of a sequence's first block under `salt`: different salts never share a block."""
    return hashlib.blake2b(_ROOT + salt, digest_size=16).digest()


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


class _Slot:
    """One session's (or fork branch's) part of the store: the one record of what it has cached."""

    __slots__ = ("hashes", "reclaimable", "reserved", "root", "table", "tokens", "writer")

    def __init__(self, salt: bytes = b"") -> None:
        self.table: list[int] = []  # block of each block_tokens positions
        self.tokens: list[int] = []  # the tokens cached, in order
        self.hashes: list[bytes] = []  # chain hash of each full block, in order (prefix caching only)
        self.root = root(salt)
        # The serial of the window of the last forward that wrote this slot (0: none). A number, not the
        # window: a slot must not keep a window alive, nor make a cycle with it that only the cyclic
        # garbage collector would free, holding its tensors until then.
        self.writer = 0
        self.reserved = 0  # blocks reserved for the step under way and not taken yet
        self.reclaimable = False  # a fork's branch: dropped before a live session is refused

    def branch(self) -> _Slot:
        """A copy that shares every block (the caller counts the references)."""
        branch = _Slot()
        branch.table, branch.tokens, branch.hashes = list(self.table), list(self.tokens), list(self.hashes)
        branch.root = self.root
        branch.reclaimable = True
        return branch


class BlockStore:
    """Per-layer key and value tensors of `num_blocks * block_tokens` positions, every slot's table,
    and the one budget every block is taken against.

    Used from the engine's thread only (forwards, forks, rollbacks, releases, reservations and lookups
    all run there): the truth about which blocks are held is here, so admission is decided here too
    (`reserve`), and a block shared by many slots counts once."""

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
        budget_tokens: int | None = None,
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.device = device
        self.dtype = dtype
        self.max_context = max_context
        self.block_tokens = block_tokens
        self.prefix_caching = prefix_caching
        pool = max_tokens if max_tokens is not None else 8 * max_context
        # What sessions may hold together (`--max-cached-tokens`); the pool may be larger, for what the
        # start-up check caches at once.
        self.budget_tokens = min(pool, budget_tokens) if budget_tokens is not None else pool
        self.budget_blocks = blocks_for(self.budget_tokens, block_tokens)
        # The pool's blocks, plus scratch and one spare for a copy-on-write's moment of two blocks.
        self.num_blocks = blocks_for(pool, block_tokens) + 2
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, num_blocks * block_tokens, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self._slots: dict[int, _Slot] = {}
        self._refs = [0] * self.num_blocks
        self._hash: list[bytes | None] = [None] * self.num_blocks  # what each indexed block is indexed under
        self._index: dict[bytes, int] = {}  # chain hash -> block
        # Held by no slot; taken from the front: blocks that cache nothing first, then the least
        # recently freed cached ones.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(SCRATCH + 1, self.num_blocks))
        self._cached = 0  # free blocks that keep an index entry
        self._reserved = 0  # over slots: blocks reserved and not taken yet
        self.tokens_held = 0  # over slots: tokens cached (the gauge; read from any thread)
        self.reclaimed: set[int] = set()  # branch slots dropped to admit a live session's step
        self.windows = Windows(block_tokens, max_rows, window_positions(max_rows, max_context, block_tokens, pool))
        self._blocks_gauges = {state: KV_BLOCKS.labels(role, state) for state in ("used", "cached", "free")}
        self.resident_bytes = 0  # the layers' key and value tensors, counted as they are allocated
        self._resident = KV_RESIDENT_BYTES.labels(role)
        self._resident.set(0)
        self._tokens_gauge = CACHED_TOKENS.labels(role)
        self._queries = PREFIX_CACHE_QUERIES.labels(role)
        self._hits = PREFIX_CACHE_HITS.labels(role)
        self.publish()

    # --- blocks --------------------------------------------------------------------------------

    def _take(self, slot: _Slot) -> int:
        """A block for `slot` to write: a free one that caches nothing, else the least recently freed
        (its hash dropped); out of the slot's reservation when it has one."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks - 2} key-value blocks are held by sessions")
        block, _ = self._free.popitem(last=False)
        digest = self._hash[block]
        if digest is not None:
            self._cached -= 1
            self._hash[block] = None
            del self._index[digest]
        self._refs[block] = 1
        if slot.reserved:
            slot.reserved -= 1
            self._reserved -= 1
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
        copy = self._take(slot)
        span = self.block_tokens
        for layer in self.keys:
            for tensor in (self.keys[layer], self.values[layer]):
                tensor[:, copy * span : (copy + 1) * span] = tensor[:, block * span : (block + 1) * span]
        slot.table[index] = copy
        self._drop(block)

    # --- admission ------------------------------------------------------------------------------

    @property
    def available_blocks(self) -> int:
        """Blocks a new reservation may have: the budget less what slots hold and have reserved
        (cached blocks no slot holds are available: they are evicted when taken)."""
        return self.budget_blocks - self.used_blocks - self._reserved

    def reserve(self, slot_id: int, length: int) -> bool:
        """Reserve the blocks the slot needs to grow from what it holds to `length` tokens (its step's
        reservation replaces the last one): a block for each new span of `block_tokens`, and the copy
        of the partial (or shared) block it writes into first. Branches are dropped first when the
        budget is short. False when it is short even then."""
        slot = self._slots.get(slot_id)
        held = len(slot.tokens) if slot is not None else 0
        need = max(0, blocks_for(length, self.block_tokens) - held // self.block_tokens)
        before = slot.reserved if slot is not None else 0
        if self.available_blocks + before < need:
            if slot is not None and slot.reclaimable:
                return False  # a branch never drops another
            self.reclaim()
            if self.available_blocks + before < need:
                return False
        if slot is None:
            slot = self._slots[slot_id] = _Slot()
        self._reserved += need - before
        slot.reserved = need
        return True

    def settle(self, slot_id: int) -> None:
        """The slot's step ended: what it reserved and did not take goes back."""
        slot = self._slots.get(slot_id)
        if slot is not None:
            self._reserved -= slot.reserved
            slot.reserved = 0

    def reclaim(self) -> list[int]:
        """Drop every fork branch: their blocks go back, and their next steps fail."""
        dropped = [slot_id for slot_id, slot in self._slots.items() if slot.reclaimable]
        for slot_id in dropped:
            self.drop(slot_id)
        return dropped

    def drop(self, slot_id: int) -> None:
        """Free a branch and remember that it was dropped: its next step fails rather than starting
        over as a new session (`release` forgets it)."""
        self.release(slot_id)
        self.reclaimed.add(slot_id)

    # --- what the engine calls ------------------------------------------------------------------

    def length(self, slot_id: int) -> int:
        """Tokens the slot holds."""
        slot = self._slots.get(slot_id)
        return len(slot.tokens) if slot is not None else 0

    def truncate(self, slot_id: int, length: int) -> None:
        """Roll the slot back to its first `length` tokens; the blocks past them are freed."""
        slot = self._slots.get(slot_id)
        if slot is None or len(slot.tokens) <= length:
            return
        keep = blocks_for(length, self.block_tokens)
        for block in reversed(slot.table[keep:]):
            self._drop(block)
        del slot.table[keep:]
        self.tokens_held -= len(slot.tokens) - length
        del slot.tokens[length:]
        del slot.hashes[length // self.block_tokens :]

    def release(self, slot_id: int) -> None:
        """The slot's session is gone: its blocks are freed, the indexed ones kept as cache (the last
        block the first evicted), and its reservation ends."""
        self.settle(slot_id)
        self.reclaimed.discard(slot_id)
        slot = self._slots.pop(slot_id, None)
        if slot is not None:
            self.tokens_held -= len(slot.tokens)
            for block in reversed(slot.table):
                self._drop(block)
            self.publish()

    def fork(self, slot_id: int, branch_id: int) -> None:
        """Start the empty slot `branch_id` as a branch of `slot_id`: it shares every block (the
        partial last one is copied on its first write, and that copy is reserved now). A branch is
        reclaimable: the store drops it before it refuses a live session (`reserve`)."""
        if branch_id in self._slots:
            raise ValueError(f"slot {branch_id} holds a session; a branch needs an empty one")
        parent = self._slots.get(slot_id)
        if parent is None:
            raise ValueError(f"slot {slot_id} holds nothing to fork")
        branch = parent.branch()
        for block in branch.table:
            self._refs[block] += 1
        self._slots[branch_id] = branch
        self.tokens_held += len(branch.tokens)
        if len(branch.tokens) % self.block_tokens and not self.reserve(branch_id, len(branch.tokens) + 1):
            self.release(branch_id)
            raise OutOfBlocks("no block is left for a branch's copy of its partial last block")

    def resolve(self, slot_id: int, branch_id: int) -> bool:
        """Make the branch what `slot_id` holds: the slot's own blocks go back, and the branch's slot
        is empty. False when the branch was dropped meanwhile: the slot keeps what it held."""
        branch = self._slots.pop(branch_id, None)
        if branch is None:
            return False
        self.release(slot_id)
        self._reserved -= branch.reserved
        branch.reserved = 0
        branch.reclaimable = False
        self._slots[slot_id] = branch  # windows know slots by identity: the branch keeps its window row
        return True

    def reuse(self, slot_id: int, tokens: Sequence[int], most: int, salt: bytes = b"") -> int:
        """Start an empty slot: its salt, and the longest run of cached full blocks that `tokens`
        begins with, at most `most` tokens. Returns the tokens reused (a multiple of block_tokens)."""
        self.release(slot_id)
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
        self.tokens_held += reused
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
                slot.table.append(self._take(slot))
            slot.tokens += row.token_ids
            self.tokens_held += len(row.token_ids)

    def commit(self, rows: list[Row]) -> None:
        """After a forward wrote the rows' keys and values: index the blocks it filled. A tree row's
        tokens are no sequence: they are dropped instead, but for the chain it keeps (its session holds
        what it held before, and that chain)."""
        span = self.block_tokens
        for row in rows:
            if row.parents:
                self.truncate(row.slot, row.start + row.kept)
            if self.prefix_caching and (row.kept or not row.parents):
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

    def place(self, rows: list[Row], kv_length: int) -> Placement:
        """Where this forward's rows go in the gather windows (called after `prepare`)."""
        return self.windows.place(rows, [self._slots[row.slot] for row in rows], kv_length)

    def drop_windows(self) -> None:
        """The engine is idle: no window can be continued (model_host/windows.py)."""
        self.windows.drop(self.keys)

    def table(self, slot_id: int) -> list[int]:
        slot = self._slots.get(slot_id)
        return slot.table if slot is not None else []

    # --- memory ---------------------------------------------------------------------------------

    def take_pool(self) -> None:
        """After the start-up check has run a forward (which allocated every layer's blocks, zeroed):
        allocate the gather windows' buffers too, so that what the service holds from now on is its
        memory."""
        self.windows.take(self.keys)
        self.publish()

    def reset(self) -> None:
        """Forget every slot, the index and the tensors: the batched forward was not chosen, and the
        serial fallback keeps its own caches (the store then only keeps the books, for admission)."""
        self.keys.clear()
        self.values.clear()
        self.resident_bytes = 0
        self._resident.set(0)
        self._slots.clear()
        self._refs = [0] * self.num_blocks
        self._hash = [None] * self.num_blocks
        self._index.clear()
        self._free = OrderedDict.fromkeys(range(SCRATCH + 1, self.num_blocks))
        self._cached = self._reserved = self.tokens_held = 0
        self.windows = Windows(self.block_tokens, self.windows.max_rows, self.windows.positions)
        self.publish()

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value tensors, allocated zeroed on first use for keys shaped like `like`
        [B, H, T, D]: every position holds finite values (attention adds the mask to the scores, and a
        zero weight times a NaN value is NaN)."""
        if index not in self.keys:
            shape = (like.shape[1], self.num_blocks * self.block_tokens, like.shape[3])
            self.keys[index] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values[index] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.resident_bytes += 2 * self.keys[index].numel() * self.keys[index].element_size()
            self._resident.set(self.resident_bytes)
        return self.keys[index], self.values[index]

    # --- accounting -----------------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        """Blocks no session holds that keep their contents for reuse."""
        return self._cached

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    def publish(self) -> None:
        cached = self.cached_blocks
        used = self.used_blocks
        self._blocks_gauges["used"].set(used)
        self._blocks_gauges["cached"].set(cached)
        self._blocks_gauges["free"].set(self.num_blocks - 1 - used - cached)
        self._tokens_gauge.set(self.tokens_held)
