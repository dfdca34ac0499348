"""Slot numbers for an engine's sessions and fork branches, leased and given back."""

from __future__ import annotations

import heapq
import threading


class SlotAllocator:
    """Slot numbers for sessions: the lowest free one first, so a batch's slots tend to be contiguous.

    A released slot is reused only after the engine's current iteration (a forward may still be
    writing to it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._released: list[int] = []
        self._leased: set[int] = set()
        self._next = 0

    def lease(self) -> int:
        with self._lock:
            if self._free:
                slot = heapq.heappop(self._free)
            else:
                slot, self._next = self._next, self._next + 1
            self._leased.add(slot)
            return slot

    def release(self, slot: int) -> None:
        """Give the slot back; a slot released twice (a branch its owner also ends) is given back once,
        so that two sessions can never be leased the same slot."""
        with self._lock:
            if slot in self._leased:
                self._leased.remove(slot)
                self._released.append(slot)

    def holds(self, slot: int) -> bool:
        """Whether a session or branch holds the slot now."""
        with self._lock:
            return slot in self._leased

    def released(self) -> bool:
        """Whether slots were released since the last `recycle`."""
        with self._lock:
            return bool(self._released)

    def leased(self) -> int:
        """Slots that sessions hold now."""
        with self._lock:
            return len(self._leased)

    def recycle(self) -> list[int]:
        """Make released slots leasable again; returns them."""
        with self._lock:
            released, self._released = self._released, []
            for slot in released:
                heapq.heappush(self._free, slot)
            return released
