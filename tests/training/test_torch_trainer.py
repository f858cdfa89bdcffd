"""Losses, batches, weight buckets, data order and the torch trainer's step, checkpoint and resume."""

from __future__ import annotations

import pytest
import torch
import transformers

from miles_core.builtin.algorithms import Grpo
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import EngineSection, RolloutSection, RunSection, TrainSection
from miles_core.default.task import echo_last_prompts
from miles_core.models.hf_checkpoint import tokenizer_files
from miles_core.rollout.executor import RolloutExecutor
from miles_core.rollout.rewards import single_reward
from miles_core.run_setup import load_tokenizer
from miles_core.testkit.tiny_models import save_tiny_llama, tiny_llama_config
from miles_core.testkit.tokenizers import save_char_tokenizer
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.losses import grpo_advantages, kl_k3, ppo_clip_loss
from miles_core.training.weight_iterator import ModuleHfWeightIterator, bucketize


def test_grpo_advantages_are_group_normalised() -> None:
    advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5]), 2)
    assert torch.allclose(advantages, torch.tensor([0.7071, -0.7071, 0.0, 0.0, 0.0, 0.0]), atol=1e-3)
    assert torch.equal(grpo_advantages(torch.tensor([3.0, 1.0]), 2, normalize_std=False), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        grpo_advantages(torch.ones(6), 4)


def test_ppo_clip_loss_clips_the_ratio() -> None:
    mask = torch.ones(1, 1)
    old = torch.zeros(1, 1)
    far = torch.log(torch.tensor([[2.0]]))  # ratio 2 > 1.2
    loss, stats = ppo_clip_loss(far, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert abs(loss.item() + 1.2) < 1e-6 and stats["clip_fraction"].item() == 1.0
    loss, _ = ppo_clip_loss(far, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert abs(loss.item() - 2.0) < 1e-6  # pessimistic side: the unclipped ratio for negative advantages
    same = torch.tensor([[-1.0, -2.0]])
    assert kl_k3(same, same, torch.ones(1, 2)).item() == 0.0
    assert kl_k3(same, same - 0.5, torch.ones(1, 2)).item() > 0.0


def test_buckets_respect_the_byte_size() -> None:
    named = [(f"t{i}", torch.zeros(i + 1)) for i in range(6)]  # 4, 8, ..., 24 bytes
    buckets = list(bucketize(named, 20))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True))
    names = [n for b in ModuleHfWeightIterator(model, bucket_bytes=1 << 30) for n, _ in b]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: sent once


def batch(seed: int) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(6):
        response = torch.randint(3, 64, (3,), generator=generator).tolist()
        samples.append(TrainSample([2, 5 + i], response, [-2.0, -2.5, -3.0], float(i % 3 - 1), 0.0))
    return TrainBatch(samples)


def trainer(micro_batch_size: int = 64, kl_coef: float = 0.0) -> TorchTrainer:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    return TorchTrainer(model, TrainSection(micro_batch_size=micro_batch_size, kl_coef=kl_coef, lr=1e-2))


def test_micro_batches_accumulate_to_the_full_batch_step() -> None:
    whole, split = trainer(), trainer(micro_batch_size=2)
    assert whole.train_step(batch(1))["loss"] == pytest.approx(split.train_step(batch(1))["loss"], abs=1e-6)
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=name)  # gradients, before Adam


def test_kl_to_the_reference_grows_from_zero() -> None:
    with_kl = trainer(kl_coef=0.1)
    first = with_kl.train_step(batch(1))
    second = with_kl.train_step(batch(2))
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 0
    assert {"loss", "pg_loss", "entropy", "clip_fraction", "grad_norm"} <= set(second)


def test_checkpoint_and_resume_restore_weights_optimizer_and_step(tmp_path) -> None:
    original = trainer()
    original.train_step(batch(1))
    original.save_checkpoint(tmp_path / "step_000001")
    resumed = trainer()
    assert resumed.load_checkpoint(tmp_path / "step_000001")["step"] == 1
    original.train_step(batch(2))
    resumed.train_step(batch(2))
    for (name, a), (_, b) in zip(original.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)  # same weights and same Adam moments give the same step
    with pytest.raises(Exception, match="already exists"):
        original.save_checkpoint(tmp_path / "step_000001")


def test_a_checkpoint_holds_the_tokenizer_of_the_run_s_model(tmp_path) -> None:
    """``--model CHECKPOINT`` needs the tokenizer: every checkpoint copies the run model's tokenizer files."""
    model_dir = save_tiny_llama(tmp_path / "model")
    save_char_tokenizer(model_dir, "abc:0123456")
    from_run = TorchTrainer.from_pretrained(model_dir, TrainSection(lr=1e-2))
    from_run.train_step(batch(1))
    saved = from_run.save_checkpoint(tmp_path / "step_000001")
    assert {p.name for p in tokenizer_files(saved)} == {p.name for p in tokenizer_files(model_dir)} != set()
    reloaded = load_tokenizer(saved)  # what a run given --model CHECKPOINT loads
    assert reloaded.encode("ab1:") == load_tokenizer(model_dir).encode("ab1:") != []
    without = trainer()  # a trainer told of no tokenizer (a bare model in a test) writes none
    assert tokenizer_files(without.save_checkpoint(tmp_path / "bare")) == []


def test_data_order_depends_on_the_step_alone() -> None:
    train, evaluation = echo_last_prompts(seed=0)
    assert not {p.text for p in train} & {p.text for p in evaluation}
    sections = {
        "run": RunSection(seed=5),
        "rollout": RolloutSection(batch_size=16),
        "train": TrainSection(),
        "engine": EngineSection(),
    }
    executor = RolloutExecutor(
        **sections,
        tokenizer=None,
        train_prompts=train,
        eval_prompts=evaluation,
        reward=single_reward(lambda **_: 0.0, "none"),
        controller=None,
        advantages=Grpo(),
    )
    again = RolloutExecutor(
        **sections,
        tokenizer=None,
        train_prompts=train,
        eval_prompts=evaluation,
        reward=single_reward(lambda **_: 0.0, "none"),
        controller=None,
        advantages=Grpo(),
    )
    assert [p.text for p in executor.prompts_for(37)] == [p.text for p in again.prompts_for(37)]
    epoch = [p.text for step in range(32) for p in executor.prompts_for(step)]
    assert sorted(epoch) == sorted(p.text for p in train)  # one epoch visits every prompt once


def test_the_sgd_optimizer_steps_by_lr_times_the_clipped_gradient() -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    sgd = TorchTrainer(model, TrainSection(optimizer="sgd", lr=0.5, max_grad_norm=1e9))
    before = {name: p.detach().clone() for name, p in sgd.model.named_parameters()}
    sgd.train_step(batch(1))
    for name, parameter in sgd.model.named_parameters():
        expected = before[name] - 0.5 * parameter.grad
        torch.testing.assert_close(parameter.detach(), expected, rtol=0, atol=1e-6, msg=name)  # one float32 rounding
