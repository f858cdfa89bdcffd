"""The Megatron trainer against the core torch trainer: the same step, the same exported weights, at TP=1, TP=2
and DP=2, with ranks running as local worker processes; and bad input refused before any rank starts."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.errors import MilesError
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.weight_transfer import disk
from miles_core.weight_transfer.digests import checksum, combine_digests
from miles_core.weight_transfer.holders import HolderTaskError
from miles_core.workers.local_provider import LocalWorkerProvider
from tests.numerics import assert_same_sgd_step, assert_within_first_adam_step

pytestmark = pytest.mark.slow

SETTINGS = TrainSection(
    backend="megatron", lr=1e-3, micro_batch_size=3, kl_coef=0.05, entropy_coef=0.01, max_grad_norm=0.5
)
SGD_SETTINGS = TrainSection(**{**SETTINGS.model_dump(), "optimizer": "sgd", "lr": 0.1})
"""Cross-trainer weight comparisons step with SGD: its step is linear in the gradient (see tests/numerics.py)."""
VOCAB = 96


def perturbed_checkpoint(directory: Path, model_type: str, **overrides) -> Path:
    """An HF checkpoint whose every weight (norms included) is perturbed, so a swapped tensor cannot hide."""
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    return directory


def training_batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index in range(8):  # micro-batches of 3: 3 + 3 + 2, uneven lengths, both advantage signs
        prompt = torch.randint(0, VOCAB, (2 + index % 3,), generator=generator).tolist()
        response = torch.randint(0, VOCAB, (3 + index % 2,), generator=generator).tolist()
        rollout_logprobs = (-torch.rand(len(response), generator=generator) * 4 - 2).tolist()
        samples.append(TrainSample(prompt, response, rollout_logprobs, float(index % 3 - 1) or 0.5, 0.0))
    return TrainBatch(samples)


def launch(
    path: Path,
    tmp_path: Path,
    reference_path: Path | None = None,
    train: TrainSection = SETTINGS,
    objective: dict | None = None,
    **layout,
):
    from miles_plugins_megatron.config import MegatronSection
    from miles_plugins_megatron.trainer import MegatronTrainer

    def provider() -> LocalWorkerProvider:
        return LocalWorkerProvider(token="t", run_dir=tmp_path)

    return MegatronTrainer.launch(
        path,
        train=train,
        layout=MegatronSection(**layout),
        seed=0,
        provider_factory=provider,
        reference_path=reference_path,
        objective=objective,
    )


def hf_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in trainer.weight_iterator(1 << 20) for name, tensor in bucket}


MODELS = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "qwen3": ("qwen3", {"tie_word_embeddings": False, "head_dim": 24}),
}


@pytest.fixture(scope="module")
def reference_steps(tmp_path_factory):
    """Per model: the checkpoint, and the torch trainer's SGD step on it (metrics and updated HF weights)."""
    cache = {}

    def step(name: str):
        if name not in cache:
            model_type, overrides = MODELS[name]
            path = perturbed_checkpoint(tmp_path_factory.mktemp(name), model_type, **overrides)
            torch_trainer = TorchTrainer.from_pretrained(path, SGD_SETTINGS)
            metrics = torch_trainer.train_step(training_batch())
            cache[name] = path, metrics, hf_weights(torch_trainer)
        return cache[name]

    return step


@pytest.fixture(scope="module")
def reference_step(reference_steps):
    return reference_steps("llama")


def assert_same_step(megatron_metrics, megatron_weights, metrics, weights, initial) -> None:
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_fraction"):
        assert megatron_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    assert_same_sgd_step(initial, weights, megatron_weights)


@pytest.mark.parametrize(
    "model,layout",
    [
        ("llama", {"tensor_parallel": 1}),
        ("llama", {"tensor_parallel": 2}),
        ("llama", {"data_parallel": 2}),
        ("qwen3", {"tensor_parallel": 2}),
    ],
    ids=["llama-tp1", "llama-tp2", "llama-dp2", "qwen3-qk-norm-tp2"],
)
def test_one_step_equals_the_torch_trainer(reference_steps, tmp_path: Path, model: str, layout: dict) -> None:
    path, metrics, weights = reference_steps(model)
    initial = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    with launch(path, tmp_path, train=SGD_SETTINGS, **layout) as trainer:
        exported = hf_weights(trainer)  # before training: the checkpoint, exactly
        assert all(torch.equal(exported[name], initial[name]) for name in exported) and len(exported) == len(initial)
        step_metrics = trainer.train_step(training_batch())
        assert_same_step(step_metrics, hf_weights(trainer), metrics, weights, exported)
        assert trainer.export_report["gb_per_s"] > 0  # hf_weights gathered the weights into the driver


def test_a_tis_step_with_masked_tokens_equals_the_torch_trainer(reference_step, tmp_path: Path) -> None:
    """``--train-tis-clip`` and ``loss_mask`` on the ranks: old logprobs from each rank's shard before the step,
    the TIS metrics reduced over data-parallel ranks, and the same SGD step as the torch trainer's. Both trainers
    take ``--train-logits-dtype model``, the float32 path for these float32 models, through every logprob (old,
    current, KL reference)."""
    path, _, _ = reference_step
    settings = TrainSection(**{**SGD_SETTINGS.model_dump(), "tis_clip": 1.5, "logits_dtype": "model"})
    samples = training_batch().samples
    for index, masked in ((1, [1]), (2, range(len(samples[2].response_ids)))):  # a token of one, all of another
        kept = samples[index]
        loss_mask = tuple(0.0 if token in masked else 1.0 for token in range(len(kept.response_ids)))
        samples[index] = TrainSample(*dataclasses.astuple(kept)[:5], loss_mask=loss_mask)
    batch = TrainBatch(samples)
    torch_trainer = TorchTrainer.from_pretrained(path, settings)
    metrics = torch_trainer.train_step(batch)
    assert 0 < metrics["tis_clip_fraction"] < 1  # rollout logprobs in [-6, -2] against the model's: both sides
    initial = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    with launch(path, tmp_path, train=settings, data_parallel=2) as trainer:
        step_metrics = trainer.train_step(batch)
        assert_same_step(step_metrics, hf_weights(trainer), metrics, hf_weights(torch_trainer), initial)
    for key in ("tis_weight_mean", "tis_clip_fraction", "approx_kl_rollout"):
        assert step_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key


def objective_spec(loss: str, aggregation: str, kl: str, **settings) -> dict:
    return {
        "policy_loss_target": f"miles_core.builtin.algorithms:{loss}",
        "policy_loss_settings": settings,
        "aggregation": aggregation,
        "kl_estimator": kl,
        "norm_constant": 8.0,
    }


ALGORITHMS = {
    "gspo": (objective_spec("GspoLoss", "seq-mean-token-mean", "k2", clip_eps=0.2, clip_eps_high=0.2), {}),
    "dr_grpo": (objective_spec("PpoClip", "seq-mean-token-sum-norm", "k1"), {}),
    "reinforce_plus_plus-per-token": (objective_spec("PpoClip", "seq-mean-token-sum", "k3"), {}),
    "two-mini-batches-two-epochs": (
        objective_spec("PpoClip", "token-mean", "k3"),
        {"mini_batches_per_rollout": 2, "epochs_per_rollout": 2},
    ),
}


def per_token_batch() -> TrainBatch:
    """The training batch with one advantage per response token (a token-level estimator's)."""
    return TrainBatch(
        [
            dataclasses.replace(s, advantage=tuple(s.advantage * (1 + 0.25 * t) for t in range(len(s.response_ids))))
            for s in training_batch().samples
        ]
    )


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_each_algorithm_steps_as_the_torch_trainer_at_tp2(reference_step, tmp_path: Path, algorithm: str) -> None:
    """The run's objective (policy loss, loss aggregation, KL estimator; per-token advantages; several optimizer
    steps per rollout) reaches the ranks, which step as the torch trainer does, within the tolerances of the
    one-step equality above."""
    from miles_core.training.objective import objective_from_spec

    path, _, _ = reference_step
    spec, extra = ALGORITHMS[algorithm]
    settings = TrainSection(**{**SGD_SETTINGS.model_dump(), **extra})
    batch = per_token_batch() if "per-token" in algorithm else training_batch()
    torch_trainer = TorchTrainer.from_pretrained(path, settings, objective=objective_from_spec(settings, spec))
    metrics = torch_trainer.train_step(batch)
    initial = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    with launch(path, tmp_path, train=settings, objective=spec, tensor_parallel=2) as trainer:
        step_metrics = trainer.train_step(batch)
        assert_same_step(step_metrics, hf_weights(trainer), metrics, hf_weights(torch_trainer), initial)
    assert step_metrics.get("optimizer_steps") == metrics.get("optimizer_steps")


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {"tie_word_embeddings": False, "head_dim": 24}),
    ],
    ids=["llama-tied", "qwen2-qkv-bias", "qwen3-qk-norm"],
)
def test_tp2_export_loads_into_transformers_with_equal_logits(tmp_path: Path, model_type: str, overrides) -> None:
    path = perturbed_checkpoint(tmp_path / "model", model_type, **overrides)
    input_ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with launch(path, tmp_path, tensor_parallel=2) as trainer:
        trainer.train_step(training_batch())  # weights no longer those of the file
        megatron_logits = trainer.logits(input_ids)
        exported = hf_weights(trainer)
        saved = trainer.save_checkpoint(tmp_path / "checkpoint")
        with pytest.raises(HolderTaskError) as failed:  # a holder task that fails is the protocol's failure ...
            trainer.weight_holders().run_task(f"{disk.__name__}:write_shard", directory=str(tmp_path / "shards"))
        assert "failed in 2 holder(s): megatron-rank0: " in str(failed.value)
        assert "megatron-rank1: " in str(failed.value)
        (tmp_path / "shards").mkdir()  # ... and the ranks live on: the same task now succeeds
        written = trainer.weight_holders().run_task(f"{disk.__name__}:write_shard", directory=str(tmp_path / "shards"))
    # the ranks as weight holders: each wrote a disjoint share whose union is the driver's export, with its digests
    shares = [load_file(str(tmp_path / "shards" / result["file"])) for result in written]
    assert len(shares) == 2 and all(shares) and not set(shares[0]) & set(shares[1])
    assert {**shares[0], **shares[1]}.keys() == exported.keys()
    assert all(torch.equal(tensor, exported[name]) for share in shares for name, tensor in share.items())
    digests = {name: digest for result in written for name, digest in result["digests"].items()}
    assert combine_digests(digests) == checksum(exported.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    hf.load_state_dict(exported, strict=not hf.config.tie_word_embeddings)
    with torch.no_grad():
        assert (hf(input_ids).logits - megatron_logits).abs().max().item() < 1e-5
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
        assert torch.equal(reloaded(input_ids).logits, hf(input_ids).logits)
    assert sorted(p.name for p in saved.glob("optimizer_rank*.pt")) == ["optimizer_rank000.pt", "optimizer_rank001.pt"]


def test_checkpoint_resume_continues_identically(reference_step, tmp_path: Path) -> None:
    path, _, _ = reference_step
    with launch(path, tmp_path, tensor_parallel=2) as trainer:
        initial = hf_weights(trainer)
        trainer.train_step(training_batch())
        assert_within_first_adam_step(initial, hf_weights(trainer), lr=SETTINGS.lr)
        checkpoint = trainer.save_checkpoint(tmp_path / "step_1")
        expected = trainer.train_step(training_batch())
        expected_weights = hf_weights(trainer)
    with launch(checkpoint, tmp_path, reference_path=path, tensor_parallel=2) as resumed:  # KL to the initial model
        assert resumed.load_checkpoint(checkpoint)["step"] == 1
        again = resumed.train_step(training_batch())
        assert again["loss"] == expected["loss"] and again["grad_norm"] == expected["grad_norm"]
        assert all(torch.equal(t, expected_weights[n]) for n, t in hf_weights(resumed).items())


def test_reset_optimizer_states_leaves_each_rank_a_fresh_optimizer(reference_step, tmp_path: Path) -> None:
    """``--train-reset-optimizer-states`` on the ranks: after every step the rank's AdamW state (as its checkpoint
    holds it) is a fresh optimizer's, zero moments and step 0, so the second step is again a first AdamW step."""
    path, _, _ = reference_step
    settings = TrainSection(**{**SETTINGS.model_dump(), "reset_optimizer_states": True})
    with launch(path, tmp_path, train=settings, tensor_parallel=1) as trainer:
        trainer.train_step(training_batch())
        after_first = hf_weights(trainer)
        trainer.train_step(training_batch())
        assert_within_first_adam_step(after_first, hf_weights(trainer), lr=settings.lr)
        saved = trainer.save_checkpoint(tmp_path / "step_2")
    optimizer = torch.load(saved / "optimizer_rank000.pt", weights_only=True)["optimizer"]
    state = optimizer["state"]
    assert sorted(state) == sorted(index for group in optimizer["param_groups"] for index in group["params"])
    for moments in state.values():
        assert moments["step"].item() == 0 and not moments["exp_avg"].any() and not moments["exp_avg_sq"].any()


def test_a_killed_rank_fails_the_step_quickly_and_stops_the_others(reference_step, tmp_path: Path) -> None:
    path, _, _ = reference_step
    trainer = launch(path, tmp_path, tensor_parallel=2)
    try:
        pids = [trainer.ranks.provider.workers[name].pid for name in trainer.ranks.names]
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(MilesError, match=r"Megatron rank 1 failed in train_step.*every rank was stopped"):
            trainer.train_step(training_batch())
        assert time.monotonic() - started < 60
        assert not asyncio.run(_any_alive(pids))
    finally:
        trainer.close()


async def _any_alive(pids: list[int]) -> bool:
    import psutil

    await asyncio.sleep(0.5)
    return any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


class _NeverCalled:
    def __call__(self):
        raise AssertionError("a rank was about to start")


@pytest.mark.parametrize("case", ["shapes", "architecture", "tensor_parallel"])
def test_bad_input_is_refused_before_any_rank_starts(tmp_path: Path, case: str) -> None:
    from miles_plugins_megatron.config import MegatronSection
    from miles_plugins_megatron.trainer import MegatronTrainer

    path = perturbed_checkpoint(tmp_path / "model", "llama", tie_word_embeddings=False)
    layout = MegatronSection()
    if case == "shapes":  # config.json says 128, the tensors were made for 112
        text = (path / "config.json").read_text().replace('"intermediate_size": 112', '"intermediate_size": 128')
        (path / "config.json").write_text(text)
        expected = (
            r"does not match its config.json .*mlp.gate_proj.weight: shape \(112, 64\), the config needs \(128, 64\)"
        )
    elif case == "architecture":
        transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)).save_pretrained(path)
        expected = "unsupported architecture 'gpt2'"
    else:
        layout = MegatronSection(tensor_parallel=4)
        expected = r"tensor parallel size 4 must divide .* key/value heads \(2\)"
    with pytest.raises(MilesError, match=expected):
        MegatronTrainer.launch(path, train=SETTINGS, layout=layout, seed=0, provider_factory=_NeverCalled())


PPO_SPEC = {
    **objective_spec("PpoClip", "token-mean", "k3"),
    "estimator_target": "miles_core.builtin.algorithms:Ppo",
    "estimator_settings": {"critic_warmup_steps": 1, "critic_lr": 3e-3},
}


def rewarded_batch() -> TrainBatch:
    """The training batch with rewards of both signs (a critic's estimator computes the advantages from them)."""
    return TrainBatch(
        [dataclasses.replace(s, reward=float(i % 3) - 0.75) for i, s in enumerate(training_batch().samples)]
    )


@pytest.mark.parametrize("layout", [{"tensor_parallel": 2}, {"data_parallel": 2}], ids=["tp2", "dp2"])
def test_ppo_trains_its_critic_as_the_torch_trainer(reference_step, tmp_path: Path, layout: dict) -> None:
    """ppo on the ranks: a critic of the policy's architecture with a zeroed value head, GAE from its values, the
    clipped value loss over the data-parallel shares. Step 1 warms the critic up (the policy stays as it was),
    step 2 trains both; the critic's loss, gradient norm and metrics, and the policy's step, are the torch
    trainer's."""
    from miles_core.builtin.critic import Critic, load_value_model
    from miles_core.builtin.torch_trainer import load_causal_lm
    from miles_core.training.objective import objective_from_spec

    path, _, _ = reference_step
    objective = objective_from_spec(SGD_SETTINGS, PPO_SPEC)
    value_model = load_value_model(path, vocab_size=VOCAB, what="the policy")
    critic = Critic(value_model, objective.estimator.settings, SGD_SETTINGS)
    torch_trainer = TorchTrainer(load_causal_lm(path), SGD_SETTINGS, objective=objective, critic=critic)
    initial = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    torch_steps = [torch_trainer.train_step(rewarded_batch()) for _ in range(2)]
    with launch(path, tmp_path, train=SGD_SETTINGS, objective=PPO_SPEC, **layout) as trainer:
        warm = trainer.train_step(rewarded_batch())
        assert all(torch.equal(tensor, initial[name]) for name, tensor in hf_weights(trainer).items())
        checkpoint = trainer.save_checkpoint(tmp_path / "checkpoint")
        steps = [warm, trainer.train_step(rewarded_batch())]
        weights = hf_weights(trainer)
        trainer.load_checkpoint(checkpoint)  # back to after step 1: the critic and its optimizer too
        again = trainer.train_step(rewarded_batch())
    for megatron_metrics, metrics in zip(steps, torch_steps, strict=True):
        for key in ("critic/value_loss", "critic/grad_norm", "critic/return_mean", "critic/explained_variance"):
            assert megatron_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
        assert megatron_metrics["critic/value_mean"] == pytest.approx(metrics["critic/value_mean"], rel=1e-4)
    assert steps[0]["critic/value_mean"] == torch_steps[0]["critic/value_mean"] == 0.0  # the zeroed head
    assert steps[1]["critic/explained_variance"] > 0  # the critic learned in step 1
    assert_same_step(steps[1], weights, torch_steps[1], hf_weights(torch_trainer), initial)
    assert {key: again[key] for key in steps[1]} == pytest.approx(steps[1], rel=1e-9, abs=1e-12)


def test_the_kl_in_the_reward_steps_as_the_torch_trainer_at_tp2(reference_step, tmp_path: Path) -> None:
    """``kl_placement = reward`` with reinforce_plus_plus: the ranks take the reference's KL of every response token,
    subtract ``kl_coef`` x it from the token rewards before the advantages, and leave it out of the loss, as the
    torch trainer does: the same step and the same ``kl_in_reward``."""
    from miles_core.training.objective import objective_from_spec

    path, _, _ = reference_step
    settings = TrainSection(**{**SGD_SETTINGS.model_dump(), "kl_placement": "reward", "kl_coef": 0.5})
    spec = {
        **objective_spec("PpoClip", "token-mean", "k3"),
        "estimator_target": "miles_core.builtin.algorithms:ReinforcePlusPlus",
        "estimator_settings": {},
    }
    torch_trainer = TorchTrainer.from_pretrained(path, settings, objective=objective_from_spec(settings, spec))
    metrics = torch_trainer.train_step(rewarded_batch())
    initial = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    with launch(path, tmp_path, train=settings, objective=spec, tensor_parallel=2) as trainer:
        step_metrics = trainer.train_step(rewarded_batch())
        assert_same_step(step_metrics, hf_weights(trainer), metrics, hf_weights(torch_trainer), initial)
    assert step_metrics["kl_in_reward"] == pytest.approx(metrics["kl_in_reward"], rel=1e-5, abs=1e-7)
    assert metrics["kl_in_reward"] > 0 and step_metrics["kl"] == metrics["kl"] == 0.0  # the KL left the loss
