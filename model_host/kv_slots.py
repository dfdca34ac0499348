"""Keys and values of every session on a model service, resident between forward passes.

Each session owns a slot: per layer, `keys[layer][slot]` and `values[layer][slot]` hold its cached
tokens at positions [0, length). A batched forward feeds several sessions at once, each from its own
length (`start`), so rollback is only a smaller `start` next time: nothing is copied or freed.

Rows are right-aligned in a step of width T: row i's T_i new tokens sit at input positions
T - T_i .. T - 1, so every row's last token is at T - 1 and the logits wanted are always the last
few positions. Input position t of row i is cache position start_i + t - (T - T_i). Padding positions
(t < T - T_i) write into the scratch column (the slot's last), which no query ever sees, and their
queries see only position 0, so nothing is undefined. A layer's queries see the cached positions its
attention pattern allows (`BatchView.mask`: global, sliding window or chunk; model_host/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_host.attention import GLOBAL, LayerAttention, visible_keys

_INITIAL_SLOTS = 4
_INITIAL_CAPACITY = 256


@dataclass(frozen=True)
class Row:
    """One session's part of a batched forward."""

    slot: int
    start: int  # tokens already cached for this session (its valid length after rollback)
    token_ids: list[int]  # the tokens to feed, at cache positions start .. start + len - 1
    num_logits: int  # logits wanted for the last num_logits of token_ids (0: none)


class SlotStore:
    """Per-layer key and value tensors of shape [slots, kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_capacity: int) -> None:
        self.device = device
        self.dtype = dtype
        self.max_capacity = max_capacity + 1  # one scratch column for padding
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [slots, kv_heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.slots = _INITIAL_SLOTS
        self.capacity = min(_INITIAL_CAPACITY, self.max_capacity)

    def ensure(self, slots: int, capacity: int) -> None:
        """Room for `slots` slots of `capacity` positions (the scratch column included)."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        if capacity > self.max_capacity:
            raise ValueError(f"{capacity - 1} positions exceed the model's context of {self.max_capacity - 1}")
        while self.slots < slots:
            self.slots *= 2
        while self.capacity < capacity:
            self.capacity = min(self.capacity * 2, self.max_capacity)
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown = old.new_zeros((self.slots, old.shape[1], self.capacity, old.shape[3]))
                grown[: old.shape[0], :, : old.shape[2]] = old
                store[layer] = grown

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value tensors, allocated on first use in the shape of `like` [B, H, T, D]."""
        if index not in self.keys:
            # Zeros, not uninitialised memory: a batch reads every row's window up to the longest
            # row, masked positions included, and attention turns a masked NaN into a NaN output
            # (the mask is added to the scores, and a zero weight times a NaN value is NaN).
            shape = (self.slots, like.shape[1], self.capacity, like.shape[3])
            self.keys[index] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values[index] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return self.keys[index], self.values[index]


class BatchView:
    """One forward's window onto the slot store; passed to a Hugging Face model as its `cache`.

    The model calls `update(keys, values, layer)` in every attention layer: the new keys and values are
    written at each row's positions, and the batch's keys and values up to the longest row come back.
    """

    is_compileable = False

    def __init__(self, store: SlotStore, rows: list[Row]) -> None:
        device = store.device
        self.store = store
        self.width = max(len(row.token_ids) for row in rows)  # T
        counts = torch.tensor([len(row.token_ids) for row in rows], device=device)  # [B]
        starts = torch.tensor([row.start for row in rows], device=device)  # [B]
        self.kv_length = max(row.start + len(row.token_ids) for row in rows)  # not from the tensors: no device sync
        store.ensure(max(row.slot for row in rows) + 1, self.kv_length + 1)
        offsets = torch.arange(self.width, device=device)[None] - (self.width - counts)[:, None]  # [B, T]
        self.padding = offsets < 0  # [B, T]
        positions = starts[:, None] + offsets  # [B, T] cache position of each input token
        self.position_ids = positions.clamp_min(0)  # [B, T]
        scratch = store.capacity - 1
        self.write_positions = positions.masked_fill(self.padding, scratch)  # [B, T]
        slots = [row.slot for row in rows]
        self.slots = torch.tensor(slots, device=device)  # [B]
        first = slots[0]
        self.contiguous = slots == list(range(first, first + len(slots)))
        self.first_slot = first
        self._positions = positions  # [B, T]
        self._keys = torch.arange(self.kv_length, device=device)  # [L]
        self._masks: dict[LayerAttention, torch.Tensor] = {}

    def mask(self, layer: LayerAttention = GLOBAL) -> torch.Tensor:
        """[B, 1, T, L] True where a query may attend, for a layer of this pattern (built once per view)."""
        mask = self._masks.get(layer)
        if mask is None:
            visible = visible_keys(layer, self._keys, self._positions)  # [B, T, L]
            visible |= self.padding[:, :, None] & (self._keys == 0)[None, None, :]
            mask = self._masks[layer] = visible[:, None]
        return mask

    def input_ids(self, rows: list[Row]) -> torch.Tensor:
        """[B, T] the rows' tokens, right-aligned (padding is token 0, never seen)."""
        ids = torch.zeros((len(rows), self.width), dtype=torch.long)
        for index, row in enumerate(rows):
            ids[index, self.width - len(row.token_ids) :] = torch.tensor(row.token_ids)
        return ids.to(self.store.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values [B, H, T, D]; the batch's [B, H, kv_length, D]."""
        keys, values = self.store.layer(layer_idx, key_states)
        index = (self.slots[:, None], slice(None), self.write_positions)
        keys[index] = key_states.transpose(1, 2).to(keys.dtype)  # [B, T, H, D] at each row's positions
        values[index] = value_states.transpose(1, 2).to(values.dtype)
        if self.contiguous:
            end = self.first_slot + len(self.slots)
            return keys[self.first_slot : end, :, : self.kv_length], values[self.first_slot : end, :, : self.kv_length]
        return keys[:, :, : self.kv_length].index_select(0, self.slots), values[:, :, : self.kv_length].index_select(
            0, self.slots
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_length
