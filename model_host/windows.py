"""The gather windows: the batch's keys and values as earlier forwards gathered them from the blocks.

A Hugging Face attention layer takes the batch's keys and values as one [B, H, L, D] tensor. A
forward gathers them from each row's blocks into a window; a decoding batch, whose next forward is
over mostly the same sessions, continues in the same window and writes only its new tokens there
instead of gathering every row again (a draft step feeds one token per forward for K forwards; a
decoding target batch, one a round). Each session keeps its row while it stays in the batches that
use the window; a session that joins takes a row freed by one that left, and only the rows that
changed are gathered again: streams of different lengths end and start at different steps
(docs/design.md, "Keys and values live in blocks").

The windows are a cache over the blocks, which stay the truth: a row is trusted only while its
session's last forward was this window's (`writer`). The block store owns them; a session's slot
invalidates its rows by being written through another window.

Their buffers are taken with the block pool, at start (`Windows.take`), and zeroed then: a row past a
session's own blocks holds finite values (a zero, or an earlier window's keys), as attention needs,
since the mask is added to the scores and a zero weight times a NaN value is NaN.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from model_host.rows import Row

# A window is kept with room for this many more positions a row, and at most this many windows (a
# target alternates decoding batches and verify batches; with overlapped drafting, batches of two widths).
WINDOW_HEADROOM = 64
KEPT_WINDOWS = 2
# Buffer sets taken at start: the kept windows' and a forward's own (a prefill's chunk keeps no window).
BUFFER_SETS = KEPT_WINDOWS + 1


class Written(Protocol):
    """What a window needs of a session's slot: which window's forward wrote it last."""

    writer: int


def window_positions(max_rows: int, max_context: int, block_tokens: int, pool_tokens: int) -> int:
    """Positions of one window's buffers: the largest batch at full context (rows of a window are
    padded to whole blocks, with the headroom), but at most half the pool, since what sessions hold
    together never exceeds the pool."""
    row = -(-(max_context + WINDOW_HEADROOM + 1) // block_tokens) * block_tokens
    return max(row, min(max_rows * row, pool_tokens // 2))


@dataclass(eq=False)
class Window:
    """Rows of sessions' keys and values, kept for the next forwards over mostly the same sessions."""

    serial: int  # unique in its store (0: a forward's own, not kept)
    slots: list[Written]  # the session of each row, by identity: a slot id given to another session is another slot
    valid: list[int]  # per row: how many leading positions hold the session's cached keys and values
    rows: int  # rows its buffers hold
    capacity: int  # positions per row; the last is scratch (padding writes there)
    buffers: Buffers  # where its keys and values live: [kv_heads, rows * capacity, head_dim] per layer


@dataclass(frozen=True)
class Placement:
    """Where a forward's rows go in a window."""

    window: Window
    order: list[int]  # the rows' index in the forward's list, by window row
    fresh: list[int] | None  # window rows to gather from the blocks (None: every row)


class Buffers:
    """Per-layer key and value tensors kept from one forward to the next. Allocated zeroed, for the
    largest window at once, and grown only for a forward wider than that (a prefill of many rows): a
    tensor reallocated as windows grew paid its page faults again each time (a new window of 28 rows:
    40 ms of a 70 ms forward)."""

    def __init__(self, most: int) -> None:
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.most = most  # positions of the largest window
        self.grown = False  # a forward wider than `most` made them larger

    def get(self, layer: int, positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, positions, head_dim] tensors for the layer (`like`: the layer's block tensor)."""
        heads, _, dim = like.shape
        size = heads * positions * dim
        kept = self._tensors.get(layer)
        if kept is None or kept[0].numel() < size:
            self.grown |= positions > self.most
            room = heads * max(self.most, positions) * dim
            kept = self._tensors[layer] = (like.new_zeros(room), like.new_zeros(room))
        shape = (heads, positions, dim)
        return kept[0][:size].view(shape), kept[1][:size].view(shape)


class Windows:
    """The kept windows of one block store, the least recently used first."""

    def __init__(self, block_tokens: int, max_rows: int, positions: int) -> None:
        self.block_tokens = block_tokens
        self.max_rows = max_rows  # rows of the largest batched forward (`--max-batch-size`)
        self.positions = positions  # of each window's buffers
        self.kept: OrderedDict[int, Window] = OrderedDict()  # by serial
        self.spare = [Buffers(positions) for _ in range(KEPT_WINDOWS)]  # buffers no kept window uses
        self.gathered = Buffers(positions)  # a forward's own gather when it keeps no window
        self._serial = 0  # the last window's
        self.continued = 0  # forwards that gathered nothing
        self.rows_gathered = 0  # rows forwards gathered from the blocks

    def take(self, layers: dict[int, torch.Tensor]) -> None:
        """Allocate every buffer set for every layer now (`layers`: each layer's block tensor), so that
        the service's memory after start-up is what it keeps."""
        for buffers in [*self.spare, self.gathered]:
            for index, like in layers.items():
                buffers.get(index, self.positions, like)

    def place(self, rows: list[Row], slots: list[Written], kv_length: int) -> Placement:
        """Where this forward's rows go: the kept window that holds most of their sessions, each
        continuing session in its own row; else a new window, or the forward's own buffers when a
        window would be too large or the forward is a prefill.

        A forward wider than a window's headroom (a long prompt's chunk) keeps no window: no next step
        of its sessions could continue in one (the next chunk outgrows it; a decoding step joins its
        batch's window), and keeping it would evict a decoding batch's window."""
        if max(len(row.token_ids) for row in rows) > WINDOW_HEADROOM:
            return self._own(rows, slots, kv_length)
        batch = {id(slot): index for index, slot in enumerate(slots)}
        best, overlap = None, 0
        for window in self.kept.values():
            common = sum(id(slot) in batch for slot in window.slots)
            if common > overlap:
                best, overlap = window, common
        if best is not None and kv_length < best.capacity and len(rows) <= best.rows:
            self.kept.move_to_end(best.serial)
            return self._continue(best, rows, slots, batch)
        span = self.block_tokens
        capacity = -(-(kv_length + WINDOW_HEADROOM + 1) // span) * span
        # Rows for the engine's largest batch where the positions allow: a batch that grows as streams
        # arrive joins the window instead of replacing it (docs/design.md, "Keys and values live in blocks")
        room = min(self.max_rows, self.positions // capacity)
        if room < len(rows):
            return self._own(rows, slots, kv_length)
        if best is not None:  # too short or too narrow now: a wider one replaces it
            self.spare.append(self.kept.pop(best.serial).buffers)
        self.rows_gathered += len(rows)
        while len(self.kept) >= KEPT_WINDOWS:
            self.spare.append(self.kept.popitem(last=False)[1].buffers)
        self._serial += 1
        buffers = self.spare.pop() if self.spare else Buffers(self.positions)
        window = self.kept[self._serial] = Window(
            self._serial, list(slots), [row.start for row in rows], room, capacity, buffers
        )
        for slot in slots:
            slot.writer = window.serial
        return Placement(window, list(range(len(rows))), None)

    def _own(self, rows: list[Row], slots: list[Written], kv_length: int) -> Placement:
        """A forward that keeps no window gathers into the own buffers; its sessions' rows in kept
        windows are stale from now on."""
        for slot in slots:
            slot.writer = 0
        self.rows_gathered += len(rows)
        own = -(-kv_length // self.block_tokens) * self.block_tokens
        return Placement(Window(0, list(slots), [], len(rows), own, self.gathered), list(range(len(rows))), None)

    def _continue(self, window: Window, rows: list[Row], slots: list[Written], batch: dict[int, int]) -> Placement:
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
            self.continued += 1
        self.rows_gathered += len(fresh)
        return Placement(window, order, None if len(fresh) == len(order) else sorted(fresh))

    def drop(self, layers: dict[int, torch.Tensor]) -> None:
        """The engine is idle: no window can be continued. Their buffers stay for the next busy spell;
        the own buffers go back to their size at start if a wide prefill grew them."""
        self.spare += [window.buffers for window in self.kept.values()]
        self.kept.clear()
        if self.gathered.grown:
            self.gathered = Buffers(self.positions)
            for index, like in layers.items():
                self.gathered.get(index, self.positions, like)
