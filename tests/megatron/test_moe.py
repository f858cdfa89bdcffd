"""Qwen3-MoE in the Megatron backend on CPU: megatron-core's MoE layers give transformers' logits, the HF export
round-trips every expert exactly at TP=1, EP=2 and TP=2, and layouts that cannot work are refused up front.

Tolerance of the logit comparisons, 1e-5: both sides compute in float32 (unit roundoff 6e-8) with different
summation orders (fused QKV and gate/up matmuls, experts weighted by their router probability inside the activation
rather than after the down projection, attention in another kernel). Over two layers of hidden size 64 and logits of
magnitude about 3, such reorderings move a logit by some tens of roundoffs times its size: measured 5e-7 to 1.4e-6
here, so 1e-5 leaves room for other BLAS kernels while a routing or layout error (a swapped gate/up, a wrong expert,
the top-k renormalisation missing) moves the logits by 1e-2 or more.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.errors import MilesError
from miles_core.training.batch import TrainBatch, TrainSample
from tests.conftest import run_miles
from tests.megatron.test_megatron_trainer import launch
from tests.numerics import assert_same_sgd_step

pytestmark = pytest.mark.slow

VOCAB = 96
TOLERANCE = 1e-5
SETTINGS = TrainSection(
    backend="megatron",
    optimizer="sgd",
    lr=0.1,
    micro_batch_size=3,
    kl_coef=0.05,
    entropy_coef=0.01,
    max_grad_norm=0.5,
)
"""As tests/megatron/test_megatron_trainer.py: SGD (a step linear in the gradient), clipping active, KL on."""


def moe_config(**overrides) -> transformers.PretrainedConfig:
    """A tiny Qwen3-MoE: 2 layers, hidden 64, 4 experts of which each token takes 2, expert MLPs of 32."""
    return transformers.AutoConfig.for_model(
        "qwen3_moe",
        **{
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 112,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            **overrides,
        },
    )


def perturbed_moe(**overrides) -> transformers.PreTrainedModel:
    """Every weight perturbed (norms and router too), so a swapped gate/up or a misplaced expert cannot hide."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(**overrides), attn_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def training_batch() -> TrainBatch:
    """8 samples of uneven lengths, both advantage signs: micro-batches of 3, 3 and 2 (one data-parallel rank of two
    gets 2 micro-batches of 3 and 1 samples, the other's are longer: expert-parallel ranks must align them)."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index in range(8):
        prompt = torch.randint(0, VOCAB, (2 + index % 3,), generator=generator).tolist()
        response = torch.randint(0, VOCAB, (3 + index % 2 + 2 * (index >= 4),), generator=generator).tolist()
        rollout_logprobs = (-torch.rand(len(response), generator=generator) * 4 - 2).tolist()
        samples.append(TrainSample(prompt, response, rollout_logprobs, float(index % 3 - 1) or 0.5, 0.0))
    return TrainBatch(samples)


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE written by transformers (per-expert tensor names, as on the Hub)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    perturbed_moe(norm_topk_prob=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def megatron():
    """A one-rank gloo world with megatron-core's parallel state (shared with the other in-process tests)."""
    from miles_plugins_megatron.causal_lm import ensure_single_rank_parallel_state
    from miles_plugins_megatron.cpu_compat import causal_mask

    from miles_plugins_megatron import conversion, model

    ensure_single_rank_parallel_state()
    return conversion, model, causal_mask


@pytest.mark.parametrize(
    "overrides",
    [{"norm_topk_prob": True}, {"norm_topk_prob": False}, {"norm_topk_prob": True, "mlp_only_layers": [0]}],
    ids=["renormalised-top-k", "plain-top-k", "dense-first-layer"],
)
def test_tp1_logits_equal_transformers_and_the_export_round_trips(megatron, tmp_path: Path, overrides) -> None:
    conversion, model_builder, causal_mask = megatron
    reference = perturbed_moe(**overrides)
    config = reference.config
    gpt = model_builder.build_gpt_model(config).eval()
    missing, unexpected = gpt.load_state_dict(conversion.hf_to_megatron(reference.state_dict(), config), strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    ids = input_ids()
    with torch.no_grad():
        ours = gpt(input_ids=ids, position_ids=torch.arange(11).expand(2, -1), attention_mask=causal_mask(11))
        expected = reference(ids).logits
    assert (ours - expected).abs().max().item() < TOLERANCE

    reference.save_pretrained(tmp_path)  # transformers' own per-expert checkpoint names
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    exported = conversion.megatron_to_hf({k: v for k, v in gpt.state_dict().items() if "_extra_state" not in k}, config)
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[name], tensor) for name, tensor in on_disk.items())
    assert (
        conversion.hf_to_megatron(on_disk, config).keys()
        == conversion.hf_to_megatron(reference.state_dict(), config).keys()
    )


def exported_names_and_tensors(trainer) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor) for bucket in trainer.weight_iterator(1 << 20) for name, tensor in bucket]


def assert_exported_once_as_on_disk(exported: list[tuple[str, torch.Tensor]], on_disk: dict[str, torch.Tensor]) -> None:
    """The export names every checkpoint tensor once, each bitwise the checkpoint's."""
    names = [name for name, _ in exported]
    assert len(names) == len(set(names)) and sorted(names) == sorted(on_disk)
    assert all(torch.equal(tensor, on_disk[name]) for name, tensor in exported)


@pytest.fixture(scope="module")
def transformers_logits(checkpoint: Path) -> torch.Tensor:
    """transformers' logits of the checkpoint on :func:`input_ids` (eager attention)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        return reference(input_ids()).logits


@pytest.fixture(scope="module")
def torch_step(checkpoint: Path):
    """The core torch trainer's step on the checkpoint: its metrics and the updated weights, by checkpoint name
    (transformers holds the experts fused; the conversion's two directions name them per expert)."""
    from miles_plugins_megatron.conversion import hf_to_megatron, megatron_to_hf

    trainer = TorchTrainer.from_pretrained(checkpoint, SETTINGS)
    metrics = trainer.train_step(training_batch())
    fused = {name: tensor.clone() for bucket in trainer.weight_iterator(1 << 20) for name, tensor in bucket}
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    return metrics, megatron_to_hf(hf_to_megatron(fused, config), config)


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"data_parallel": 2, "expert_parallel": 2},
        {"tensor_parallel": 2},
        {"tensor_parallel": 2, "data_parallel": 2, "expert_parallel": 2},
    ],
    ids=["tp1-ep1", "dp2-ep2", "tp2-sequence-parallel", "tp2-dp2-ep2"],
)
def test_logits_export_and_one_step_equal_transformers_and_the_torch_trainer(
    checkpoint: Path, transformers_logits: torch.Tensor, torch_step, tmp_path: Path, layout: dict
) -> None:
    """One launch per layout. Before training: the logits are transformers', and the export names every expert
    once, bitwise the checkpoint's (DP=2 x EP=2: each rank holds two of the four experts; TP=2: half of every
    expert). Then one step: loss, KL, entropy and the clipped global gradient norm (each expert counted once) as the
    torch trainer's; every updated weight, each expert under its HF name, within float32 rounding of its SGD step."""
    metrics, weights = torch_step
    initial = load_file(str(checkpoint / "model.safetensors"))
    with launch(checkpoint, tmp_path, train=SETTINGS, **layout) as trainer:
        logits = trainer.logits(input_ids())
        before = [(name, tensor.clone()) for name, tensor in exported_names_and_tensors(trainer)]
        step_metrics = trainer.train_step(training_batch())
        exported = dict(exported_names_and_tensors(trainer))
    assert (logits - transformers_logits).abs().max().item() < TOLERANCE
    assert_exported_once_as_on_disk(before, initial)
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_fraction"):
        assert step_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    assert_same_sgd_step(initial, weights, exported)


class _NeverCalled:
    def __call__(self):
        raise AssertionError("a rank was about to start")


@pytest.mark.parametrize("case", ["experts", "dense-model", "data-parallel"])
def test_bad_expert_layouts_are_refused_before_any_rank_starts(checkpoint: Path, tmp_path: Path, case: str) -> None:
    from miles_plugins_megatron.config import MegatronSection
    from miles_plugins_megatron.trainer import MegatronTrainer

    path, layout = checkpoint, MegatronSection(data_parallel=3, expert_parallel=3)
    expected = r"expert parallel size 3 must divide the experts \(4\) of this qwen3_moe model"
    if case == "dense-model":
        path, layout = tmp_path / "qwen3", MegatronSection(data_parallel=2, expert_parallel=2)
        dense = transformers.AutoConfig.for_model(
            "qwen3",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=112,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        transformers.AutoModelForCausalLM.from_config(dense).save_pretrained(path)
        expected = r"expert parallel size 2: this qwen3 model has no experts to split; use --megatron-expert-parallel 1"
    elif case == "data-parallel":
        with pytest.raises(ValueError, match=r"expert_parallel \(--megatron-expert-parallel 2\) must divide data_p"):
            MegatronSection(data_parallel=3, expert_parallel=2)
        path, layout = checkpoint, MegatronSection.model_construct(data_parallel=1, expert_parallel=2)
        expected = r"expert parallel size 2 must divide the data-parallel size \(1\)"
    with pytest.raises(MilesError, match=expected):
        MegatronTrainer.launch(path, train=SETTINGS, layout=layout, seed=0, provider_factory=_NeverCalled())


def test_the_cli_refuses_expert_parallelism_outside_data_parallelism(tmp_path: Path) -> None:
    result = run_miles(
        "train", "--trainer", "megatron", "--megatron-expert-parallel", "2", "--output-dir", str(tmp_path)
    )
    assert result.returncode != 0
    assert "expert_parallel (--megatron-expert-parallel 2) must divide data_parallel" in result.stderr


def test_per_expert_names_load_into_transformers_fused_experts() -> None:
    """The core's engines hold transformers' fused experts; the Megatron export names each expert apart (as
    checkpoints and SGLang do): each per-expert tensor lands in its slice, and a wrong one is refused whole."""
    from miles_core.engines.weights import WeightLoadError, load_named_tensors

    source, target = perturbed_moe(), transformers.AutoModelForCausalLM.from_config(moe_config())
    named = checkpoint_tensors(source)
    load_named_tensors(target, named)
    assert all(
        torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    )
    for bad, message in (
        ({"model.layers.0.mlp.experts.4.gate_proj.weight": torch.zeros(32, 64)}, "not a weight of this model"),
        (
            {"model.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(64, 64)},
            r"shape \(64, 64\), model has \(32, 64\)",
        ),
    ):
        with pytest.raises(WeightLoadError, match=message):
            load_named_tensors(target, bad)


def checkpoint_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names, as transformers writes them."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return load_file(str(Path(directory) / "model.safetensors"))
