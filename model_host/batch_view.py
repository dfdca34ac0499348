"""One forward's view onto the block store (model_host/kv_blocks.py), passed to a Hugging Face model
as its `cache`.

Rows are right-aligned in a step of width T: row i's T_i new tokens sit at input positions
T - T_i .. T - 1, so every row's last token is at T - 1 and the logits wanted are always the last
few positions. Input position t of row i is cache position start_i + t - (T - T_i). Padding queries
sit at position 0 and see key 0 alone under every attention pattern, so nothing is undefined; their
keys and values are written to the scratch block. A layer's queries see the cached positions its
attention pattern allows (`BatchView.mask`: global, sliding window or chunk; model_host/attention.py).
"""

from __future__ import annotations

import torch

from model_host.attention import GLOBAL, LayerAttention, visible_keys
from model_host.kv_blocks import SCRATCH, BlockStore
from model_host.rows import Row


def split_logits(logits: torch.Tensor, rows: list[Row]) -> list[torch.Tensor | None]:
    """Per row, the last num_logits of logits [B, kept, vocab] (rows are right-aligned)."""
    kept = logits.shape[1]
    return [
        (row_logits if row.num_logits == kept else row_logits[kept - row.num_logits :]) if row.num_logits else None
        for row, row_logits in zip(rows, logits.unbind(0), strict=True)
    ]


def _addresses(table: list[int], start: int, end: int, span: int) -> list[int]:
    """Where cache positions start .. end - 1 of a session with block `table` live in a layer tensor."""
    out: list[int] = []
    position = start
    while position < end:
        block, offset = divmod(position, span)
        take = min(span - offset, end - position)
        first = table[block] * span + offset
        out += range(first, first + take)
        position += take
    return out


def _one_copy(device: torch.device) -> bool:
    """Whether joining rows are gathered in one copy (a device pays a kernel launch a copy: one
    gather into a temporary and one scatter into the rows) or one copy a row (a host: 70 against 209
    µs a tensor for 5 rows of 13 blocks)."""
    return device.type != "cpu"


def _padded(table: list[int], num_blocks: int) -> list[int]:
    """The first `num_blocks` of a block table, padded with the scratch block: past a row's own blocks
    (a window's room to grow, a shorter row) it reads the scratch block, finite and masked."""
    return table[:num_blocks] + [SCRATCH] * (num_blocks - len(table))


class BatchView:
    """One forward's window onto the block store; passed to a Hugging Face model as its `cache`.

    The model calls `update(keys, values, layer)` in every attention layer: the new keys and values are
    written at each row's positions, and the batch's keys and values up to the longest row come back
    from a window, gathered there from each row's blocks where it does not hold them already. The
    forward's rows are in the window's order (`rows`); `order` maps them back."""

    is_compileable = False

    def __init__(self, store: BlockStore, rows: list[Row]) -> None:
        device = store.device
        self.store = store
        self.width = max(len(row.token_ids) for row in rows)  # T
        self.kv_length = max(row.start + len(row.token_ids) for row in rows)  # not from the tensors: no device sync
        store.prepare(rows)
        placement = store.place(rows, self.kv_length)
        self.window, self.order, self.fresh = placement.window, placement.order, placement.fresh
        self.rows = rows = [rows[index] for index in self.order]
        try:
            self._index(rows, device)
        except BaseException:
            self._distrust()
            raise
        self._keys = torch.arange(self.kv_length, device=device)  # [L]
        self._masks: dict[LayerAttention, torch.Tensor] = {}

    def _index(self, rows: list[Row], device: torch.device) -> None:
        """The forward's index tensors. Built in Python lists, one tensor each: a decoding batch's are a
        few dozen numbers, where tensor arithmetic costs a few microseconds an operation."""
        store, width, capacity = self.store, self.width, self.window.capacity
        span = store.block_tokens
        self._tables = [store.table(row.slot) for row in rows]
        write: list[int] = []  # [B * T] positions in the layer tensor, row by row (padding: scratch)
        positions: list[int] = []  # [B * T] each input token's cache position (padding: 0)
        for row, table in zip(rows, self._tables, strict=True):
            pad, end = width - len(row.token_ids), row.start + len(row.token_ids)
            write += [SCRATCH * span] * pad
            write += _addresses(table, row.start, end, span)
            positions += [0] * pad
            positions += [row.start + depth for depth in row.depths()] if row.parents else range(row.start, end)
        self.write_index = torch.tensor(write, dtype=torch.long, device=device)
        if self.fresh is not None:  # a kept window: the new tokens go into its rows too
            in_window: list[int] = []  # [B * T] row b's at b * capacity (padding: its last position)
            for index, row in enumerate(rows):
                base, end = index * capacity, row.start + len(row.token_ids)
                in_window += [base + capacity - 1] * (width - len(row.token_ids))
                in_window += range(base + row.start, base + end)
            self.window_index = torch.tensor(in_window, dtype=torch.long, device=device)
        # Padding queries sit at position 0, so every pattern lets them see key 0 alone: never undefined.
        self.position_ids = torch.tensor(positions, dtype=torch.long, device=device).view(len(rows), width)
        # Whole blocks are gathered (16 times fewer, larger copies: 2.5x faster than position by position)
        per_row = capacity // span
        self.into_blocks: torch.Tensor | None = None
        if self.fresh is None:  # every row, padded to the window's capacity: one copy per tensor
            read = [block for table in self._tables for block in _padded(table, per_row)]
        else:  # rows that join a kept window: one copy per row (docs/design.md, "Keys and values live in blocks")
            # Only a row's own blocks: what lies past them in the window row is finite (zeroed at start,
            # or an earlier session's keys), and masked.
            read = []
            self.joins: list[tuple[int, int, int]] = []  # (first block in the window, in read_blocks, count)
            for index in self.fresh:
                table = self._tables[index]
                self.joins.append((index * per_row, len(read), len(table)))
                read += table
            if _one_copy(device):
                into = [first + offset for first, _, count in self.joins for offset in range(count)]
                self.into_blocks = torch.tensor(into, dtype=torch.long, device=device)
        self.read_blocks = torch.tensor(read, dtype=torch.long, device=device)
        self._trees = [(index, row) for index, row in enumerate(rows) if row.parents]
        self._tree: tuple[torch.Tensor, torch.Tensor] | None = None  # (key positions, ancestors): `_tree_keys`

    def mask(self, layer: LayerAttention = GLOBAL) -> torch.Tensor:
        """[B, 1, T, L] True where a query may attend, for a layer of this pattern (built once per view)."""
        mask = self._masks.get(layer)
        if mask is None:
            if self._trees:
                key_positions, ancestors = self._tree_keys()
                mask = visible_keys(layer, key_positions, self.position_ids) & ancestors
            else:
                mask = visible_keys(layer, self._keys[None], self.position_ids)
            mask = self._masks[layer] = mask[:, None]
        return mask

    def _tree_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For a batch with tree rows: each key's position [B, L] (a tree token's at its depth's, so that
        windows and chunks are measured along its path) and [B, T, L] where a query may see a key as
        far as the tree goes (of the tree, a tree query sees its ancestors and itself alone). Built
        once per view: every layer pattern shares them."""
        if self._tree is None:
            device = self._keys.device
            batch, width = self.position_ids.shape
            key_positions = self._keys[None].repeat(batch, 1)  # [B, L]
            ancestors = torch.ones((batch, width, self.kv_length), dtype=torch.bool, device=device)  # [B, T, L]
            for index, row in self._trees:
                count = len(row.token_ids)
                tree = slice(row.start, row.start + count)
                key_positions[index, tree] = torch.tensor([row.start + d for d in row.depths()], device=device)
                seen = torch.zeros((count, count), dtype=torch.bool)  # [count, count]: token sees token
                for token, parent in enumerate(row.parents):
                    if parent >= 0:
                        seen[token] = seen[parent]
                    seen[token, token] = True
                ancestors[index, width - count :, tree] = seen.to(device)
                ancestors[index, : width - count, tree] = False  # padding queries see key 0 alone
            self._tree = key_positions, ancestors
        return self._tree

    def input_ids(self) -> torch.Tensor:
        """[B, T] the rows' tokens, right-aligned (padding is token 0, never seen)."""
        ids = [[0] * (self.width - len(row.token_ids)) + list(row.token_ids) for row in self.rows]
        return torch.tensor(ids, dtype=torch.long, device=self.store.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values [B, H, T, D]; the batch's [B, H, kv_length, D]."""
        keys, values = self.store.layer(layer_idx, key_states)  # [H, positions, D]
        # Head-major storage and index_copy_ / index_select over the positions: each head's keys of a
        # row are contiguous, the layout attention reads fastest (2x the [B, L, H, D] view's speed).
        batch, heads, _, dim = key_states.shape
        new_keys = key_states.transpose(0, 1).reshape(heads, -1, dim).to(keys.dtype)  # [H, B * T, D]
        new_values = value_states.transpose(0, 1).reshape(heads, -1, dim).to(values.dtype)
        keys.index_copy_(1, self.write_index, new_keys)
        values.index_copy_(1, self.write_index, new_values)
        window = self.window
        kept_keys, kept_values = window.buffers.get(layer_idx, window.rows * window.capacity, keys)
        span = self.store.block_tokens
        for source, kept, new in ((keys, kept_keys, new_keys), (values, kept_values, new_values)):
            blocks = source.view(heads, -1, span, dim)
            into = kept.view(heads, -1, span, dim)
            if self.fresh is None:  # every row, straight into place
                torch.index_select(blocks, 1, self.read_blocks, out=into[:, : len(self.read_blocks)])
                continue
            if self.into_blocks is not None:
                into.index_copy_(1, self.into_blocks, blocks.index_select(1, self.read_blocks))
            else:
                for into_first, read_first, count in self.joins:
                    read = self.read_blocks[read_first : read_first + count]
                    torch.index_select(blocks, 1, read, out=into[:, into_first : into_first + count])
            kept.index_copy_(1, self.window_index, new)  # the rows it holds: only the new tokens
        shape = (heads, window.rows, window.capacity, dim)
        length = self.kv_length
        return (
            kept_keys.view(shape)[:, :batch].transpose(0, 1)[:, :, :length],
            kept_values.view(shape)[:, :batch].transpose(0, 1)[:, :, :length],
        )

    def __enter__(self) -> BatchView:
        return self

    def __exit__(self, kind: type[BaseException] | None, *args: object) -> None:
        if kind is not None:  # the forward failed part way
            self._distrust()

    def _distrust(self) -> None:
        """No row of the window may be trusted: each is gathered again by its session's next forward."""
        for slot in self.window.slots:
            slot.writer = 0

    def finish(self, logits: torch.Tensor) -> list[torch.Tensor | None]:
        """The forward succeeded with `logits` [B, kept, vocab] (rows in window order): its full blocks
        become reusable, the window holds its tokens, and each row's last num_logits logits come back in
        the order the rows were given (None where it wants none)."""
        self.store.commit(self.rows)  # a tree row's tokens are dropped, but for the chain it keeps
        self.window.valid = [row.start + (row.kept if row.parents else len(row.token_ids)) for row in self.rows]
        given: list[torch.Tensor | None] = [None] * len(self.rows)
        for index, row_logits in zip(self.order, split_logits(logits, self.rows), strict=True):
            given[index] = row_logits
        return given

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_length
