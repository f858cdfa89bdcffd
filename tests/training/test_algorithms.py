"""The algorithm family (issue 46): each built-in advantage estimator, loss aggregation, KL estimator and policy loss
against values computed here from its published formula, in plain Python floats, on small fixed inputs (several
groups, different response lengths, padding, fractional loss masks, a group whose rewards are all equal); ``grpo``
with ``ppo_clip`` and ``token-mean`` gives today's losses bit for bit; the registries, the settings checks and
several optimizer steps per rollout.

Tolerance: the code computes in float32, the references in float64. Each value here is a few float32 operations on
numbers of order 1 (a mean, a standard deviation, a division, an exp), each rounding by at most 2^-24 relative; with
the cancellation of a centred value the error stays below 1e-6 absolute. ``FLOAT32`` says so.
"""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
import transformers

from miles_core.builtin.algorithms import (
    DrGrpo,
    Grpo,
    Gspo,
    GspoLoss,
    PpoClip,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    Rloo,
)
from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.build import build_config
from miles_core.config.sections import TrainSection
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import tiny_llama_config
from miles_core.training.algorithms import ScoredSample, choose_algorithm
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.losses import aggregate, entropy, kl_k3, kl_per_token, masked_mean, policy_loss
from miles_core.training.objective import Objective, StepShape, mini_batches

FLOAT32 = {"rel": 1e-6, "abs": 1e-6}

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 3.0]]
"""Three groups of four: mixed, all equal (no signal), spread."""
LENGTHS = [[3, 5, 2, 4], [1, 2, 3, 4], [6, 1, 2, 2]]


def scored() -> list[list[ScoredSample]]:
    return [
        [ScoredSample(r, n) for r, n in zip(rewards, lengths, strict=True)]
        for rewards, lengths in zip(REWARDS, LENGTHS, strict=True)
    ]


def flat(advantages: list) -> list[float]:
    return [value for item in advantages for value in (item if isinstance(item, tuple) else (item,))]


def whitened(values: list[float]) -> list[float]:
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / (std + 1e-6) for v in values]


# -- advantage estimators ------------------------------------------------------------------------------------------


def test_grpo_is_the_group_normalised_reward() -> None:
    expected = []
    for rewards in REWARDS:
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        expected += [(r - mean) / (std + 1e-6) for r in rewards]
    assert Grpo().advantages(scored()) == pytest.approx(expected, **FLOAT32)
    assert Grpo().advantages(scored())[4:8] == [0.0] * 4  # all equal: no signal, not NaN


def test_grpo_without_the_std_and_dr_grpo_are_the_centred_reward() -> None:
    expected = [r - statistics.fmean(rewards) for rewards in REWARDS for r in rewards]
    assert Grpo({"normalize_std": False}).advantages(scored()) == pytest.approx(expected, **FLOAT32)
    assert DrGrpo().advantages(scored()) == pytest.approx(expected, **FLOAT32)
    assert DrGrpo.default_loss_aggregation == "seq-mean-token-sum-norm"


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    expected = [r - (sum(rewards) - r) / (len(rewards) - 1) for rewards in REWARDS for r in rewards]
    assert Rloo().advantages(scored()) == pytest.approx(expected, **FLOAT32)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_plus_plus_whitens_discounted_returns_over_every_token(gamma: float) -> None:
    returns = [
        [r * gamma ** (n - 1 - t) for t in range(n)]
        for rewards, lengths in zip(REWARDS, LENGTHS, strict=True)
        for r, n in zip(rewards, lengths, strict=True)
    ]
    expected = whitened([value for sample in returns for value in sample])
    found = ReinforcePlusPlus({"gamma": gamma}).advantages(scored())
    assert [len(a) for a in found] == [n for lengths in LENGTHS for n in lengths]  # one per response token
    assert flat(found) == pytest.approx(expected, **FLOAT32)


def test_reinforce_plus_plus_baseline_whitens_the_group_centred_reward_over_every_token() -> None:
    centred = [
        [r - statistics.fmean(rewards)] * n
        for rewards, lengths in zip(REWARDS, LENGTHS, strict=True)
        for r, n in zip(rewards, lengths, strict=True)
    ]
    expected = whitened([value for sample in centred for value in sample])
    assert flat(ReinforcePlusPlusBaseline().advantages(scored())) == pytest.approx(expected, **FLOAT32)


def test_gspo_takes_grpo_advantages_and_its_sequence_loss() -> None:
    assert Gspo().advantages(scored()) == Grpo().advantages(scored())
    assert (Gspo.default_policy_loss, Gspo.default_loss_aggregation) == ("gspo", "seq-mean-token-mean")


# -- aggregation, KL ---------------------------------------------------------------------------------------------

VALUES = [[0.5, -1.0, 2.0, 9.0], [1.5, 0.25, 9.0, 9.0], [3.0, 3.0, 3.0, 3.0], [-2.0, 4.0, 1.0, 0.5]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
"""Padding (0), a fractional loss-mask entry (0.5) and a sample with no trained token (row 2)."""


def reference_aggregate(mode: str, constant: float) -> float:
    rows = [
        (sum(v * m for v, m in zip(values, mask, strict=True)), sum(mask))
        for values, mask in zip(VALUES, MASK, strict=True)
    ]
    trained = [(total, tokens) for total, tokens in rows if tokens > 0]
    if mode == "token-mean":
        return sum(total for total, _ in trained) / sum(tokens for _, tokens in trained)
    if mode == "seq-mean-token-mean":
        return statistics.fmean(total / tokens for total, tokens in trained)
    if mode == "seq-mean-token-sum":
        return statistics.fmean(total for total, _ in trained)
    return sum(total for total, _ in trained) / (len(trained) * constant)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_each_loss_aggregation_is_its_formula(mode: str) -> None:
    found = aggregate(torch.tensor(VALUES), torch.tensor(MASK), mode, norm_constant=8.0)
    assert float(found) == pytest.approx(reference_aggregate(mode, 8.0), **FLOAT32)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_each_kl_estimator_is_its_formula(estimator: str) -> None:
    policy, reference = [-0.1, -2.0, -0.7, -3.5], [-0.3, -1.2, -0.7, -0.9]
    formulas = {
        "k1": lambda p, q: p - q,
        "k2": lambda p, q: 0.5 * (p - q) ** 2,
        "k3": lambda p, q: math.exp(q - p) - (q - p) - 1,
    }
    found = kl_per_token(torch.tensor(policy), torch.tensor(reference), estimator)
    expected = [formulas[estimator](p, q) for p, q in zip(policy, reference, strict=True)]
    assert found.tolist() == pytest.approx(expected, **FLOAT32)


# -- policy losses -------------------------------------------------------------------------------------------------


def micro_batch(seed: int = 0, *, per_token: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 0.5, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
    shape = mask.shape
    advantages = torch.randn(shape if per_token else shape[:1], generator=generator)
    return {
        "response_mask": mask,
        "rollout_logprobs": -torch.rand(shape, generator=generator) * 2,
        "advantages": advantages,
    }


@pytest.mark.parametrize("tis_clip", [None, 2.0])
def test_grpo_objective_is_todays_loss_bit_for_bit(tis_clip: float | None) -> None:
    """``ppo_clip``, ``token-mean`` and ``k3``, with the KL and entropy terms, with and without TIS: the same numbers
    and the same gradients as the single loss function every trainer called before (policy_loss, kl_k3,
    masked_mean)."""
    train = TrainSection(kl_coef=0.1, entropy_coef=0.01, tis_clip=tis_clip, clip_eps_high=0.28)
    tensors = micro_batch(1)
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(3))
    reference = torch.log_softmax(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(4)), -1)
    ref_logprobs = reference.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old = tensors["rollout_logprobs"] + 0.05 if tis_clip else None

    def today(leaf: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(leaf, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss, _ = policy_loss(
            logprobs,
            tensors["rollout_logprobs"],
            tensors["advantages"],
            tensors["response_mask"],
            clip_eps=train.clip_eps,
            clip_eps_high=train.clip_eps_high,
            tis_clip=tis_clip,
            old_logprobs=old,
        )
        kl = kl_k3(logprobs, ref_logprobs, tensors["response_mask"])
        mean_entropy = masked_mean(entropy(leaf), tensors["response_mask"])
        return loss + train.kl_coef * kl - train.entropy_coef * mean_entropy

    def now(leaf: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(leaf, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        total, _ = Objective(train=train, policy_loss=PpoClip()).loss(
            logprobs, tensors, token_entropy=entropy(leaf), ref_logprobs=ref_logprobs, old_logprobs=old
        )
        return total

    before, after = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    expected, found = today(before), now(after)
    expected.backward()
    found.backward()
    assert torch.equal(found, expected) and torch.equal(after.grad, before.grad)


def test_gspo_loss_clips_the_sequence_ratio_and_has_gspos_gradient() -> None:
    """Sample i's ratio is ``s_i = exp(mean_t(log p - log p_old))``; with ``seq-mean-token-mean`` the loss is
    ``-mean_i min(s_i A_i, clip(s_i) A_i)`` and its gradient in ``log p_it`` is ``-A_i s_i / |y_i| / N`` where
    ``s_i`` is inside the clip range (0 where the clipped term is the minimum)."""
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0], [-0.2, -0.4, -0.6, -0.8]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    shift = torch.tensor([[0.01, -0.02, 0.04, 5.0], [0.5, 0.5, 0.0, 0.0], [-0.003, 0.001, 0.0, 0.002]])
    advantages = torch.tensor([1.0, 1.0, -0.5])  # sample 1: s = e^0.5, far above 1 + eps with A > 0: clipped
    logprobs = (old + shift).requires_grad_()
    train = TrainSection()
    objective = Objective(
        train=train, policy_loss=GspoLoss({"clip_eps": 0.2, "clip_eps_high": 0.2}), aggregation="seq-mean-token-mean"
    )
    total, metrics = objective.loss(
        logprobs,
        {"response_mask": mask, "rollout_logprobs": old, "advantages": advantages},
        token_entropy=torch.zeros_like(old),
    )
    total.backward()
    losses, gradient = [], torch.zeros_like(old)
    for i in range(3):
        tokens = [t for t in range(4) if mask[i, t] > 0]
        s = math.exp(statistics.fmean(float(shift[i, t]) for t in tokens))
        a = float(advantages[i])
        clipped = min(max(s, 0.8), 1.2)
        losses.append(-min(s * a, clipped * a))
        if s * a <= clipped * a:  # the unclipped term is the minimum: it carries the gradient
            for t in tokens:
                gradient[i, t] = -a * s / len(tokens) / 3
    assert float(total.detach()) == pytest.approx(statistics.fmean(losses), **FLOAT32)
    torch.testing.assert_close(logprobs.grad, gradient, rtol=1e-6, atol=1e-7)
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / 9)  # sample 1's two tokens of nine trained


def test_per_token_advantages_line_up_with_the_response_tokens() -> None:
    batch = TrainBatch(
        [
            TrainSample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], (0.5, -1.0, 2.0), 1.0),
            TrainSample([1, 2, 3], [4], [-0.4], (3.0,), 0.0),
        ]
    )
    tensors = batch.tensors()
    assert tensors["advantages"].tolist() == [[0.0, 0.5, -1.0, 2.0], [0.0, 0.0, 3.0, 0.0]]
    assert tensors["response_mask"].tolist() == [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="2 token advantages; a per-token advantage needs one per response token"):
        TrainSample([1], [2, 3, 4], [0.0] * 3, (1.0, 2.0), 0.0)


# -- the step: shares and mini-batches -----------------------------------------------------------------------------


def batch_of(count: int) -> TrainBatch:
    return TrainBatch(
        [TrainSample([1, 2], [3] * (1 + i % 3), [-1.0] * (1 + i % 3), float(i % 2) - 0.5, 0.0) for i in range(count)]
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_shares_add_up_to_the_whole_step(mode: str) -> None:
    batch = batch_of(7)
    objective = Objective(train=TrainSection(), policy_loss=PpoClip(), aggregation=mode)
    shape = StepShape.of(batch)
    shares = [objective.weight(micro.tensors()["response_mask"], shape) for micro in batch.micro_batches(3)]
    assert sum(shares) == pytest.approx(1.0, rel=1e-12)


def test_mini_batches_split_the_batch_in_order() -> None:
    batch = batch_of(7)
    parts = mini_batches(batch, 3)
    assert [len(part) for part in parts] == [3, 2, 2]
    assert [s for part in parts for s in part.samples] == batch.samples
    assert len(mini_batches(batch, 50)) == 7  # at most one per sample


def test_two_mini_batches_are_two_optimizer_steps_in_turn() -> None:
    """``mini_batches_per_rollout=2``: the same weights as two one-step updates on each half in turn."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    batch = batch_of(8)
    split = TorchTrainer(copy.deepcopy(model), TrainSection(mini_batches_per_rollout=2, lr=1e-2))
    in_turn = TorchTrainer(copy.deepcopy(model), TrainSection(lr=1e-2))
    metrics = split.train_step(batch)
    in_turn.train_step(TrainBatch(batch.samples[:4]))
    in_turn.train_step(TrainBatch(batch.samples[4:]))
    assert metrics["optimizer_steps"] == 2.0 and split.step == 1
    for (name, found), (_, expected) in zip(
        split.model.named_parameters(), in_turn.model.named_parameters(), strict=True
    ):
        assert torch.equal(found, expected), name


# -- registries and settings ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})


def refused(manager: MilesPluginManager, **overrides) -> str:
    with pytest.raises(ConfigError) as error:
        build_config(manager, overrides=overrides)
    return str(error.value)


def test_the_registries_hold_the_built_ins(manager: MilesPluginManager) -> None:
    registries = manager.registries
    assert sorted(registries.advantage_estimators) == [
        "dr_grpo",
        "grpo",
        "gspo",
        "ppo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "rloo",
    ]
    assert sorted(registries.policy_losses) == ["gspo", "ppo_clip"]
    choice = choose_algorithm(TrainSection(), registries, group_size=8, max_new_tokens=8)
    assert choice.describe() == "grpo advantages, ppo_clip loss, token-mean"
    gspo = choose_algorithm(TrainSection(advantage_estimator="gspo"), registries, group_size=8, max_new_tokens=8)
    assert gspo.describe() == "gspo advantages, gspo loss, seq-mean-token-mean"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"train.advantage_estimator": "grpp"},
            "train.advantage_estimator (--train-advantage-estimator) = 'grpp': unknown advantage estimator 'grpp'; "
            "available: dr_grpo, grpo, gspo, ppo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo "
            "(closest: grpo",
        ),
        (
            {"train.policy_loss": "ppo"},
            "train.policy_loss (--train-policy-loss) = 'ppo': unknown policy loss 'ppo'; available: gspo, ppo_clip "
            "(closest: gspo, ppo_clip)",
        ),
        (
            {"rollout.group_size": 1},
            "train.advantage_estimator (--train-advantage-estimator) = 'grpo' needs groups of at least 2 samples",
        ),
        (
            {"rollout.group_size": 1, "train.advantage_estimator": "rloo"},
            "= 'rloo' needs groups of at least 2 samples (its baseline comes from the other samples of a prompt); "
            "rollout.group_size (--rollout-group-size) is 1",
        ),
        (
            {"train.advantage_estimator": "reinforce_plus_plus", "train.advantage_estimator_settings": {"gamma": 1.5}},
            "reinforce_plus_plus setting gamma = 1.5: expected a number of at least 0.0 and of at most 1.0",
        ),
        (
            {"train.advantage_estimator": "reinforce_plus_plus", "train.advantage_estimator_settings": {"gamma": -0.1}},
            "reinforce_plus_plus setting gamma = -0.1: expected a number",
        ),
        (
            {"train.advantage_estimator_settings": {"normalize_std": "no"}},
            'train.advantage_estimator_settings (--train-advantage-estimator-settings) {"normalize_std": "no"} do '
            "not fit the advantage estimator 'grpo'",
        ),
        (
            {"train.advantage_estimator_settings": {"normalise_std": False}},
            "grpo has no setting 'normalise_std' (did you mean 'normalize_std'?)",
        ),
        (
            {"train.policy_loss": "gspo", "train.policy_loss_settings": {"clip_eps": True}},
            "gspo setting clip_eps = True: expected a number above 0 (a boolean is not a number)",
        ),
        (
            {"train.kl_placement": "reward", "train.kl_coef": 0.1},
            "train.kl_placement (--train-kl-placement) = 'reward' needs an estimator that takes a reward per token "
            "(ppo, reinforce_plus_plus); 'grpo' takes one reward per sample",
        ),
        (
            {"train.kl_placement": "reward", "train.advantage_estimator": "ppo", "train.kl_coef": 0},
            "subtracts kl_coef x KL from each token's reward, and train.kl_coef is 0: set it",
        ),
        (
            {"train.normalize_advantages": False},
            "--train-advantage-estimator-settings '{\"normalize_std\": false}', or --train-advantage-estimator dr_grpo",
        ),
    ],
)
def test_bad_algorithm_settings_are_refused_when_the_config_is_built(
    manager: MilesPluginManager, overrides: dict, message: str
) -> None:
    assert message in refused(manager, **overrides)


# -- ppo: GAE and the critic ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("gamma", "lambd"), [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_gae_is_its_recursion(gamma: float, lambd: float) -> None:
    """``delta_t = r_t + gamma V_{t+1} - V_t`` (the reward at the last token, V after it 0),
    ``A_t = sum_l (gamma lambda)^l delta_{t+l}``, returns ``A_t + V_t``; written here as the sum, not the recursion."""
    from miles_core.builtin.algorithms import gae

    values = [0.1, -0.3, 0.25, 0.5]
    rewards = [-0.01, 0.02, 0.0, 0.7]  # a KL penalty on each token, the reward at the last
    following = [*values[1:], 0.0]
    deltas = [r + gamma * v_next - v for r, v, v_next in zip(rewards, values, following, strict=True)]
    expected = [sum((gamma * lambd) ** (k - t) * deltas[k] for k in range(t, 4)) for t in range(4)]
    advantages, returns = gae(torch.tensor(rewards), torch.tensor(values), gamma=gamma, lambd=lambd)
    assert advantages.tolist() == pytest.approx(expected, **FLOAT32)
    assert returns.tolist() == pytest.approx([a + v for a, v in zip(expected, values, strict=True)], **FLOAT32)


def test_ppo_whitens_gae_over_the_batch() -> None:
    from miles_core.builtin.algorithms import Ppo, gae

    values = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([-0.5]), torch.tensor([0.0, 0.4])]
    rewards = [torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.0]), torch.tensor([0.0, 0.5])]
    raw = [gae(r, v, gamma=1.0, lambd=0.95)[0].tolist() for r, v in zip(rewards, values, strict=True)]
    expected = whitened([value for sample in raw for value in sample])
    advantages, returns = Ppo({"lambd": 0.95}).token_advantages(rewards, values)
    assert [value for a in advantages for value in a.tolist()] == pytest.approx(expected, **FLOAT32)
    assert [len(r) for r in returns] == [3, 1, 2]
    assert Ppo.needs_critic and not Grpo.needs_critic


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_in_the_trainer_is_its_driver_formula_plus_the_kl_per_token(gamma: float) -> None:
    """With the KL in the reward the trainer gives each token ``r_t = -kl_coef * KL_t`` (plus the reward at the last
    token) and the estimator whitens ``G_t = sum_k gamma^(k - t) r_k``; with no KL that is the driver's formula."""
    estimator = ReinforcePlusPlus({"gamma": gamma})
    lengths = [n for group in LENGTHS for n in group]
    rewards = [r for group in REWARDS for r in group]
    last_only = [torch.tensor([0.0] * (n - 1) + [r]) for r, n in zip(rewards, lengths, strict=True)]
    advantages, _ = estimator.token_advantages(last_only, None)
    assert [v for a in advantages for v in a.tolist()] == pytest.approx(flat(estimator.advantages(scored())), **FLOAT32)
    penalties = [[0.01 * (t + 1) for t in range(n)] for n in lengths]
    token_rewards = [
        [-p + (r if t == n - 1 else 0.0) for t, p in enumerate(penalty)]
        for r, n, penalty in zip(rewards, lengths, penalties, strict=True)
    ]
    returns = [
        [sum(gamma ** (k - t) * rs[k] for k in range(t, len(rs))) for t in range(len(rs))] for rs in token_rewards
    ]
    expected = whitened([v for sample in returns for v in sample])
    advantages, _ = estimator.token_advantages([torch.tensor(rs) for rs in token_rewards], None)
    assert [v for a in advantages for v in a.tolist()] == pytest.approx(expected, **FLOAT32)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lambd": 1.01}, "ppo setting lambd = 1.01: expected a number of at least 0.0 and of at most 1.0"),
        ({"gamma": -1}, "ppo setting gamma = -1: expected a number of at least 0.0 and of at most 1.0"),
        ({"critic_lr": "fast"}, "ppo setting critic_lr = 'fast': expected a number"),
        ({"lamda": 0.9}, "ppo has no setting 'lamda' (did you mean 'lambd'?)"),
    ],
)
def test_bad_ppo_settings_are_refused_when_the_config_is_built(
    manager: MilesPluginManager, settings: dict, message: str
) -> None:
    text = refused(manager, **{"train.advantage_estimator": "ppo", "train.advantage_estimator_settings": settings})
    assert message in text


def test_megatron_trains_a_critic_of_the_policys_architecture_only(tmp_path) -> None:
    """ppo builds under the megatron trainer, with the KL in the loss or in the reward; a ``critic_model`` of another
    architecture is refused when the config is built, naming the setting that differs."""
    manager = MilesPluginManager.load()  # with miles-plugins-megatron's entry point
    policy, other = tmp_path / "policy", tmp_path / "other"
    transformers.AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(policy)
    transformers.AutoModelForCausalLM.from_config(tiny_llama_config(hidden_size=96)).save_pretrained(other)
    megatron_ppo = {"train.backend": "megatron", "train.advantage_estimator": "ppo", "model.path": str(policy)}
    assert build_config(manager, overrides=megatron_ppo).train.advantage_estimator == "ppo"
    same = {"train.advantage_estimator_settings": {"critic_model": str(policy)}}
    assert build_config(manager, overrides={**megatron_ppo, **same}).train.advantage_estimator == "ppo"
    text = refused(manager, **megatron_ppo, **{"train.advantage_estimator_settings": {"critic_model": str(other)}})
    assert f"critic_model = {str(other)!r}: its hidden_size 96 (the policy's: " in text
    assert "the megatron critic is built from the policy's architecture" in text
    in_reward = build_config(manager, overrides={**megatron_ppo, "train.kl_placement": "reward", "train.kl_coef": 0.1})
    assert in_reward.train.kl_placement == "reward"


def test_a_critic_checkpoint_of_another_vocabulary_is_refused(tmp_path) -> None:
    from miles_core.builtin.critic import load_value_model

    config = tiny_llama_config()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(
        ConfigError, match=r"its vocabulary has \d+ tokens, the policy's 7; the critic reads the policy's"
    ):
        load_value_model(tmp_path, vocab_size=7, what="train.advantage_estimator_settings.critic_model")
    critic = load_value_model(tmp_path, vocab_size=config.vocab_size, what="the policy")
    values = critic(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert values.shape == (1, 3, 1) and torch.equal(values, torch.zeros_like(values))  # the head starts at 0


def ppo_trainer(path) -> TorchTrainer:
    from miles_core.builtin.algorithms import Ppo
    from miles_core.builtin.critic import Critic, load_value_model

    settings = TrainSection(lr=1e-2)
    estimator = Ppo({"critic_lr": 1e-2})
    critic = Critic(load_value_model(path, vocab_size=64, what="the policy"), estimator.settings, settings)
    objective = Objective(train=settings, policy_loss=PpoClip(), estimator=estimator)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return TorchTrainer(model, settings, objective=objective, critic=critic)


def rewarded_batch(seed: int) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(6):
        response = torch.randint(3, 64, (2 + i % 3,), generator=generator).tolist()
        logprobs = (-torch.rand(len(response), generator=generator) - 1).tolist()
        samples.append(TrainSample([2, 5 + i], response, logprobs, 0.0, float(i % 2)))
    return TrainBatch(samples)


def test_a_resumed_ppo_run_continues_with_the_same_critic(tmp_path) -> None:
    """Two steps, a checkpoint, a third step; against a trainer resumed from that checkpoint taking the third step:
    the same actor and the same critic, weight for weight (the checkpoint holds the critic and its optimizer)."""
    config = tiny_llama_config()
    assert config.vocab_size == 64
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "initial")
    whole = ppo_trainer(tmp_path / "initial")
    for seed in (1, 2):
        metrics = whole.train_step(rewarded_batch(seed))
    assert {"critic/value_loss", "critic/explained_variance", "critic/value_mean", "critic/return_mean"} <= set(metrics)
    whole.save_checkpoint(tmp_path / "step_2")
    assert (tmp_path / "step_2" / "critic" / "optimizer.pt").is_file()
    resumed = ppo_trainer(tmp_path / "initial")
    resumed.load_checkpoint(tmp_path / "step_2")
    whole.train_step(rewarded_batch(3))
    resumed.train_step(rewarded_batch(3))
    pairs = {"actor": (resumed.model, whole.model), "critic": (resumed.critic.model, whole.critic.model)}
    for part, (found, expected) in pairs.items():
        found_parameters = dict(found.named_parameters())
        for name, tensor in expected.named_parameters():
            assert torch.equal(found_parameters[name], tensor), (part, name)
    fresh = ppo_trainer(tmp_path / "initial")  # and the critic did move: a fresh one differs
    assert not all(
        torch.equal(a, b) for a, b in zip(fresh.critic.model.parameters(), whole.critic.model.parameters(), strict=True)
    )


def test_the_example_third_party_estimator_registers_through_its_entry_point() -> None:
    """plugins/miles_example_estimator (installed, as make setup and CI's wheel stage install it): ``opo``, the
    length-weighted group baseline ``r_i - sum(l_j r_j) / sum(l_j)``, times its ``scale`` setting."""
    registries = MilesPluginManager.load().registries
    entry = registries.advantage_estimators["opo"]
    assert entry.provider == "example-estimator"
    opo = entry.load()({"scale": 2.0})
    expected = []
    for rewards, lengths in zip(REWARDS, LENGTHS, strict=True):
        baseline = sum(r * n for r, n in zip(rewards, lengths, strict=True)) / sum(lengths)
        expected += [2.0 * (r - baseline) for r in rewards]
    assert opo.advantages(scored()) == pytest.approx(expected, **FLOAT32)
    choice = choose_algorithm(
        TrainSection(advantage_estimator="opo", advantage_estimator_settings={"scale": 2.0}),
        registries,
        group_size=4,
        max_new_tokens=8,
    )
    assert choice.describe() == "opo advantages, ppo_clip loss, token-mean"
