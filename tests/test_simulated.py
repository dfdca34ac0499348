"""--simulated-device: the roofline's calibration and shape, the flag's refusals, and exactness with the
modeled clock on (it changes timing only)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model_host.config import parse_model_service_config
from model_host.loading import LoadedModel
from model_host.runtime import ModelServer
from model_host.simulated import PROFILES, Kernels, SimulatedForward, hf_decode_kernels, profile_named
from specdec.v1 import orchestrator_pb2
from tests.conftest import collect, hf_greedy
from tests.servers import OrchestratorThread, orchestrator_config, start_draft, start_target
from tests.tiny_models import tiny_llama

# Published: one decode step of Llama 3.1 8B on an H100 SXM, batch 1, 8.4 ms in PyTorch eager and 5.1 ms
# captured as a CUDA graph (docs/design.md, "Modeled device time", for the source).
EAGER_8B_H100_DECODE_S = 8.4e-3
GRAPH_8B_H100_DECODE_S = 5.1e-3
NONE = Kernels(0.0, 0)
EAGER = Kernels(40.0, 10)  # about what the services' forwards launch


def hf_kernels() -> Kernels:
    """Kernels one eager Hugging Face Llama decode step launches (counted on the CPU)."""
    return hf_decode_kernels(tiny_llama(64, seed=0, hidden=64, layers=4))


def test_the_8b_profile_matches_the_published_decode_step_eager_and_graphed() -> None:
    profile = profile_named("h100-llama-3.1-8b")
    eager = profile.seconds([(512, 1)], hf_kernels(), windowed=False)
    graphed = profile.seconds([(512, 1)], NONE, windowed=False)  # a graph's launches are one, not per kernel
    assert eager == pytest.approx(EAGER_8B_H100_DECODE_S, rel=0.25)
    assert graphed == pytest.approx(GRAPH_8B_H100_DECODE_S, rel=0.25)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_each_profile_has_a_gpus_shape(name: str) -> None:
    profile = PROFILES[name]
    decode = profile.seconds([(128, 1)], EAGER)
    # Memory-bound decode: 64 rows cost about what one does at short context.
    assert profile.seconds([(128, 1)] * 64, EAGER) < 1.25 * decode
    # Compute decides a long enough forward: 2,048 tokens cost several decode steps.
    assert profile.seconds([(0, 2048)], EAGER) > 3 * decode
    # Keys and values are read at each row's real context.
    assert profile.seconds([(4000, 1)] * 64, EAGER) > profile.seconds([(100, 1)] * 64, EAGER)
    # The padded width counts: one wide row makes every row of the forward that wide.
    narrow = [(128, 1)] * 63
    assert profile.seconds([*narrow, (128, 512)], EAGER) > profile.seconds([*narrow, (128, 1)], EAGER) * 2


def test_tensor_parallelism_pays_all_reduces_and_divides_the_roofline() -> None:
    profile = profile_named("4xh100-llama-3.3-70b")
    single = type(profile)(profile.name, type(profile.gpu)("1x", 3.35e12, 989e12), profile.shape)
    assert profile.seconds([(128, 1)], NONE) < single.seconds([(128, 1)], NONE) / 2


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--simulated-device", "a100-anything"], "not a profile"),
        (["--simulated-device", "h100-llama-3.1-8b", "--device", "cuda"], "cannot run with --device cuda"),
    ],
)
def test_the_flag_is_refused_naming_what_to_change(argv: list[str], words: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_model_service_config("target_service", ["--model", "m", *argv])
    assert words in capsys.readouterr().err


@pytest.fixture(scope="module")
def simulated(target_model: LoadedModel, close_draft_model: LoadedModel) -> Iterator[tuple[ModelServer, ...]]:
    target = start_target(target_model, simulated_device="h100-llama-3.2-1b")
    draft = start_draft(close_draft_model, simulated_device="h100-llama-3.2-1b")
    yield target, draft
    target.stop()
    draft.stop()


def test_outputs_are_the_targets_with_the_modeled_clock(simulated, target_model, orchestrators):
    target, draft = simulated
    forward = target.servicer.engine.forward
    assert isinstance(forward, SimulatedForward)
    info = target.servicer.model_info()
    assert info.simulated_device.profile == "h100-llama-3.2-1b"
    assert info.simulated_device.kernels_per_layer > 10
    # The lean draft never calls the layers' modules: its kernels are spread over its layers.
    assert draft.servicer.model_info().simulated_device.kernels_per_layer > 10
    # The cost curve is the model's, out to the largest verify of the largest batch.
    config = target.servicer.config
    assert info.forward_costs[-1].batch_tokens == config.max_batch_size * (config.max_speculative_tokens + 1)
    orchestrator = OrchestratorThread(orchestrator_config(target, draft))
    try:
        for prompt in ([5, 6, 7], [11, 12], [40, 41, 42, 43]):
            for k in (0, 4):
                request = orchestrator_pb2.GenerateRequest(
                    token_ids=orchestrator_pb2.TokenIds(ids=prompt),
                    max_new_tokens=16,
                    num_speculative_tokens=k,
                    speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
                )
                got, _, last = collect(orchestrator.stub, request)
                assert got == hf_greedy(target_model, prompt, 16)
                # Each target forward took at least its modeled time: a decode step's is about 3 ms.
                assert last.stats.target_seconds >= 0.002 * last.stats.rounds
        # Sampled, a seed gives the same tokens with and without the modeled clock (timing only changes).
        for seed in range(3):
            request = orchestrator_pb2.GenerateRequest(
                token_ids=orchestrator_pb2.TokenIds(ids=[5, 6, 7]),
                max_new_tokens=16,
                temperature=1.0,
                seed=seed,
                num_speculative_tokens=4,
                speculation_policy=orchestrator_pb2.SPECULATION_POLICY_FIXED,
            )
            assert collect(orchestrator.stub, request)[0] == collect(orchestrators["close"].stub, request)[0]
    finally:
        orchestrator.stop()
    assert forward._forwards._value.get() > 0
