"""`python -m bench.gpu`, the GPU-scale load benchmark: its models are what it says, and the whole script
runs (here on a CPU with `--tiny` shapes; on a GPU with the full ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu
from bench.load import LoadSample, differing_outputs


def test_the_close_draft_is_the_targets_first_layers() -> None:
    models = gpu.build_models(gpu.TINY, 256, late_scale=0.0, device="cpu", dtype=torch.float32)
    target, close, unrelated = models.target, models.close, models.unrelated
    assert len(close.model.layers) == gpu.TINY.draft_layers < len(target.model.layers)
    for name, value in close.state_dict().items():
        assert torch.equal(value, target.state_dict()[name]), name
    ids = torch.tensor([[5, 17, 200, 3, 99, 41]])
    with torch.inference_mode():
        # With the later layers scaled to nothing the two compute the same function.
        torch.testing.assert_close(close(ids).logits, target(ids).logits)
        assert gpu.greedy_agreement(target, close, [[5, 17, 200, 3, 99, 41]]) == 1.0
        assert not torch.equal(unrelated(ids).logits.argmax(-1), target(ids).logits.argmax(-1))


def test_the_late_scale_is_the_knob_of_agreement() -> None:
    prompts = [
        [int(t) for t in torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(i))] for i in (1, 2)
    ]
    agreements = []
    for scale in (0.0, 1.0):
        models = gpu.build_models(gpu.TINY, 256, late_scale=scale, device="cpu", dtype=torch.float32)
        agreements.append(gpu.greedy_agreement(models.target, models.close, prompts))
    assert agreements[0] == 1.0 > agreements[1]


def test_the_full_shapes_are_about_1b_and_100m() -> None:
    with torch.device("meta"):
        config = gpu._config(4096, gpu.FULL.hidden, gpu.FULL.layers, gpu.FULL.intermediate, gpu.FULL.heads, 4)
        target = gpu.LlamaForCausalLM(config)
        draft = gpu.LlamaForCausalLM(
            gpu.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": gpu.FULL.draft_layers})
        )
    assert 0.9e9 < gpu.parameters(target) < 1.2e9
    assert 0.07e9 < gpu.parameters(draft) < 0.15e9


def test_differing_outputs_counts_requests_against_the_same_stacks_baseline() -> None:
    def sample(config: str, outputs: list[list[int]]) -> LoadSample:
        return LoadSample(config, 2, 0, sum(map(len, outputs)), 1.0, token_ids=outputs)

    samples = [
        sample(gpu.TARGET_ALONE.name, [[1, 2], [3, 4]]),
        sample(gpu.CLOSE_CONFIGS[1].name, [[3, 4], [1, 2]]),  # the same outputs in another order
        sample(gpu.CLOSE_CONFIGS[2].name, [[1, 2], [3, 5]]),
        sample(gpu.SECOND_BASELINE, [[1, 2], [3, 5]]),
        sample(gpu.UNRELATED.name, [[1, 2], [3, 5]]),
    ]
    assert differing_outputs(samples, gpu.BASELINES) == 1


@pytest.mark.slow
def test_the_script_runs_end_to_end_with_tiny_shapes(tmp_path: Path) -> None:
    assert (
        gpu.main(["--tiny", "--device", "cpu", "--concurrency", "1,2", "--max-new-tokens", "6", "--out", str(tmp_path)])
        == 0
    )
    (result,) = tmp_path.glob("gpu-*.json")
    report = json.loads(result.read_text())
    configs = {c.name for c in [*gpu.CLOSE_CONFIGS, gpu.UNRELATED, gpu.HF_BATCH]} | {gpu.SECOND_BASELINE}
    assert {(r["config"], r["concurrency"]) for r in report["rows"]} == {(c, n) for c in configs for n in (1, 2)}
    assert all(r["tokens_per_second"] > 0 for r in report["rows"])
    assert report["forward_costs"] and all(seconds > 0 for _, seconds in report["forward_costs"])
    assert report["meta"]["parameters"]["target"] > report["meta"]["parameters"]["close"]
    reading = {(cell["rows"], cell["alternatives"]) for cell in report["row_reading"]}
    assert reading == {(rows, alternatives) for rows in (1, 8, 64) for alternatives in (0, 2)}
    assert all(cell["alone"] > 0 and cell["together"] > 0 for cell in report["row_reading"])
    drafted = [r for r in report["rows"] if r["config"] == gpu.CLOSE_CONFIGS[2].name]
    assert all(r["draft_tokens_per_output_token"] > 0 for r in drafted)  # fixed K = 2 did speculate


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: on a GPU host (make gpu-bench prints it too)")
def test_an_answer_does_not_wait_for_the_next_forward() -> None:
    # The control: on the default stream the read waits for the forward queued after the logits.
    assert gpu.answer_waits_for_next_forward("cuda", answering=False)
    assert not gpu.answer_waits_for_next_forward("cuda")
