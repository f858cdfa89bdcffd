"""``FAMILY/megatron`` (megatron-core GPTModel) and ``FAMILY/transformers``: the same checkpoint, the same HF names
and tensors, the same logits, and the same training step under the torch trainer; ``--dsv4-impl`` resolves in the
same registry: ``deepseek_v4/transformers`` (the core's) and ``deepseek_v4/miles`` (this plugin's), anything else an
error listing what is installed (tests/megatron/test_deepseek_v4.py compares the two)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from miles_core.builtin.core_plugin import check_model_implementation
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import RolloutSection, TrainSection
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from tests.conftest import run_miles
from tests.megatron.test_megatron_trainer import VOCAB, perturbed_checkpoint, training_batch
from tests.numerics import assert_same_sgd_step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def registries():
    return MilesPluginManager.load().registries


MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
CHECKPOINTS = {
    "qwen3-qk-norm": ("qwen3", {"tie_word_embeddings": False, "head_dim": 24}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-qkv-bias": ("qwen2", {"tie_word_embeddings": False}),
    # both export every expert under its checkpoint name (transformers holds them fused in memory)
    "qwen3-moe": (
        "qwen3_moe",
        {"tie_word_embeddings": False, "head_dim": 16, **MOE},
    ),
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_megatron_and_transformers_implementations_agree(tmp_path: Path, registries, name: str) -> None:
    family, overrides = CHECKPOINTS[name]
    checkpoint = perturbed_checkpoint(tmp_path / name, family, **overrides)
    reference = check_model_implementation(registries, family, "transformers").load().from_pretrained(checkpoint)
    megatron = check_model_implementation(registries, family, "megatron").load().from_pretrained(checkpoint)
    assert type(megatron).__name__ == "MegatronCausalLM"
    expected, actual = reference.hf_state_dict(), megatron.hf_state_dict()
    assert sorted(actual) == sorted(expected)  # the checkpoint naming contract
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (megatron(input_ids) - reference(input_ids)).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_torch_trainer_steps_equally_with_either_implementation(tmp_path: Path, registries, family: str) -> None:
    """``--model-impl FAMILY=transformers`` and ``=megatron`` under the torch trainer: the same step."""
    overrides = MOE if family == "qwen3_moe" else {}
    checkpoint = perturbed_checkpoint(tmp_path / family, family, tie_word_embeddings=False, head_dim=24, **overrides)
    settings = TrainSection(lr=0.1, micro_batch_size=3, kl_coef=0.05, optimizer="sgd")  # linear in the gradient
    config = types.SimpleNamespace(
        train=settings,
        run=types.SimpleNamespace(seed=0, schedule="sync"),
        rollout=RolloutSection(),
        model=types.SimpleNamespace(implementations={}, path=str(checkpoint)),
    )
    results, initial = {}, None
    for impl in ("transformers", "megatron"):
        config.model.implementations = {family: impl}
        trainer = TorchTrainer.for_run(
            config,
            model_path=checkpoint,
            initial_model_path=checkpoint,
            run_dir=tmp_path,
            token="",
            registries=registries,
        )
        assert trainer.implementation == f"{family}/{impl}"
        initial = initial or {n: t.clone() for bucket in trainer.weight_iterator(1 << 20) for n, t in bucket}
        metrics = trainer.train_step(training_batch())
        weights = {n: t.clone() for bucket in trainer.weight_iterator(1 << 20) for n, t in bucket}
        results[impl] = metrics, weights
    (metrics, weights), (other_metrics, other_weights) = results["transformers"], results["megatron"]
    assert other_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert_same_sgd_step(initial, weights, other_weights)


def test_dsv4_impl_is_an_explicit_error_listing_what_is_installed(registries) -> None:
    with pytest.raises(ConfigError) as error:
        check_model_implementation(registries, "deepseek_v4", "megatron")
    message = str(error.value)
    assert "(--dsv4-impl megatron)" in message and "installed for deepseek_v4: miles, transformers;" in message
    assert "deepseek_v4/miles" in message and "*/transformers" in message
    result = run_miles("config", "show", "--dsv4-impl", "megatron")
    assert result.returncode != 0 and "installed for deepseek_v4: miles, transformers;" in result.stderr
    for flags in (["--dsv4-impl", "miles"], ["--dsv4-impl", "transformers"], ["--model-impl", "deepseek_v4=miles"]):
        result = run_miles("config", "show", "--json", *flags)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout)["model"]["implementations"] == {"deepseek_v4": flags[1].split("=")[-1]}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--dsv4-impl", "transformers"],
            "the megatron trainer trains DeepSeek-V4 with --dsv4-impl miles (tensor and expert parallel); "
            "'transformers' is for --trainer torch",
        ),
        (["--train-routing-replay", "true"], "train.routing_replay is on (its hash and top-k routers record no"),
    ],
    ids=["transformers-under-megatron", "routing-replay"],
)
def test_dsv4_combinations_the_megatron_trainer_cannot_train_are_refused(tmp_path: Path, flags, message) -> None:
    from miles_core.testkit.tiny_models import save_tiny_deepseek_v4

    checkpoint = save_tiny_deepseek_v4(tmp_path / "dsv4")
    result = run_miles("config", "show", "--model", str(checkpoint), "--trainer", "megatron", *flags)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_miles_plugins_lists_the_megatron_plugin() -> None:
    result = run_miles("plugins")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "megatron" in line]
    assert any("miles-plugins-megatron" in line for line in lines), result.stdout
    for provided in (
        "qwen3/megatron",
        "llama/megatron",
        "qwen2/megatron",
        "qwen3_moe/megatron",
        "deepseek_v4/miles",
        "deepseek_v4/transformers",
    ):
        assert provided in result.stdout


@pytest.mark.parametrize("trainer", ["torch", "megatron"])
def test_model_impl_chooses_the_qwen3_moe_implementation_per_trainer(tmp_path: Path, registries, trainer) -> None:
    """``--model-impl qwen3_moe=transformers`` is for the torch trainer, ``=megatron`` for either (the megatron
    trainer trains nothing else): a choice the trainer cannot train is refused, naming the flag to use."""
    checkpoint = perturbed_checkpoint(tmp_path / "moe", "qwen3_moe", head_dim=16, **MOE)
    for impl in ("transformers", "megatron"):
        flags = ["--model", str(checkpoint), "--trainer", trainer, "--model-impl", f"qwen3_moe={impl}"]
        result = run_miles("config", "show", "--json", *flags)
        if trainer == "megatron" and impl == "transformers":
            assert result.returncode != 0
            assert "the megatron trainer trains megatron-core GPTModel ranks (--model-impl qwen3_moe=megatron)" in (
                result.stderr
            )
        else:
            assert result.returncode == 0, result.stderr[-2000:]
            assert json.loads(result.stdout)["model"]["implementations"] == {"qwen3_moe": impl}
