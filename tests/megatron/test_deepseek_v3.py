"""DeepSeek-V3 in the Megatron backend on CPU: megatron-core's multi-latent attention and its MoE layers (sigmoid router
with the selection bias, group-limited top-k, scaled renormalised weights, shared experts, dense first layers) give
transformers' logits; the HF export round-trips every tensor bitwise at TP=1 and DP=2 x EP=2; settings megatron-core
would compute differently are refused.

Tolerance of the logit comparisons, 1e-5, derived as tests/megatron/test_moe.py derives its own: both sides compute in
float32 (unit roundoff 6e-8) with different summation orders (attention in another kernel, experts weighted inside the
activation rather than after the down projection). Over two layers of hidden size 64 and logits of magnitude about 3,
such reorderings move a logit by some tens of roundoffs times its size (measured here: below 1.5e-6), so 1e-5 leaves
room for other BLAS kernels while a layout or routing error (a swapped latent split, the selection bias used as a
weight, a missing scaling factor, the rotary pairs not interleaved) moves the logits by 1e-2 or more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.errors import MilesError
from miles_core.training.batch import TrainBatch, TrainSample
from tests.megatron.test_megatron_trainer import launch
from tests.megatron.test_moe import SETTINGS, assert_exported_once_as_on_disk, exported_names_and_tensors
from tests.numerics import assert_same_sgd_step

pytestmark = pytest.mark.slow

VOCAB = 96
TOLERANCE = 1e-5


def dsv3_config(**overrides) -> transformers.PretrainedConfig:
    """A tiny DeepSeek-V3: a dense layer then a MoE layer, hidden 64, 4 heads, latent ranks 24 (query) and 16
    (key/value), head sizes 12 (no RoPE) + 8 (RoPE) and 16 (value); 4 routed experts in 2 groups, each token taking 2
    experts from its best group, one shared expert, routed weights scaled by 2.5."""
    return transformers.AutoConfig.for_model(
        "deepseek_v3",
        **{
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 112,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 24,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 12,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            **overrides,
        },
    )


YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
"""YaRN stretching RoPE 4x beyond 16 positions (the tiny model's 64); transformers' DeepSeek-V3 defaults otherwise."""


def perturbed_dsv3(**overrides) -> transformers.PreTrainedModel:
    """Every weight perturbed (norms, router and its selection bias too), so a swapped latent split or a misplaced
    expert cannot hide; the selection bias strongly enough to change which experts are chosen."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(dsv3_config(**overrides), attn_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.3)
    return model.eval()


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def training_batch() -> TrainBatch:
    """As tests/megatron/test_moe.py: 8 samples of uneven lengths, both advantage signs."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index in range(8):
        prompt = torch.randint(0, VOCAB, (2 + index % 3,), generator=generator).tolist()
        response = torch.randint(0, VOCAB, (3 + index % 2 + 2 * (index >= 4),), generator=generator).tolist()
        rollout_logprobs = (-torch.rand(len(response), generator=generator) * 4 - 2).tolist()
        samples.append(TrainSample(prompt, response, rollout_logprobs, float(index % 3 - 1) or 0.5, 0.0))
    return TrainBatch(samples)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 written by transformers (per-expert tensor names, as on the Hub)."""
    path = tmp_path_factory.mktemp("deepseek_v3")
    perturbed_dsv3().save_pretrained(path)
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
    [
        {},
        {"n_group": 1, "topk_group": 1},
        {"q_lora_rank": None, "num_hidden_layers": 3, "first_k_dense_replace": 2},
        {"rope_parameters": YARN},
        {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 16, "beta_slow": 2}},
    ],
    ids=["group-limited", "one-group", "no-query-latent-two-dense-layers", "yarn", "yarn-mscale-both"],
)
def test_tp1_logits_equal_transformers_and_the_export_round_trips(megatron, tmp_path: Path, overrides) -> None:
    conversion, model_builder, causal_mask = megatron
    reference = perturbed_dsv3(**overrides)
    config = reference.config
    gpt = model_builder.build_gpt_model(config).eval()
    missing, unexpected = gpt.load_state_dict(conversion.hf_to_megatron(reference.state_dict(), config), strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    ids = input_ids()
    with torch.no_grad():
        ours = gpt(input_ids=ids, position_ids=torch.arange(11).expand(2, -1), attention_mask=causal_mask(11))
        expected = reference(ids).logits
    assert (ours - expected).abs().max().item() < TOLERANCE

    reference.save_pretrained(tmp_path)  # transformers' own checkpoint names: per expert, the selection bias
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    exported = conversion.megatron_to_hf({k: v for k, v in gpt.state_dict().items() if "_extra_state" not in k}, config)
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[name], tensor) for name, tensor in on_disk.items())
    assert conversion.hf_to_megatron(on_disk, config).keys() == {
        k for k in gpt.state_dict() if not k.endswith("_extra_state")
    }


def test_the_selection_bias_and_the_group_limit_change_the_routing(megatron) -> None:
    """``e_score_correction_bias`` and the group limit must steer which experts are chosen (both are loaded and matter
    for these weights, so the logit comparisons above test them) without entering the experts' weights (else the
    logits would differ from transformers')."""
    conversion, model_builder, causal_mask = megatron
    reference = perturbed_dsv3()
    state = dict(reference.state_dict())
    ids, positions, mask = input_ids(), torch.arange(11).expand(2, -1), causal_mask(11)

    def logits(config, state) -> torch.Tensor:
        gpt = model_builder.build_gpt_model(config).eval()
        gpt.load_state_dict(conversion.hf_to_megatron(state, config), strict=False)
        with torch.no_grad():
            return gpt(input_ids=ids, position_ids=positions, attention_mask=mask)

    routed = logits(reference.config, state)
    unbiased = logits(reference.config, {**state, "model.layers.1.mlp.gate.e_score_correction_bias": torch.zeros(4)})
    one_group = logits(dsv3_config(n_group=1, topk_group=1), state)
    assert (routed - unbiased).abs().max().item() > 1e-2
    assert (routed - one_group).abs().max().item() > 1e-2


def test_the_one_process_implementation_loads_and_exports_the_checkpoint(megatron, checkpoint: Path) -> None:
    """``deepseek_v3/megatron`` (``MegatronCausalLM``, for ``--trainer torch``): transformers' logits, and its HF state
    the checkpoint's tensors bitwise (the selection bias, a buffer, included)."""
    from miles_plugins_megatron.causal_lm import MegatronCausalLM

    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    ours = MegatronCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        assert (ours(input_ids()) - reference(input_ids()).logits).abs().max().item() < TOLERANCE
    on_disk, exported = load_file(str(checkpoint / "model.safetensors")), ours.hf_state_dict()
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[name], tensor) for name, tensor in on_disk.items())


@pytest.fixture(scope="module")
def transformers_logits(checkpoint: Path) -> torch.Tensor:
    """transformers' logits of the checkpoint on :func:`input_ids` (eager attention)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        return reference(input_ids()).logits


@pytest.fixture(scope="module")
def torch_step(checkpoint: Path):
    """The core torch trainer's step on the checkpoint: its metrics and the updated weights, by checkpoint name."""
    from miles_plugins_megatron.conversion import hf_to_megatron, megatron_to_hf

    trainer = TorchTrainer.from_pretrained(checkpoint, SETTINGS)
    metrics = trainer.train_step(training_batch())
    fused = {name: tensor.clone() for bucket in trainer.weight_iterator(1 << 20) for name, tensor in bucket}
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    return metrics, megatron_to_hf(hf_to_megatron(fused, config), config)


@pytest.mark.parametrize(
    "layout",
    [{}, {"data_parallel": 2, "expert_parallel": 2}, {"tensor_parallel": 2}],
    ids=["tp1-ep1", "dp2-ep2", "tp2-sequence-parallel"],
)
def test_logits_export_and_one_step_equal_transformers_and_the_torch_trainer(
    checkpoint: Path, transformers_logits: torch.Tensor, torch_step, tmp_path: Path, layout: dict
) -> None:
    """One launch per layout. Before training (DP=2 x EP=2: each rank holds two of the four experts; TP=2: half of
    every latent projection, head and expert): the logits are transformers', and the export names every tensor (each
    expert, the shared expert, the selection bias) once, bitwise the checkpoint's. Then one step: loss, KL, entropy
    and the clipped global gradient norm as the torch trainer's; every updated weight within float32 rounding of its
    SGD step (the selection bias, a buffer, unchanged on both sides)."""
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
    bias = {name for name in initial if name.endswith("e_score_correction_bias")}
    assert bias and all(torch.equal(exported[name], initial[name]) for name in bias)
    assert all(torch.equal(weights[name], initial[name]) for name in bias)
    assert_same_sgd_step(*({k: v for k, v in d.items() if k not in bias} for d in (initial, weights, exported)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob false: megatron-core's sigmoid router always renormalises"),
        (
            {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
            r"topk_group=2 of n_group=4 groups with num_experts_per_tok=2: transformers scores a group by its top 2",
        ),
        ({"rope_parameters": {**YARN, "rope_type": "linear"}}, "rope_type 'linear': 'default' and 'yarn' RoPE"),
        ({"rope_parameters": {**YARN, "attention_factor": 1.2}}, "attention_factor \\(1.2\\): megatron-core derives"),
        ({"rope_parameters": {**YARN, "mscale_all_dim": 1.0}}, "mscale_all_dim \\(1.0\\) without mscale"),
        ({"rope_parameters": {**YARN, "truncate": False}}, "truncate false"),
        ({"rope_interleave": False}, "rope_interleave false"),
        ({"attention_bias": True}, "attention_bias true"),
        ({"first_k_dense_replace": 2}, "first_k_dense_replace=2 >= num_hidden_layers=2"),
    ],
    ids=[
        "plain-top-k",
        "group-score",
        "linear-rope",
        "yarn-attention-factor",
        "yarn-mscale-all-dim-alone",
        "yarn-not-truncated",
        "rope-not-interleaved",
        "attention-bias",
        "no-moe-layer",
    ],
)
def test_configs_megatron_would_compute_differently_are_refused(overrides: dict, message: str) -> None:
    from miles_plugins_megatron.conversion import attention_geometry

    with pytest.raises(MilesError, match=message):
        attention_geometry(dsv3_config(**overrides))


def test_tensor_parallel_must_divide_the_latent_ranks() -> None:
    from miles_plugins_megatron.conversion import check_tensor_parallel

    with pytest.raises(MilesError, match=r"tensor parallel size 4 must divide kv_lora_rank \+ qk_rope_head_dim \(22\)"):
        check_tensor_parallel(dsv3_config(kv_lora_rank=14, q_lora_rank=24), 4)
