"""Accept/reject over token trees (orchestrator/tree.py) and how the draft grows them (draft_service/tree.py).

- On a chain, every sampled rule is `verify_sampled`, uniform for uniform.
- Greedy follows the target's argmax through the tree.
- Each rule keeps the target's distribution: the joint law of two tokens from bigram tables, through
  trees that branch at the root and below it (chi-square), also with trees the builder grows.
- Planted bugs are caught by the same test: a proposal that forgets the earlier siblings, children
  reranked after they were drawn, and a node's row that saw a sibling (a leaking tree mask).
- Greedy identity with the target alone through tree rows of the services' batched forward, at verify
  budgets of 8 and 16.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from scipy import stats

import orchestrator.tree as tree_module
from bench.tree import Model, generate
from draft_service.tree import Calibration, TreeBuilder, drawing_order
from model_host.loading import LoadedModel
from orchestrator.rejection import SampledRound, verify_sampled
from orchestrator.tree import SampledTree, verify_tree_greedy, verify_tree_sampled
from serving.sampling import SamplingParams
from serving.trees import DraftTree, TreeRule
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, orchestrator_pb2, target_pb2, target_pb2_grpc
from tests.architectures import CONTEXT, FAMILIES, build
from tests.conftest import RawSession, StepFailed, collect, hf_greedy
from tests.servers import LOOPBACK, OrchestratorThread, orchestrator_config, start_draft, start_target

VOCAB = 4
SAMPLES = 4000
SAMPLED_RULES = [rule for rule in TreeRule]


def test_on_a_chain_every_sampled_rule_is_verify_sampled():
    generator = torch.Generator().manual_seed(1)
    for trial in range(300):
        k = 1 + trial % 5
        q = torch.rand(k + 1, 6, generator=generator).pow(3).softmax(-1)
        p = torch.rand(k + 1, 6, generator=generator).pow(3).softmax(-1)
        ids = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(k)]
        uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64)
        want = verify_sampled(SampledRound(torch.tensor(ids), q[:k], p, uniforms))
        chain = DraftTree(ids, tuple(range(-1, k - 1)))
        for rule in (TreeRule.SAMPLED_IID, TreeRule.WITHOUT_REPLACEMENT, TreeRule.SAMPLED_THEN_TOP):
            got = verify_tree_sampled(SampledTree(chain, rule, q, p, uniforms))
            assert got.output_token_ids == want.output_token_ids, (trial, rule)
            assert got.num_accepted == want.num_accepted


def test_greedy_follows_the_targets_argmax_through_the_tree():
    #        root
    #       /    \
    #     5 (0)  7 (1)
    #     |       |  \
    #   6 (2)   8 (3) 9 (4)
    tree = DraftTree([5, 7, 6, 8, 9], (-1, -1, 0, 1, 1))
    # rows: root, then nodes 0..4
    assert verify_tree_greedy(tree, [7, 0, 0, 0, 0, 0]).output_token_ids == [7, 0]  # node 1, then no child is 0
    assert verify_tree_greedy(tree, [7, 0, 9, 0, 0, 3]).output_token_ids == [7, 9, 3]  # the second sibling, a leaf
    assert verify_tree_greedy(tree, [5, 6, 0, 2, 0, 0]).path == [0, 2]
    assert verify_tree_greedy(tree, [4, 6, 0, 2, 0, 0]).output_token_ids == [4]
    with pytest.raises(ValueError, match="parents"):
        DraftTree([1, 2], (0, -1))


Drawer = Callable[[TreeRule, Callable[[int], torch.Tensor], torch.Generator], DraftTree]


def _fixed_shape(
    rule: TreeRule, q_row: Callable[[int], torch.Tensor], generator: torch.Generator, rerank: bool = False
) -> DraftTree:
    """Two children at the root, two under the first and one under the second, drawn by the rule;
    `rerank` (a planted bug) sorts the root's children by q after they were drawn."""
    token_ids = drawing_order(rule, q_row(-1), 2, generator)
    if rerank:
        token_ids.sort(key=lambda token: -float(q_row(-1)[token]))
    parents = [-1] * len(token_ids)
    for parent, count in ((0, 2), (1, 1)):
        if parent < len(parents):
            row = q_row(-2 - token_ids[parent])  # the row after that token (see `_two_tokens`)
            for token in drawing_order(rule, row, count, generator):
                token_ids.append(token)
                parents.append(parent)
    return DraftTree(token_ids, tuple(parents))


def _two_tokens(
    rule: TreeRule,
    p: torch.Tensor,
    q: torch.Tensor,
    draw: Drawer,
    seed: int,
    leak: bool = False,
) -> Counter:
    """The first two tokens after token 0, over SAMPLES requests of tree rounds."""
    generator = torch.Generator().manual_seed(seed)
    seen: Counter = Counter()
    for _ in range(SAMPLES):
        out: list[int] = []
        last = 0
        while len(out) < 2:

            def q_row(node: int, start: int = last) -> torch.Tensor:
                """The draft's row at the root (-1), or after token t (-2 - t)."""
                return q[start if node == -1 else -2 - node]

            tree = draw(rule, q_row, generator)
            tokens = list(tree.token_ids)
            last_tokens = [last, *tokens]  # the token each row follows: the root's, then each node's
            p_rows = p[last_tokens].clone()
            if leak:  # each node's row saw its next sibling's token in place of its own
                for node in range(len(tokens)):
                    sibling = next((s for s in tree.children(tree.parents[node]) if s > node), None)
                    if sibling is not None:
                        p_rows[node + 1] = p[tokens[sibling]]
            q_rows = q[last_tokens]
            uniforms = torch.rand(len(tokens) + 1, generator=generator, dtype=torch.float64)
            verdict = verify_tree_sampled(SampledTree(tree, rule, q_rows, p_rows, uniforms))
            out += verdict.output_token_ids
            last = out[-1]
        seen[tuple(out[:2])] += 1
    return seen


def _pvalue(seen: Counter, p: torch.Tensor) -> float:
    cells = list(itertools.product(range(VOCAB), repeat=2))
    expected = [float(p[0, a] * p[a, b]) * SAMPLES for a, b in cells]
    observed = [seen[cell] for cell in cells]
    kept = [i for i, e in enumerate(expected) if e >= 5]  # chi-square's rule of thumb
    rest_observed = SAMPLES - sum(observed[i] for i in kept)
    rest_expected = SAMPLES - sum(expected[i] for i in kept)
    observed_kept = [observed[i] for i in kept] + [rest_observed]
    expected_kept = [expected[i] for i in kept] + [rest_expected]
    return float(stats.chisquare(observed_kept, expected_kept).pvalue)


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Bigram rows p[last] and q[last], apart enough that rejections and tested siblings are common
    (each planted bug below moves the law by p < 1e-20 at this seed)."""
    generator = torch.Generator().manual_seed(3)
    p = (1.5 * torch.randn(VOCAB, VOCAB, generator=generator)).softmax(-1)
    q = (1.5 * torch.randn(VOCAB, VOCAB, generator=generator)).softmax(-1)
    return p, q


@pytest.mark.parametrize("rule", SAMPLED_RULES, ids=lambda rule: rule.value)
def test_each_rule_keeps_the_targets_distribution_through_branching_trees(rule):
    p, q = _pair()
    assert _pvalue(_two_tokens(rule, p, q, _fixed_shape, seed=11), p) > 0.01


def _grown(rule: TreeRule, q_row: Callable[[int], torch.Tensor], generator: torch.Generator) -> DraftTree:
    """A tree of 4 nodes that the builder grows, calibrated as the draft service would be."""
    builder = TreeBuilder(rule, 4, generator, calibration=_CALIBRATION)
    # The row at a node is the row after its token (-2 - token, in `_two_tokens`' terms).
    return builder.build(lambda nodes: [q_row(-1 if n == -1 else -2 - builder.token_ids[n]) for n in nodes])


_CALIBRATION = Calibration(4)


@pytest.mark.parametrize("rule", [TreeRule.WITHOUT_REPLACEMENT, TreeRule.SAMPLED_THEN_TOP], ids=lambda r: r.value)
def test_trees_the_builder_grows_keep_the_targets_distribution(rule):
    p, q = _pair()
    assert _pvalue(_two_tokens(rule, p, q, _grown, seed=12), p) > 0.01


def _forgets_siblings(rule, draft_row, siblings, rank):
    return draft_row if rule.sampled(rank) else _real_proposal(rule, draft_row, siblings, rank)


_real_proposal = tree_module.proposal


def test_planted_bugs_are_caught(monkeypatch):
    p, q = _pair()
    rule = TreeRule.WITHOUT_REPLACEMENT
    # Reranking the root's children by q after they were drawn.
    assert _pvalue(_two_tokens(rule, p, q, functools.partial(_fixed_shape, rerank=True), seed=13), p) < 1e-4
    # A node's row that saw its sibling (a tree mask leaking between siblings).
    assert _pvalue(_two_tokens(rule, p, q, _fixed_shape, seed=14, leak=True), p) < 1e-4
    # The proposal of a later sibling that forgets the earlier ones (the residual of the wrong q).
    monkeypatch.setattr(tree_module, "proposal", _forgets_siblings)
    assert _pvalue(_two_tokens(rule, p, q, _fixed_shape, seed=15), p) < 1e-4


@pytest.mark.parametrize("budget", [8, 16])
def test_greedy_trees_through_the_batched_forward_equal_the_target_alone(budget):
    """Tree rows of the services' batched forward, grown by the builder and verified greedily, commit
    the target's own greedy tokens."""
    target_model, draft_model = build(FAMILIES["llama"])
    target, draft = Model(target_model, CONTEXT), Model(draft_model, CONTEXT)
    prompt = list(range(3, 19))
    with torch.inference_mode():
        want = target_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
    calibration = Calibration(budget)
    for calibrated in (None, calibration):
        output, counts = generate(
            target,
            draft,
            prompt,
            24,
            SamplingParams(temperature=0.0),
            functools.partial(TreeBuilder, None, budget, calibration=calibrated),
            seed=0,
        )
        assert output[:24] == want.tolist()
        assert counts.rounds < 24


# --- through the services: draft and target tree steps, the orchestrator's tree rounds ---------------


@pytest.fixture(scope="module")
def tree_stack(target_model: LoadedModel, close_draft_model: LoadedModel):
    target, draft = start_target(target_model), start_draft(close_draft_model)
    orchestrator = OrchestratorThread(orchestrator_config(target, draft, speculation_tree="auto"))
    yield orchestrator, draft, target
    orchestrator.stop()
    draft.stop()
    target.stop()


@pytest.mark.parametrize("k", [8, 16])
def test_greedy_tree_rounds_through_the_services_equal_the_target_alone(tree_stack, target_model, k):
    """Requests with trees and requests with chains at once, batched together in both services: every
    output is the target's own greedy one, and the trees were drafted and learnt from."""
    orchestrator, draft, _ = tree_stack
    calibration = draft.servicer.tree_calibration
    tested = float(calibration.tested.sum())
    prompts = [[5, 6, 7], [40, 41, 2, 9], [17, 3, 3, 3, 80], [90, 1]]

    def generate(job: tuple[list[int], bool]) -> list[int]:
        prompt, tree = job
        request = orchestrator_pb2.GenerateRequest(
            token_ids=orchestrator_pb2.TokenIds(ids=prompt),
            max_new_tokens=40,
            num_speculative_tokens=k,
            speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
            speculation_tree=tree,
        )
        ids, _, last = collect(orchestrator.stub, request)
        assert last.stats.draft_fallback_rounds == 0
        return ids

    jobs = [(prompt, tree) for prompt in prompts for tree in (True, False)]
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(generate, jobs))
    for (prompt, _), ids in zip(jobs, outputs, strict=True):
        assert ids == hf_greedy(target_model, prompt, 40), prompt
    assert float(calibration.tested.sum()) > tested  # tree verdicts came back and were learnt


def test_a_tree_step_a_service_does_not_serve_is_refused_by_name(tree_stack):
    """A sampled request asking for trees runs chains (nothing refused); a tree step with what a tree
    step does not carry yet fails that step with a message naming the field."""
    orchestrator, draft, target = tree_stack
    request = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=[5, 6, 7]),
        max_new_tokens=12,
        num_speculative_tokens=4,
        speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
        speculation_tree=True,
        temperature=0.8,
        seed=3,
    )
    ids, _, last = collect(orchestrator.stub, request)
    assert len(ids) == 12 and last.stats.draft_fallback_rounds == 0
    with grpc.insecure_channel(f"{LOOPBACK}:{target.port}") as channel:
        session = RawSession(target_pb2_grpc.TargetServiceStub(channel).Verify)
        bad = target_pb2.VerifyRequest(
            keep=0, append_token_ids=[5, 6, 7, 8], num_rows=3, tree_parents=[-1, 0], logprobs=True
        )
        with pytest.raises(StepFailed, match="a tree step is greedy and plain in this version; drop logprobs"):
            session.step(bad)
    with grpc.insecure_channel(f"{LOOPBACK}:{draft.port}") as channel:
        session = RawSession(draft_pb2_grpc.DraftServiceStub(channel).Draft)
        sampled = draft_pb2.DraftRequest(
            keep=0,
            append_token_ids=[5, 6, 7],
            num_speculative_tokens=4,
            tree_budget=4,
            sampling=common_pb2.SamplingParams(temperature=0.8),
        )
        with pytest.raises(StepFailed, match="drop sampling"):
            session.step(sampled)
