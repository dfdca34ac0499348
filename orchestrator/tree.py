"""Accept/reject over a token tree: a pure function, tensors in, tokens out (docs/design.md, "Token trees").

A tree of N drafted nodes grows from the committed sequence's end (the root). Node i holds a token,
its parent (-1: the root) and, among its siblings, its place in the order the draft drew them.
Rows are indexed root first: row 0 is the root's, row i + 1 node i's. The target scored every row
(p); under sampling the draft's rows (q) are the distributions children were drawn from.

Walk from the root. At a node, test its children in their drawing order against the residual r
(first p at that node): child c with proposal q_i is kept with probability min(1, r(c) / q_i(c)); on
a rejection r becomes norm(max(0, r - q_i)). A kept child is the next node. When every child is
rejected, the last token comes from r; at a leaf, from p there (the bonus token). Each step is
standard speculative sampling from r with a proposal drawn from q_i, so what is emitted at a node
follows r, and by induction from the last child back to the first, p (the proof sketch is in
docs/design.md). The rules differ only in how the draft draws a node's children and so in q_i:

- `SAMPLED_IID` (SpecInfer's multi-step speculative sampling): children drawn independently from q;
  q_i = q.
- `WITHOUT_REPLACEMENT` (recursive rejection sampling): children drawn from q without replacement
  (a Gumbel top-k order); q_i = q without the earlier siblings, renormalised.
- `TOP_RANKS` (deterministic candidates): children are q's likeliest tokens, in rank order; q_i is a
  point mass at the child, so it is kept with probability r(c) and a rejection removes c from r. It
  needs p alone.
- `SAMPLED_THEN_TOP`: the first child drawn from q as a chain's token is (q_1 = q), the later ones
  q's likeliest other tokens in rank order (point masses).

Greedy follows the target's argmax through the tree. Which children a node has may depend on the
draft's values, never on the target's, and a node's children must be a prefix of its drawing order:
whether a child is drawn may not depend on that child's own token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orchestrator.rejection import residual_distribution
from serving.logits import sample_index
from serving.trees import DraftTree, TreeRule


@dataclass(frozen=True)
class TreeVerdict:
    """What one tree round commits: the accepted path's tokens and one more."""

    output_token_ids: list[int]  # len = len(path) + 1
    path: list[int]  # the accepted nodes, root's child first
    num_nodes: int

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: DraftTree, target_argmax: Sequence[int]) -> TreeVerdict:
    """Greedy: from the root, step to the child whose token is the target's argmax there (the first
    such, should siblings repeat a token); the argmax where no child matches ends the round.
    target_argmax: [N + 1], row 0 the root's."""
    node, path = -1, list[int]()
    while True:
        token = int(target_argmax[node + 1])
        child = next((c for c in tree.children(node) if tree.token_ids[c] == token), None)
        if child is None:
            return TreeVerdict([tree.token_ids[n] for n in path] + [token], path, len(tree.token_ids))
        path.append(child)
        node = child


@dataclass(frozen=True)
class SampledTree:
    """One sampled tree round's inputs to accept/reject."""

    tree: DraftTree
    rule: TreeRule
    draft_probs: torch.Tensor  # [N + 1, vocab] float32: q at the root and each node (leaves' rows unused)
    target_probs: torch.Tensor  # [N + 1, vocab] float32: p at the same rows
    uniforms: torch.Tensor  # [N + 1] float64: node i is tested with uniforms[i], the last token uses uniforms[N]


def proposal(rule: TreeRule, draft_row: torch.Tensor, siblings: Sequence[int], rank: int) -> torch.Tensor:
    """q_i: the distribution the child at `rank` was drawn from, given its earlier `siblings`' tokens
    (`siblings[rank]` is its own)."""
    if not rule.sampled(rank):
        return torch.zeros_like(draft_row).index_fill_(0, torch.tensor([siblings[rank]]), 1.0)
    if rule is TreeRule.WITHOUT_REPLACEMENT and rank:
        remaining = draft_row.index_fill(0, torch.tensor(list(siblings[:rank])), 0.0)
        return remaining / remaining.sum()
    return draft_row


def verify_tree_sampled(round_: SampledTree) -> TreeVerdict:
    """Multi-candidate speculative sampling down the tree: the committed tokens follow the target's
    distribution exactly. The definition that any vectorised or wire path is tested against, node by
    node. On a chain (one child per node) it is `verify_sampled`, uniform for uniform."""
    tree, rule, q, p, u = round_.tree, round_.rule, round_.draft_probs, round_.target_probs, round_.uniforms
    last = len(tree.token_ids)
    node, path = -1, list[int]()
    while True:
        children = tree.children(node)
        residual = p[node + 1]
        tokens = [tree.token_ids[c] for c in children]
        kept = None
        for rank, child in enumerate(children):
            q_i = proposal(rule, q[node + 1], tokens, rank)
            r = residual / residual.sum() if rank else residual  # the first test is against p itself
            x = tokens[rank]
            if float(u[child]) * float(q_i[x]) < float(r[x]):  # min(1, r/q_i), in float64 as `first_rejection`
                kept = child
                break
            residual = residual_distribution(r, q_i)
        if kept is None:
            token = int(sample_index(residual, u[last : last + 1]))
            return TreeVerdict([tree.token_ids[n] for n in path] + [token], path, last)
        path.append(kept)
        node = kept
        if not tree.children(node):
            token = int(sample_index(p[node + 1], u[last : last + 1]))
            return TreeVerdict([tree.token_ids[n] for n in path] + [token], path, last)
