"""How the draft grows a token tree within a verify budget (docs/design.md, "Token trees").

Best first (EAGLE-2's dynamic trees): the next node is the frontier's best, where the frontier holds
each node's next child in its drawing order, scored by its parent's path value times the child's
chance of being kept. With a `Calibration` (what the bench and the tests use) that chance is learnt
from verdicts, by rank and by the node's confidence: the default pair's draft is underconfident, and
scoring by its raw probabilities loses to the chain. Without one it is EAGLE-2's: q of the child's
token for a rank of q (greedy, or a point-mass rule), and for a sampled child what its token's q is
expected to be before it is drawn (sum of q^2 over what is left to draw, over the mass left). Either
way, whether a sampled child joins the tree never depends on the token it drew (orchestrator/tree.py).
A node's drawing order is fixed when its row is known, and its children are always a prefix of it.

The builder never sees the target. It asks for the draft's rows only when a node without one could
outrank the frontier: a node's children never score above its own path value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serving.logits import sample_index
from serving.trees import DraftTree, TreeRule


def drawing_order(rule: TreeRule | None, row: torch.Tensor, count: int, generator: torch.Generator) -> list[int]:
    """The first `count` children a node with draft row `row` ([vocab] probabilities) gets, in drawing
    order. `rule` None is greedy: q's ranks."""
    count = min(count, int((row > 0).sum()))
    if rule is None or rule is TreeRule.TOP_RANKS:
        return torch.topk(row, count).indices.tolist()
    uniforms = torch.rand(count, generator=generator, dtype=torch.float64)
    if rule is TreeRule.SAMPLED_IID:
        return [int(sample_index(row, uniforms[i : i + 1])) for i in range(count)]
    if rule is TreeRule.WITHOUT_REPLACEMENT:
        # Gumbel top-k: the order of log q + Gumbel noise is a draw without replacement.
        noise = torch.rand(row.shape, generator=generator, dtype=torch.float64).clamp_min(1e-300)
        keys = row.double().log() - (-noise.log()).log()
        return torch.topk(keys, count).indices.tolist()
    first = int(sample_index(row, uniforms[:1]))  # SAMPLED_THEN_TOP
    rest = torch.topk(row.index_fill(0, torch.tensor([first]), -1.0), count - 1).indices.tolist()
    return [first, *rest][:count]


@dataclass
class _Node:
    confidence: float  # the draft's probability of the path from the root to here
    row: torch.Tensor | None = None  # the draft's distribution here, once known
    order: list[int] = field(default_factory=list)  # children's tokens, in drawing order
    children: int = 0


class Calibration:
    """How often a node's child at each rank is kept once its earlier siblings were rejected, by rank
    and by the node's confidence (its row's largest q, in tenths), learnt from verdicts. A small draft
    is underconfident: on the default pair at greedy, where its top token has q = 0.2-0.3 the target
    agrees 80% of the time, and after that the second rank 90%."""

    BUCKETS = 10

    def __init__(self, ranks: int) -> None:
        self.tested = torch.ones(ranks, self.BUCKETS, dtype=torch.float64)
        self.kept = torch.full((ranks, self.BUCKETS), 0.5, dtype=torch.float64)  # a prior of one test at 0.5

    def _bucket(self, row: torch.Tensor) -> int:
        return min(int(float(row.max()) * self.BUCKETS), self.BUCKETS - 1)

    def rate(self, row: torch.Tensor, rank: int) -> float:
        rank = min(rank, self.tested.shape[0] - 1)
        bucket = self._bucket(row)
        return float(self.kept[rank, bucket] / self.tested[rank, bucket])

    def learn_from_tokens(self, tree: DraftTree, rows: dict[int, torch.Tensor], token_ids: list[int]) -> None:
        """Learn from a greedy verdict told by the tokens it committed: the path follows, from the root,
        the child whose token comes next (the first such, should siblings repeat a token)."""
        node, path = -1, []
        for token in token_ids:
            child = next((c for c in tree.children(node) if tree.token_ids[c] == token), None)
            if child is None:
                break
            path.append(child)
            node = child
        self.learn(tree, rows, path)

    def learn(self, tree: DraftTree, rows: dict[int, torch.Tensor], path: list[int]) -> None:
        """Count the tests a verdict made: at the root and each accepted node, its children up to the one
        kept (all of them when none was)."""
        for node, kept in zip([-1, *path], [*path, None], strict=True):
            children = tree.children(node)
            if not children or node not in rows:
                continue
            bucket = self._bucket(rows[node])
            for rank, child in enumerate(children):
                row_rank = min(rank, self.tested.shape[0] - 1)
                self.tested[row_rank, bucket] += 1
                if child == kept:
                    self.kept[row_rank, bucket] += 1
                    break


class TreeBuilder:
    """Grows one tree of at most `budget` nodes; `width` caps any node's children (1: a chain)."""

    def __init__(
        self,
        rule: TreeRule | None,
        budget: int,
        generator: torch.Generator,
        width: int | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        self.rule, self.budget, self.generator = rule, budget, generator
        self.width = width or budget
        self.calibration = calibration
        self.token_ids: list[int] = []
        self.parents: list[int] = []
        self._nodes: dict[int, _Node] = {-1: _Node(1.0)}

    @property
    def full(self) -> bool:
        return len(self.token_ids) >= self.budget

    def tree(self) -> DraftTree:
        return DraftTree(list(self.token_ids), tuple(self.parents))

    def missing_rows(self) -> list[int]:
        """Nodes (-1: the root) whose draft rows are unknown."""
        return [node for node, state in self._nodes.items() if state.row is None]

    def known(self, node: int, row: torch.Tensor) -> None:
        """The draft's distribution at `node` ([vocab] probabilities)."""
        state = self._nodes[node]
        state.row = row
        state.order = drawing_order(self.rule, row, self.width, self.generator)

    def _score(self, state: _Node) -> float:
        """The path confidence of the next child of a node whose row is known (0: none left)."""
        assert state.row is not None
        rank = state.children
        if rank >= len(state.order):
            return 0.0
        if self.calibration is not None:
            # The chance that the first `rank` children are rejected and this one is kept.
            chance = self.calibration.rate(state.row, rank)
            for earlier in range(rank):
                chance *= 1.0 - self.calibration.rate(state.row, earlier)
            return state.confidence * chance
        if self.rule is None or not self.rule.sampled(rank):
            return state.confidence * float(state.row[state.order[rank]])
        row = state.row.double()
        if self.rule is TreeRule.WITHOUT_REPLACEMENT and rank:
            row = row.index_fill(0, torch.tensor(state.order[:rank]), 0.0)
        left = float(row.sum())
        return state.confidence * float((row * row).sum()) / left if left > 0 else 0.0

    def needs_rows(self) -> bool:
        """Whether a node without a row could outrank the frontier, so that the draft must run first."""
        best = max((self._score(s) for s in self._nodes.values() if s.row is not None), default=0.0)
        return any(s.row is None and s.confidence > best for s in self._nodes.values()) or best <= 0.0

    def rows_wanted(self) -> list[int]:
        """Grow while no draft row is needed; then the nodes (-1: the root) whose rows the draft must
        give before the tree can grow on, or [] when it is done (full, or no node has a child left)."""
        while not self.full:
            missing = self.missing_rows()
            if not (missing and self.needs_rows()) and self.grow():
                continue
            return missing
        return []

    def build(self, draft_rows: Callable[[list[int]], list[torch.Tensor]]) -> DraftTree:
        """Grow to the budget. `draft_rows(nodes)` runs the draft over the tree so far and gives its rows
        at those nodes (-1: the root), in that order: one draft forward."""
        while missing := self.rows_wanted():
            for node, row in zip(missing, draft_rows(missing), strict=True):
                self.known(node, row)
        return self.tree()

    def grow(self) -> bool:
        """Add the frontier's best child; False when no node whose row is known has a child left."""
        scored = [(self._score(s), node) for node, s in self._nodes.items() if s.row is not None]
        score, parent = max(scored, default=(0.0, -1))
        if score <= 0.0 or math.isnan(score):
            return False
        state = self._nodes[parent]
        assert state.row is not None
        token = state.order[state.children]
        state.children += 1
        node = len(self.token_ids)
        self.token_ids.append(token)
        self.parents.append(parent)
        self._nodes[node] = _Node(score if self.calibration is not None else state.confidence * float(state.row[token]))
        return True
