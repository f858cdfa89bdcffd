"""DeepSeek-V4's two implementations, ``deepseek_v4/transformers`` (the reference) and ``deepseek_v4/miles``
(megatron-core parallel layers), on one tiny checkpoint that names every layer kind (sliding-window, compressed
sparse and heavily compressed attention; hash-routed and top-k routed experts; hyper-connections): the same logits
at TP=1, TP=2 and DP=2 x EP=2, the same HF names and tensors, the same SGD step, checkpoints that load into either,
and explicit errors for what the ``miles`` implementation does not support.

Tolerance of the logit comparisons, 1e-5: both sides compute in float32 (unit roundoff 6e-8). At TP=1 and EP=2 the
``miles`` model performs transformers' operations in transformers' order, and the logits measured equal bitwise; at
TP=2 the heads' outputs, the expert columns and the indexer's head scores are summed across ranks in another order,
which moves a logit (of magnitude about 3, after three layers of hidden size 64) by a few tens of roundoffs times its
size (measured: 3.3e-6). 1e-5 leaves room for other BLAS kernels, while a layout error (a head or expert on the wrong
rank, the rotary pairs not interleaved, a sink or a compressed entry misplaced) moves the logits by 1e-1 or more (see
:func:`test_every_component_moves_the_logits`). The indexer's top-k choice could flip only on scores tied within
that rounding, which random weights make vanishingly unlikely.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.errors import MilesError
from miles_core.models.transformers_impl import TransformersCausalLM
from miles_core.testkit.tiny_models import save_tiny_deepseek_v4
from miles_core.training.batch import TrainBatch, TrainSample
from tests.megatron.test_megatron_trainer import launch
from tests.megatron.test_moe import SETTINGS, assert_exported_once_as_on_disk, exported_names_and_tensors
from tests.numerics import FLOAT32_UNIT_ROUNDOFF, assert_same_sgd_step

pytestmark = pytest.mark.slow

VOCAB = 64
TOLERANCE = 1e-5
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
"""YaRN on the compressed layers' rope (as DeepSeek-V4's own config has it), stretching 8 positions 4x."""


def input_ids() -> torch.Tensor:
    """13 tokens: past the window of 4, six entries of compression 2 (of which the indexer keeps 2 per query) and
    three of compression 4."""
    return torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))


def training_batch() -> TrainBatch:
    """8 samples of 12 tokens (every layer kind compresses), prompts of 4 to 6, both advantage signs.

    One length, so that no trainer pads a sample more than another: the indexer picks its top-k among scores that,
    in a tiny random model, are often exactly tied (each a sum of ReLUs, all zero), and ``torch.topk`` breaks a tie
    differently for rows of different lengths, so transformers' own logits of a token can change with the padding
    after it (seen: 7 tokens padded to 9 or to 12). Both implementations break ties alike for rows alike."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index in range(8):
        prompt = torch.randint(3, VOCAB, (4 + index % 3,), generator=generator).tolist()
        response = torch.randint(3, VOCAB, (8 - index % 3,), generator=generator).tolist()
        rollout_logprobs = (-torch.rand(len(response), generator=generator) * 4 - 2).tolist()
        samples.append(TrainSample(prompt, response, rollout_logprobs, float(index % 3 - 1) or 0.5, 0.0))
    return TrainBatch(samples)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V4 as transformers writes it, every weight perturbed, the hash tables drawn at random."""
    return save_tiny_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4"), scale=0.1)


@pytest.fixture(scope="module")
def one_rank() -> None:
    """A one-rank gloo world with megatron-core's parallel state (shared with the other in-process tests)."""
    from miles_plugins_megatron.causal_lm import ensure_single_rank_parallel_state

    ensure_single_rank_parallel_state()


def miles_lm(path: Path):
    from miles_plugins_megatron.deepseek_v4 import MilesDeepseekV4CausalLM

    return MilesDeepseekV4CausalLM.from_pretrained(path)


@pytest.mark.parametrize("overrides", [{}, {"rope_parameters": YARN}], ids=["plain-rope", "yarn-compressed-rope"])
def test_tp1_logits_equal_transformers_and_the_export_is_the_checkpoint(
    one_rank, tmp_path: Path, overrides: dict
) -> None:
    path = save_tiny_deepseek_v4(tmp_path, scale=0.1, **overrides)
    reference, ours = TransformersCausalLM.from_pretrained(path), miles_lm(path)
    with torch.no_grad():
        difference = (ours(input_ids()) - reference(input_ids())).abs().max().item()
    assert difference < TOLERANCE
    on_disk, exported = load_file(str(path / "model.safetensors")), ours.hf_state_dict()
    assert sorted(exported) == sorted(on_disk) == sorted(reference.hf_state_dict())  # the naming contract
    assert all(torch.equal(exported[name], tensor) for name, tensor in on_disk.items())


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.ffn.gate.tid2eid",  # hash routing
        "model.layers.1.ffn.gate.bias",  # top-k selection bias
        "model.layers.1.attn.indexer.compressor.wkv.weight",  # the lightning indexer's choice
        "model.layers.1.attn.compressor.ape",  # compressed sparse entries
        "model.layers.2.attn.compressor.wgate.weight",  # heavily compressed entries
        "model.layers.2.attn.attn_sink",
        "model.layers.0.hc_ffn_fn",  # hyper-connections
        "model.hc_head.hc_base",
        "model.layers.2.attn.wo_a.weight",  # grouped output projection
    ],
)
def test_every_component_moves_the_logits(one_rank, checkpoint: Path, name: str) -> None:
    """Each kind of tensor matters for these weights and this input, so the comparisons above test it."""
    ours = miles_lm(checkpoint)
    tensor = dict(ours.model.state_dict(keep_vars=True))[name]
    with torch.no_grad():
        before = ours(input_ids())
        if tensor.dtype == torch.long:
            tensor.copy_(tensor.roll(1, dims=0))  # each token takes another token's experts
        else:
            tensor.add_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0)))
        assert (ours(input_ids()) - before).abs().max().item() > 1e-2


@pytest.fixture(scope="module")
def transformers_logits(checkpoint: Path) -> torch.Tensor:
    """transformers' logits of the checkpoint on :func:`input_ids`."""
    with torch.no_grad():
        return TransformersCausalLM.from_pretrained(checkpoint)(input_ids())


@pytest.fixture(scope="module")
def torch_step(checkpoint: Path):
    """The torch trainer's step with ``deepseek_v4/transformers``: its metrics and updated weights."""
    trainer = TorchTrainer.from_pretrained(checkpoint, SETTINGS)
    metrics = trainer.train_step(training_batch())
    return metrics, {name: tensor.clone() for bucket in trainer.weight_iterator(1 << 20) for name, tensor in bucket}


def untrained(initial: dict[str, torch.Tensor], stepped: dict[str, torch.Tensor]) -> set[str]:
    """What the loss does not train: the routers' buffers, and the lightning indexer (its top-k choice passes no
    gradient, in transformers as here)."""
    return {name for name, tensor in initial.items() if torch.equal(stepped[name], tensor)}


def assert_same_step(initial: dict, reference: dict, actual: dict) -> None:
    """As :func:`~tests.numerics.assert_same_sgd_step`; the untrained tensors unchanged on both sides, and those whose
    step is within a hundred roundings of the weight (the hyper-connections' scales, an expert few tokens chose)
    equal within that bound."""
    frozen = untrained(initial, reference)
    assert any(".indexer." in name for name in frozen) and any(name.endswith("tid2eid") for name in frozen)
    assert all(torch.equal(actual[name], initial[name]) for name in frozen)
    tiny = set()
    for name, start in initial.items():
        bound = 100 * 4 * FLOAT32_UNIT_ROUNDOFF * start.abs().max().item()
        if name not in frozen and (reference[name] - start).abs().max().item() <= bound:
            tiny.add(name)
            assert (actual[name] - reference[name]).abs().max().item() <= bound, name
    skip = frozen | tiny
    assert len(skip) < len(initial) / 4, skip
    assert_same_sgd_step(*({k: v for k, v in d.items() if k not in skip} for d in (initial, reference, actual)))


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"tensor_parallel": 2},
        {"data_parallel": 2, "expert_parallel": 2},
        {"tensor_parallel": 2, "data_parallel": 2, "expert_parallel": 2},
    ],
    ids=["tp1", "tp2", "dp2-ep2", "tp2-dp2-ep2"],
)
def test_logits_export_and_one_megatron_step_equal_transformers_and_the_torch_trainers(
    checkpoint: Path, transformers_logits: torch.Tensor, torch_step, tmp_path: Path, layout
) -> None:
    """One launch per layout. Before training (TP=2: each rank holds half of the heads, output groups, indexer heads,
    expert columns and vocabulary; DP=2 x EP=2: two of the four experts; TP=2 x DP=2 x EP=2, four ranks: both): the
    logits are transformers', and the export names every tensor once, bitwise the checkpoint's (gathered shards,
    every expert under its global index). Then one step: loss, KL, entropy and the clipped global gradient norm as
    the torch trainer's with transformers' model; every trained weight within float32 rounding of its SGD step, the
    untrained ones unchanged."""
    metrics, weights = torch_step
    initial = load_file(str(checkpoint / "model.safetensors"))
    with launch(checkpoint, tmp_path, train=SETTINGS, **layout) as trainer:
        assert trainer.implementation == "deepseek_v4/miles"
        logits = trainer.logits(input_ids())
        before = [(name, tensor.clone()) for name, tensor in exported_names_and_tensors(trainer)]
        step_metrics = trainer.train_step(training_batch())
        exported = dict(exported_names_and_tensors(trainer))
    assert (logits - transformers_logits).abs().max().item() < TOLERANCE
    assert_exported_once_as_on_disk(before, initial)
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_fraction"):
        assert step_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    assert_same_step(initial, weights, exported)


def test_the_torch_trainer_steps_equally_with_either_implementation(
    one_rank, checkpoint: Path, torch_step, tmp_path: Path
) -> None:
    from miles_plugins_megatron.deepseek_v4 import MilesDeepseekV4CausalLM

    metrics, weights = torch_step
    model = MilesDeepseekV4CausalLM.from_pretrained(checkpoint)
    reference = MilesDeepseekV4CausalLM.from_pretrained(checkpoint)  # megatron-core's layers cannot be deep-copied
    trainer = TorchTrainer(model, SETTINGS, hf_config=model.hf_config, reference=reference)
    step_metrics = trainer.train_step(training_batch())
    exported = {name: tensor.clone() for bucket in trainer.weight_iterator(1 << 20) for name, tensor in bucket}
    assert step_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert_same_step(load_file(str(checkpoint / "model.safetensors")), weights, exported)


def test_a_checkpoint_saved_by_one_implementation_loads_into_the_other(
    one_rank, checkpoint: Path, tmp_path: Path
) -> None:
    """The Megatron trainer's checkpoint after a step (``deepseek_v4/miles`` at TP=2, one shard file per rank) gives
    its logits in transformers and in the one-process ``miles`` model; transformers' checkpoint (the fixture) loads
    into ``miles`` as the tests above show."""
    saved = tmp_path / "saved"
    with launch(checkpoint, tmp_path, train=SETTINGS, tensor_parallel=2) as trainer:
        trainer.train_step(training_batch())
        trainer.save_checkpoint(saved)
        expected = trainer.logits(input_ids())
    with torch.no_grad():
        reference = TransformersCausalLM.from_pretrained(saved)(input_ids())
        ours = miles_lm(saved)(input_ids())
    assert (reference - expected).abs().max().item() < TOLERANCE
    assert (ours - expected).abs().max().item() < TOLERANCE
    assert (reference - TransformersCausalLM.from_pretrained(checkpoint)(input_ids())).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"tensor_parallel": 3}, r"tensor parallel size 3 does not divide num_attention_heads \(4\), o_groups \(2\)"),
        ({"data_parallel": 3, "expert_parallel": 3}, r"expert parallel size 3 does not divide n_routed_experts \(4\)"),
    ],
    ids=["tp3", "ep3"],
)
def test_layouts_it_does_not_support_are_refused_before_any_rank_starts(
    checkpoint: Path, layout: dict, message: str
) -> None:
    from miles_plugins_megatron.config import MegatronSection
    from miles_plugins_megatron.trainer import checked_hf_config

    with pytest.raises(MilesError, match="deepseek_v4/miles cannot run this model as configured: " + message):
        checked_hf_config(checkpoint, MegatronSection(**layout))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings is true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_configs_it_does_not_support_are_refused(overrides: dict, message: str) -> None:
    from miles_plugins_megatron.deepseek_v4.checks import check_deepseek_v4
    from miles_plugins_megatron.deepseek_v4.parallel import Layout

    from miles_core.testkit.tiny_models import tiny_deepseek_v4_config

    layout = Layout(tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, dtype=torch.float32)
    with pytest.raises(MilesError, match=message):
        check_deepseek_v4(tiny_deepseek_v4_config(**overrides), layout=layout)


@pytest.mark.parametrize("damage", ["missing", "unexpected", "misshapen"])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_tensor(one_rank, checkpoint: Path, damage: str) -> None:
    from miles_plugins_megatron.deepseek_v4 import build_deepseek_v4, load_hf_state

    from miles_core.testkit.tiny_models import tiny_deepseek_v4_config

    state = load_file(str(checkpoint / "model.safetensors"))
    name = "model.layers.1.attn.indexer.wq_b.weight"
    if damage == "missing":
        del state[name]
    elif damage == "unexpected":
        state["model.layers.1.attn.wq_c.weight"] = state[name]
    else:
        state[name] = state[name][:-1]
    model = build_deepseek_v4(tiny_deepseek_v4_config())
    shown = {"missing": f"missing ['{name}']", "unexpected": "unexpected ['model.layers.1.attn.wq_c.weight']"}
    with pytest.raises(MilesError, match=re.escape(shown.get(damage, f"{name} has shape (15, 32)"))):
        load_hf_state(model, state, source="the damaged checkpoint")


@pytest.mark.parametrize("impl", ["transformers", "miles"])
def test_dsv4_impl_chooses_what_the_torch_trainer_trains(one_rank, checkpoint: Path, tmp_path: Path, impl) -> None:
    """``miles train --trainer torch --dsv4-impl NAME`` builds the trainer of that implementation (the model and its
    KL reference), which sends the checkpoint's names and tensors to the engines."""
    from miles_core.plugin_manager import MilesPluginManager
    from tests.test_model_implementations import torch_trainer_for

    flags = ("--dsv4-impl", impl, "--train-kl-coef", "0.05")
    trainer = torch_trainer_for(MilesPluginManager.load(), checkpoint, tmp_path / "run", *flags)
    assert trainer.implementation == f"deepseek_v4/{impl}" and trainer.reference is not None
    sent = dict(name_and_tensor for bucket in trainer.weight_iterator(1 << 20) for name_and_tensor in bucket)
    on_disk = load_file(str(checkpoint / "model.safetensors"))
    assert sorted(sent) == sorted(on_disk) and all(torch.equal(sent[name], on_disk[name]) for name in on_disk)


BFLOAT16_ROUNDOFF = torch.finfo(torch.bfloat16).eps / 2


def bfloat16_logit_error(logits: torch.Tensor, layers: int = 3) -> float:
    """How far a bfloat16 computation's logits may be from float32's: about four rounded products and sums per layer
    (and one more layer for the embedding and head), each a relative ``u = 2**-8`` of the largest logit (as
    :func:`tests.numerics.served_logprob_tolerance` derives it)."""
    return 4 * (layers + 1) * BFLOAT16_ROUNDOFF * max(1.0, logits.abs().max().item())


def test_bfloat16_keeps_transformers_float32_tensors_and_gives_its_logits(one_rank, checkpoint: Path) -> None:
    """Under bfloat16 the tensors transformers keeps in float32 (norms, hyper-connections, sinks, slot and selection
    biases) are float32 here too, name by name, and the logits are transformers' bfloat16 ones: the same operations
    in the same order (measured: bitwise). Allowed: an eighth of the bfloat16 error bound (0.03 here), room for
    another CPU's kernels to round a few products otherwise, while rounding one float32 tensor to bfloat16 (the
    rotary frequencies, measured 0.0625) fails."""
    from miles_plugins_megatron.deepseek_v4 import MilesDeepseekV4CausalLM

    reference = TransformersCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    ours = MilesDeepseekV4CausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    expected_dtypes = {name: tensor.dtype for name, tensor in reference.hf_state_dict().items()}
    assert {name: tensor.dtype for name, tensor in ours.hf_state_dict().items()} == expected_dtypes
    assert torch.float32 in expected_dtypes.values() and torch.bfloat16 in expected_dtypes.values()
    with torch.no_grad():
        expected, logits = reference(input_ids()).float(), ours(input_ids()).float()
        full = TransformersCausalLM.from_pretrained(checkpoint)(input_ids())
    assert (logits - expected).abs().max().item() <= bfloat16_logit_error(full) / 8
    assert (expected - full).abs().max().item() > 1e-3  # bfloat16 did round


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel": 2}, {"data_parallel": 2, "expert_parallel": 2}], ids=["tp2", "dp2-ep2"]
)
def test_bfloat16_trains_through_the_megatron_trainer(checkpoint: Path, torch_step, tmp_path: Path, layout) -> None:
    """``--megatron-dtype bfloat16``: logits within the bfloat16 error bound of float32's (TP=2 sums the heads' and
    columns' partial bfloat16 outputs across ranks: measured 0.055 from transformers' bfloat16 logits, 0.0 at
    DP=2 x EP=2), the export in transformers' bfloat16 dtypes, and a step whose loss and gradient norm are the float32
    torch trainer's within bfloat16's relative error (measured: 0.4 %)."""
    metrics, _ = torch_step
    with torch.no_grad():
        full = TransformersCausalLM.from_pretrained(checkpoint)(input_ids())
    expected_dtypes = {
        name: tensor.dtype
        for name, tensor in TransformersCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        .hf_state_dict()
        .items()
    }
    with launch(checkpoint, tmp_path, train=SETTINGS, dtype="bfloat16", **layout) as trainer:
        logits = trainer.logits(input_ids())
        step_metrics = trainer.train_step(training_batch())
        exported = dict(exported_names_and_tensors(trainer))
    assert (logits - full).abs().max().item() <= bfloat16_logit_error(full)
    assert {name: tensor.dtype for name, tensor in exported.items()} == expected_dtypes
    relative = 4 * 4 * BFLOAT16_ROUNDOFF
    for key in ("loss", "grad_norm"):
        assert step_metrics[key] == pytest.approx(metrics[key], rel=relative), key


def test_a_dtype_it_does_not_compute_in_is_refused() -> None:
    from miles_plugins_megatron.deepseek_v4.checks import check_deepseek_v4
    from miles_plugins_megatron.deepseek_v4.parallel import Layout

    from miles_core.testkit.tiny_models import tiny_deepseek_v4_config

    layout = Layout(tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, dtype=torch.float16)
    with pytest.raises(MilesError, match=re.escape("dtype torch.float16 (supported: float32, bfloat16)")):
        check_deepseek_v4(tiny_deepseek_v4_config(), layout=layout)
