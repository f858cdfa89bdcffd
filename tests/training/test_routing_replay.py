"""Routing replay in the torch trainer: with ``routing_replay`` every token of the trainer's forwards goes to the
experts the engine recorded for it (captured where the experts run, the ``top_k_index`` the experts module gets),
although the trainer's weights differ from the engine's (one update ahead, as under ``one_step_off``), which moves
some tokens to other experts without replay; routing that does not fit the model is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles_core.builtin.local_engine.engine import LocalEngine
from miles_core.builtin.local_engine.sampling import GenerationRequest, SamplingParams
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.engines.routed_experts import RoutedExpertsError, RoutingShape
from miles_core.errors import ConfigError
from miles_core.rollout.executor import _routing_continued
from miles_core.run_setup import routing_replay_shape
from miles_core.testkit.tiny_models import (
    perturbed_state,
    save_from_config,
    save_tiny_deepseek_v3,
    save_tiny_llama,
    save_tiny_qwen3_moe,
    tiny_deepseek_v3_config,
)
from miles_core.training.batch import TrainBatch, TrainSample
from tests.conftest import config_json

PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]


def tiny_moe(family: str, path: Path) -> Path:
    """Qwen3-MoE (softmax router, 8 experts, both layers sparse) or DeepSeek-V3 (sigmoid router with a selection
    bias and a group limit, 4 experts, a dense first layer)."""
    if family == "qwen3_moe":
        return save_tiny_qwen3_moe(path, scale=0.1, num_experts=8, norm_topk_prob=True, intermediate_size=128)
    return save_from_config(tiny_deepseek_v3_config(), path, scale=0.1)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def generated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainBatch]:
    """A tiny MoE model and a batch the local engine generated from it, with every token's routed experts."""
    root = tmp_path_factory.mktemp("replay")
    model_dir = tiny_moe(request.param, root / "model")
    (root / "staging").mkdir(mode=0o700)
    engine = LocalEngine(model_dir, staging_dir=root / "staging")

    async def generate():
        engine.start()
        params = [SamplingParams(max_new_tokens=6 + i, sampling_seed=i, ignore_eos=True) for i in range(4)]
        requests = [GenerationRequest(p, q, return_routed_experts=True) for p, q in zip(PROMPTS, params, strict=True)]
        return await engine.generate(requests)

    results = asyncio.run(generate())
    samples = [
        TrainSample(p, r.output_ids, r.logprobs, float(i % 2) - 0.5, 0.0, routed_experts=r.routed_experts.tolist())
        for i, (p, r) in enumerate(zip(PROMPTS, results, strict=True))
    ]
    return model_dir, TrainBatch(samples)


def trainer_one_update_ahead(model_dir: Path, *, replay: bool) -> TorchTrainer:
    settings = TrainSection(optimizer="sgd", lr=0.01, micro_batch_size=3, routing_replay=replay, kl_coef=0.05)
    trainer = TorchTrainer.from_pretrained(model_dir, settings)
    trainer.model.load_state_dict(perturbed_state(trainer.model, seed=5, scale=0.2))
    if trainer.reference is not None:
        trainer.reference.load_state_dict(trainer.model.state_dict())
    return trainer


def experts_used(trainer: TorchTrainer) -> tuple[list[torch.Tensor], list]:
    """Records, for each forward of the policy, the ``top_k_index`` each sparse layer's experts module was given."""
    used: list[torch.Tensor] = []
    layers = trainer.model.model.model.layers
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, args, i=i: used.append((i, args[1].clone())))
        for i, layer in enumerate(layers)
        if hasattr(layer.mlp, "experts")
    ]
    return used, hooks


def mismatches(batch: TrainBatch, used: list, micro_batch_size: int, sparse_layers: int) -> int:
    """Tokens (of those with recorded routing) whose experts in the first policy forward of each micro-batch differ
    from the recorded ones; asserts every recorded token was compared."""
    micros = batch.micro_batches(micro_batch_size)
    per_forward = len(used) // len(micros)  # layers x forwards (policy, then the reference's, both replayed)
    differing = compared = 0
    for index, micro in enumerate(micros):
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in micro.samples)
        for layer, chosen in used[index * per_forward : index * per_forward + sparse_layers]:
            chosen = chosen.reshape(len(micro.samples), length, -1)
            for row, sample in enumerate(micro.samples):
                recorded = torch.tensor(sample.routed_experts)[:, layer]
                differing += int((chosen[row, : len(recorded)] != recorded).any(-1).sum())
                compared += len(recorded)
    assert compared == sparse_layers * sum(len(s.routed_experts) for s in batch.samples)
    return differing


def test_with_replay_the_trainer_uses_the_recorded_experts_for_every_token(generated) -> None:
    model_dir, batch = generated
    for replay, expect_equal in ((False, False), (True, True)):
        trainer = trainer_one_update_ahead(model_dir, replay=replay)
        used, hooks = experts_used(trainer)
        metrics = trainer.train_step(batch)
        for hook in hooks:
            hook.remove()
        differing = mismatches(batch, used, 3, sparse_layers=len(hooks))
        assert (differing == 0) is expect_equal, (replay, differing)  # without replay some tokens route elsewhere
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_replayed_routing_weights_are_the_routers_own_at_the_recorded_experts(generated) -> None:
    """With weights equal to the engine's, replay changes nothing: the logits equal a plain forward's exactly."""
    model_dir, batch = generated
    trainer = TorchTrainer.from_pretrained(model_dir, TrainSection(routing_replay=True))
    tensors = batch.tensors()
    with torch.no_grad():
        plain = trainer.model(tensors["input_ids"])
        with trainer._replayed(trainer.model, tensors):
            replayed = trainer.model(tensors["input_ids"])
    torch.testing.assert_close(replayed, plain, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda r: [[[99, 0] for _ in t] for t in r],
            r"expert id 99 is out of range: this model's experts are 0 to [37]",
        ),
        (lambda r: [[[*e, 0] for e in t] for t in r], "the model needs \\[batch, tokens, layers >= 2, 2\\]"),
    ],
    ids=["id-out-of-range", "wrong-top-k"],
)
def test_routing_that_does_not_fit_the_model_is_refused(generated, change, match: str) -> None:
    model_dir, batch = generated
    sample = batch.samples[0]
    bad = TrainSample(
        sample.prompt_ids,
        sample.response_ids,
        sample.rollout_logprobs,
        1.0,
        0.0,
        routed_experts=change(sample.routed_experts),
    )
    trainer = TorchTrainer.from_pretrained(model_dir, TrainSection(routing_replay=True))
    with pytest.raises(RoutedExpertsError, match=match):
        trainer.train_step(TrainBatch([bad]))


def test_a_sample_refuses_routing_of_the_wrong_token_count() -> None:
    with pytest.raises(ValueError, match="routed_experts: 2 tokens' routing, expected 3"):
        TrainSample([1, 2], [3, 4], [0.0, 0.0], 1.0, 0.0, routed_experts=[[[0, 1]], [[0, 1]]])


def test_a_continued_request_appends_the_routing_of_its_new_tokens() -> None:
    before = [[[0, 1]], [[1, 2]], [[2, 3]]]  # prompt of 2, 2 tokens generated before the cut
    answer = [[[7, 7]], [[7, 7]], [[7, 7]], [[4, 5]], [[5, 6]]]  # the continued request ran all 5 tokens again
    assert _routing_continued(before, answer) == [*before, [[4, 5]], [[5, 6]]]
    assert _routing_continued(None, answer) == answer
    assert _routing_continued(before, None) == before


def test_the_flag_sets_the_field_and_a_model_without_experts_is_refused(tmp_path: Path) -> None:
    assert config_json("--train-routing-replay", "true")["train"]["routing_replay"] is True
    on = SimpleNamespace(train=SimpleNamespace(routing_replay=True), rollout=SimpleNamespace(agent=None))
    model_dir = tiny_moe("qwen3_moe", tmp_path / "qwen3_moe")
    assert routing_replay_shape(on, model_dir) == RoutingShape(num_layers=2, top_k=2, num_experts=8)
    with pytest.raises(ConfigError, match="the embedded default \\(a dense Llama\\) \\(llama\\) has no routing"):
        routing_replay_shape(on, None)
    with pytest.raises(ConfigError, match=r"\(llama\) has no routing Miles can replay: .* turn routing replay off"):
        routing_replay_shape(on, save_tiny_llama(tmp_path / "llama"))
    deepseek = save_tiny_deepseek_v3(tmp_path / "deepseek")  # n_routed_experts, DeepSeek-V3's name
    assert routing_replay_shape(on, deepseek) == RoutingShape(num_layers=2, top_k=2, num_experts=4)
    agent = SimpleNamespace(train=on.train, rollout=SimpleNamespace(agent="single_turn"))
    with pytest.raises(ConfigError, match="not available with --rollout-agent"):
        routing_replay_shape(agent, model_dir)
