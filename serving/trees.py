"""A token tree's shape, and the rules that say how its children were drawn: shared by the draft that
grows a tree (draft_service/tree.py) and the accept/reject step that walks it (orchestrator/tree.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TreeRule(enum.Enum):
    SAMPLED_IID = "sampled_iid"
    WITHOUT_REPLACEMENT = "without_replacement"
    TOP_RANKS = "top_ranks"
    SAMPLED_THEN_TOP = "sampled_then_top"

    def sampled(self, rank: int) -> bool:
        """Whether the child at `rank` (0: the first drawn) was sampled from a row of q (otherwise it
        is a point mass: a rank of q, fixed by the draft's values alone)."""
        return self in (TreeRule.SAMPLED_IID, TreeRule.WITHOUT_REPLACEMENT) or (
            self is TreeRule.SAMPLED_THEN_TOP and rank == 0
        )


@dataclass(frozen=True)
class DraftTree:
    """N drafted nodes. A node's children are the later nodes that name it, in drawing order."""

    token_ids: list[int]  # [N]
    parents: tuple[int, ...]  # [N]: each node's parent node, -1 for the root; always an earlier node

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.token_ids) or any(
            not -1 <= parent < node for node, parent in enumerate(self.parents)
        ):
            raise ValueError("a tree's parents must name an earlier node, or -1 for the root, for each node")

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1: the root), in drawing order."""
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
