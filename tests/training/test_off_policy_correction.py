"""Off-policy correction: ``TrainSample.loss_mask`` (tokens masked off the loss) and truncated importance sampling
(``--train-tis-clip``) in the shared loss, the batch, the RPC that carries a batch to Megatron ranks and the torch
trainer's step."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from miles_plugins_megatron.rank import MegatronRank

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.errors import MilesError
from miles_core.testkit.tiny_models import tiny_llama_config
from miles_core.training.batch import TrainBatch, TrainSample, trained_tokens
from miles_core.training.losses import policy_loss, ppo_clip_loss, truncated_importance_weights
from miles_core.workers.rpc.arguments import ArgumentCheck, ArgumentError

# -- the loss ------------------------------------------------------------------------------------------------------


def token_data(seed: int = 0, shape: tuple[int, int] = (3, 5)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "logprobs": -torch.rand(shape, generator=generator) * 3 - 0.5,
        "rollout": -torch.rand(shape, generator=generator) * 3 - 0.5,
        "advantages": torch.tensor([1.0, -0.5, 2.0]),
        "mask": torch.ones(shape),
    }


def test_tis_weights_are_one_where_trainer_and_rollout_agree() -> None:
    data = token_data()
    weights, stats = truncated_importance_weights(data["rollout"], data["rollout"], data["mask"], clip=2.0)
    assert torch.equal(weights, torch.ones_like(weights))  # exp(0) is 1 exactly
    assert stats["tis_weight_mean"].item() == 1.0 and stats["tis_clip_fraction"].item() == 0.0
    # ... so TIS with the trainer's logprobs equal to the rollout's is today's loss, gradient included
    logprobs = data["logprobs"].clone().requires_grad_()
    with_tis, tis_stats = policy_loss(
        logprobs, data["rollout"], data["advantages"], data["mask"], tis_clip=2.0, old_logprobs=data["rollout"]
    )
    (tis_gradient,) = torch.autograd.grad(with_tis, logprobs)
    plain, plain_stats = ppo_clip_loss(logprobs, data["rollout"], data["advantages"], data["mask"])
    (plain_gradient,) = torch.autograd.grad(plain, logprobs)
    assert with_tis.item() == plain.item() and torch.equal(tis_gradient, plain_gradient)
    assert tis_stats["approx_kl_rollout"].item() == plain_stats["approx_kl_rollout"].item() > 0


def test_a_token_above_the_clip_gets_the_clip_exactly() -> None:
    rollout = torch.tensor([[-3.0, -3.0, -3.0, -1e4]])
    old = torch.tensor([[-3.0 + math.log(5.0), -3.0 + math.log(0.5), -3.0, -1.0]])  # ratios 5, 0.5, 1, exp(9999)
    weights, stats = truncated_importance_weights(old, rollout, torch.ones(1, 4), clip=2.0)
    assert weights[0, 0].item() == 2.0 and weights[0, 3].item() == 2.0  # an overflowing ratio is clipped too
    assert weights[0, 1].item() == pytest.approx(0.5, rel=1e-6)  # exp of a float32 log: rounding only
    assert weights[0, 2].item() == 1.0
    assert stats["tis_clip_fraction"].item() == 0.5
    assert stats["tis_weight_mean"].item() == pytest.approx((2.0 + 0.5 + 1.0 + 2.0) / 4, rel=1e-6)


def test_each_token_s_gradient_is_scaled_by_its_tis_weight() -> None:
    """At the start of a step the trainer's logprobs are the old policy: the ratio is 1 and each token's gradient is
    ``-weight * advantage / tokens``, with the weight of the rollout mismatch."""
    data = token_data(seed=1)
    logprobs = data["logprobs"].clone().requires_grad_()
    old = data["logprobs"].clone()
    loss, stats = policy_loss(
        logprobs, data["rollout"], data["advantages"], data["mask"], tis_clip=1.5, old_logprobs=old
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)
    weights = (old - data["rollout"]).exp().clamp(max=1.5)
    expected = -weights * data["advantages"].unsqueeze(-1) / data["mask"].sum()
    torch.testing.assert_close(gradient, expected, rtol=1e-6, atol=0)  # float32 rounding of exp and the division
    assert 0 < stats["tis_clip_fraction"].item() < 1 and stats["clip_fraction"].item() == 0.0


@pytest.mark.parametrize("tis_clip", [None, 2.0], ids=["ppo", "tis"])
def test_masked_tokens_contribute_nothing_to_the_loss_or_its_gradient(tis_clip: float | None) -> None:
    data = token_data(seed=2)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0, 1.0]])

    def loss_and_gradient(logprobs: torch.Tensor, rollout: torch.Tensor) -> tuple[float, torch.Tensor]:
        logprobs = logprobs.clone().requires_grad_()
        loss, _ = policy_loss(
            logprobs,
            rollout,
            data["advantages"],
            mask,
            tis_clip=tis_clip,
            old_logprobs=logprobs.detach() if tis_clip else None,
        )
        (gradient,) = torch.autograd.grad(loss, logprobs)
        return loss.item(), gradient

    rollout = data["logprobs"] + torch.linspace(-0.1, 0.1, 15).view(3, 5)  # within the clip range: every gradient
    loss, gradient = loss_and_gradient(data["logprobs"], rollout)
    assert torch.all(gradient[mask == 0] == 0) and torch.all(gradient[mask == 1] != 0)
    stale = mask == 0  # masked-off tokens as far from the policy as a stale token can be: no NaN, no change
    far_loss, far_gradient = loss_and_gradient(
        torch.where(stale, torch.tensor(-0.01), data["logprobs"]), torch.where(stale, -1e4, rollout)
    )
    assert far_loss == loss and torch.equal(far_gradient, gradient)


# -- the batch -----------------------------------------------------------------------------------------------------


def test_the_loss_mask_folds_into_the_response_mask() -> None:
    samples = [
        TrainSample([2, 5], [7, 8, 9], [-1.0, -2.0, -3.0], 1.0, 0.0, loss_mask=[0, 1, 1]),  # a list is taken
        TrainSample([2, 5, 6], [7, 8], [-1.0, -2.0], 1.0, 0.0),
    ]
    assert samples[0].loss_mask == (0.0, 1.0, 1.0)
    tensors = TrainBatch(samples).tensors()
    assert tensors["response_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert trained_tokens(TrainBatch(samples)) == 4


@pytest.mark.parametrize(
    ("loss_mask", "message"),
    [
        ((1.0, 0.0), "loss_mask has 2 entries; it needs one per response token (3)"),
        ((), "loss_mask has 0 entries"),
        ((1.0, 2.0, 0.0), "loss_mask entries must be numbers from 0 to 1, got 2.0"),
        ((1.0, -0.5, 0.0), "got -0.5"),
        ((1.0, float("nan"), 0.0), "got nan"),
        ((1.0, "1", 0.0), "got '1'"),
    ],
)
def test_a_bad_loss_mask_is_a_value_error_naming_the_sample(loss_mask, message: str) -> None:
    with pytest.raises(ValueError, match=r"the sample with prompt \[2, 5\] \(2 prompt tokens, 3 response tokens\)"):
        TrainSample([2, 5], [7, 8, 9], [-1.0, -2.0, -3.0], 1.0, 0.0, loss_mask=loss_mask)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainSample([2, 5], [7, 8, 9], [-1.0, -2.0, -3.0], 1.0, 0.0, loss_mask=loss_mask)


def test_a_batch_with_every_token_masked_off_is_refused() -> None:
    masked = TrainSample([2, 5], [7, 8], [-1.0, -2.0], 1.0, 0.0, loss_mask=(0.0, 0.0))
    with pytest.raises(MilesError, match="every response token of the batch's 2 samples is masked off"):
        trained_tokens(TrainBatch([masked, masked]))
    with pytest.raises(MilesError, match="no response tokens"):
        trained_tokens(TrainBatch([TrainSample([2], [], [], 1.0, 0.0)]))


def test_the_loss_mask_travels_to_megatron_ranks_through_the_rpc_check() -> None:
    """A Megatron rank's ``train_step`` gets the batch as JSON rebuilt from its ``TrainBatch`` hint (the same check
    runs in the worker's server and in the handle that sends it): the tuple, and None, arrive as they left."""
    check = ArgumentCheck("MegatronRank.train_step", MegatronRank.train_step, skip_self=True)
    sent = TrainBatch(
        [
            TrainSample([2, 5], [7, 8, 9], [-1.0, -2.0, -3.0], 1.0, 0.0, loss_mask=(0.0, 1.0, 1.0)),
            TrainSample([2, 6], [7], [-1.5], -1.0, 0.0),
        ]
    )
    received = check.bind([sent], {}).arguments["batch"]
    assert isinstance(received, TrainBatch) and received == sent
    assert received.samples[0].loss_mask == (0.0, 1.0, 1.0) and received.samples[1].loss_mask is None
    wire = {"samples": [{**sent.samples[0].__dict__, "loss_mask": [1.0, 0.0]}]}  # a wrong length, as JSON
    with pytest.raises(ArgumentError, match=r"batch\.samples\[0\]: .*loss_mask has 2 entries"):
        check.bind([wire], {})


# -- the torch trainer ---------------------------------------------------------------------------------------------


def batch(rollout_logprob: float = -2.0, masked_first: bool = False, seed: int = 1) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(6):
        response = torch.randint(3, 64, (3,), generator=generator).tolist()
        samples.append(TrainSample([2, 5 + i], response, [rollout_logprob] * 3, float(i % 3 - 1) or 0.5, 0.0))
    if masked_first:
        first = samples[0]
        samples[0] = TrainSample(first.prompt_ids, first.response_ids, [-30.0] * 3, -4.0, 0.0, loss_mask=(0, 0, 0))
    return TrainBatch(samples)


def trainer(**settings) -> TorchTrainer:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    return TorchTrainer(model, TrainSection(lr=1e-2, max_grad_norm=1e9, micro_batch_size=4, **settings))


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def test_a_tis_step_reports_its_weights_and_scales_the_gradient_by_them() -> None:
    """The tiny model's logprobs are about -4: against rollout logprobs of -30 every token's weight is the clip."""
    metrics = {}
    grads = {}
    for clip in (2.0, 4.0):
        tis = trainer(tis_clip=clip)
        metrics[clip] = tis.train_step(batch(rollout_logprob=-30.0))
        grads[clip] = gradients(tis.model)
    assert metrics[2.0]["tis_weight_mean"] == 2.0 and metrics[2.0]["tis_clip_fraction"] == 1.0
    assert {"loss", "pg_loss", "kl", "entropy", "clip_fraction", "approx_kl_rollout", "grad_norm"} <= set(metrics[2.0])
    assert metrics[2.0]["clip_fraction"] == 0.0  # the ratio against the trainer's own logprobs is 1
    assert metrics[2.0]["approx_kl_rollout"] > 100  # and the KL to the rollout's still shows the mismatch
    for name, gradient in grads[2.0].items():  # a weight twice as large, a gradient twice as large (exact in binary)
        torch.testing.assert_close(grads[4.0][name], 2 * gradient, rtol=1e-6, atol=1e-9, msg=name)
    assert any(gradient.abs().max() > 0 for gradient in grads[2.0].values())
    plain = trainer().train_step(batch(rollout_logprob=-30.0))
    assert "tis_weight_mean" not in plain and plain["clip_fraction"] == 1.0  # today's ratio: e^26, clipped


def test_tis_with_the_trainer_s_own_logprobs_as_the_rollout_s_is_today_s_step() -> None:
    probe = trainer()
    rows = []
    for micro in batch().micro_batches(4):
        tensors = micro.tensors()
        rows += probe._old_logprobs(tensors).tolist()
    samples = [
        TrainSample(s.prompt_ids, s.response_ids, row[1:4], s.advantage, 0.0)  # response targets: positions 1..3
        for s, row in zip(batch().samples, rows, strict=True)
    ]
    agreeing = TrainBatch(samples)
    tis, plain = trainer(tis_clip=2.0), trainer()
    tis_metrics, plain_metrics = tis.train_step(agreeing), plain.train_step(agreeing)
    assert tis_metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-6)  # float32 rounding of the same forward
    assert tis_metrics["pg_loss"] == pytest.approx(plain_metrics["pg_loss"], abs=1e-6)
    for (name, a), (_, b) in zip(tis.model.named_parameters(), plain.model.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)  # ratios of 1 +- float32 rounding


@pytest.mark.parametrize("tis_clip", [None, 2.0], ids=["ppo", "tis"])
def test_a_sample_masked_off_entirely_adds_no_gradient(tis_clip: float | None) -> None:
    settings = {"tis_clip": tis_clip, "entropy_coef": 0.01, "kl_coef": 0.1}
    with_masked, without = trainer(**settings), trainer(**settings)
    with_masked.train_step(batch(masked_first=True))
    without.train_step(TrainBatch(batch().samples[1:]))
    for (name, a), (_, b) in zip(with_masked.model.named_parameters(), without.model.named_parameters(), strict=True):
        # other micro-batch shapes, other BLAS blocking: float32 rounding of sums over the batch
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    unmasked = trainer(**settings)  # the same sample, not masked off, does move the gradient
    first = batch(masked_first=True).samples[0]
    kept = TrainSample(first.prompt_ids, first.response_ids, first.rollout_logprobs, first.advantage, 0.0)
    unmasked.train_step(TrainBatch([kept, *batch().samples[1:]]))
    pairs = zip(unmasked.model.parameters(), without.model.parameters(), strict=True)
    assert max((a.grad - b.grad).abs().max() for a, b in pairs) > 1e-3
