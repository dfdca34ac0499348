"""A row: one session's part of a batched forward, a chain of new tokens or a tree of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One session's part of a batched forward."""

    slot: int
    start: int  # tokens already cached for this session (its valid length after rollback)
    token_ids: list[int]  # the tokens to feed, at cache positions start .. start + len - 1
    num_logits: int  # logits wanted for the last num_logits of token_ids (0: none)
    # A tree row: each token's parent among token_ids (-1: the cached prefix's last token). Its tokens
    # sit at position start + depth and see their ancestors only; they are dropped after the forward,
    # but for its first `kept`, a chain from the cached prefix (what a step appends before its tree),
    # which the session holds from then on.
    parents: tuple[int, ...] = ()
    kept: int = 0

    def __post_init__(self) -> None:
        error = tree_error(self.parents, len(self.token_ids), self.start, self.kept)
        if error:
            raise ValueError(error)

    def depths(self) -> list[int]:
        """Each token's depth below the cached prefix (0: a child of its last token)."""
        if not self.parents:
            return list(range(len(self.token_ids)))
        depths: list[int] = []
        for parent in self.parents:
            depths.append(depths[parent] + 1 if parent >= 0 else 0)
        return depths


def tree_error(parents: tuple[int, ...], count: int, start: int, kept: int = 0) -> str | None:
    """What is wrong with a tree of `count` tokens fed after `start` cached ones (None: nothing, or
    no tree): each token's parent must be an earlier token or -1, a tree grows from a prefix, and its
    first `kept` tokens are a chain from the prefix."""
    if not parents:
        return "kept tokens belong to a tree row: a chain row keeps all of its tokens" if kept else None
    if not 0 <= kept <= count or any(parents[index] != index - 1 for index in range(kept)):
        return "a tree row's kept tokens must be its first tokens, a chain from the cached prefix"
    if len(parents) != count or any(not -1 <= parent < index for index, parent in enumerate(parents)):
        return "a tree row's parents must name an earlier token of the row, or -1, for each token"
    if not start and not kept:
        return "a tree row grows from a cached prefix, or from the chain it keeps: its step must start past token 0"
    return None
