"""``--train-reset-optimizer-states``: the reset dispatched on each leaf optimizer's class through chains and
wrappers (master parameters untouched), unknown optimizers refused, and the torch trainer's step after a reset equal
to a fresh optimizer's first step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers

from miles_core.builtin.torch_trainer import TorchTrainer
from miles_core.config.sections import TrainSection
from miles_core.testkit.tiny_models import tiny_llama_config
from miles_core.training.batch import TrainBatch, TrainSample
from miles_core.training.optimizer import build_optimizer
from miles_core.training.optimizer_reset import (
    OptimizerResetError,
    leaf_optimizers,
    register_optimizer_reset,
    reset_optimizer_states,
)


@dataclass
class FakeChain:
    """Stands in for megatron-core's ``ChainedOptimizer``: optimizers stepped one after the other."""

    chained_optimizers: list[Any]

    def step(self) -> None:
        for optimizer in self.chained_optimizers:
            optimizer.step()


@dataclass
class FakeMixedPrecision:
    """Stands in for megatron-core's mixed-precision wrapper: it holds the fp32 master parameters that the inner
    optimizer steps (as ``Float16OptimizerWithFloat16Params.fp32_from_float16_groups`` does)."""

    optimizer: Any
    master_params: list[torch.Tensor] = field(default_factory=list)

    def step(self) -> None:
        self.optimizer.step()


def master_parameters(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=generator)) for _ in range(3)]


def build_tree(params: list[torch.nn.Parameter]) -> tuple[FakeMixedPrecision, list[torch.optim.Optimizer]]:
    """A wrapper around a chain of an AdamW, an SGD with momentum and damping, and a nested wrapper of an AMSGrad
    Adam, each over one of ``params`` (the master parameters the wrapper holds)."""
    leaves = [
        torch.optim.AdamW([params[0]], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
        torch.optim.SGD([params[1]], lr=0.1, momentum=0.9, dampening=0.5),
        torch.optim.Adam([params[2]], lr=0.01, amsgrad=True),
    ]
    chain = FakeChain([leaves[0], leaves[1], FakeMixedPrecision(leaves[2])])
    return FakeMixedPrecision(chain, master_params=params), leaves


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def step_with_gradients(tree: FakeMixedPrecision, params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    tree.step()


def test_every_leaf_of_a_nested_chain_is_reset_and_master_weights_stay_bitwise() -> None:
    params = master_parameters(0)
    tree, (adamw, sgd, amsgrad) = build_tree(params)
    for seed in (1, 2):
        step_with_gradients(tree, params, seed)
    moments = {key: adamw.state[params[0]][key] for key in ("exp_avg", "exp_avg_sq")}
    assert all(tensor.abs().sum() > 0 for tensor in moments.values())
    assert "momentum_buffer" in sgd.state[params[1]] and amsgrad.state[params[2]]["max_exp_avg_sq"].abs().sum() > 0
    before = [param.detach().clone() for param in tree.master_params]
    groups = [hyperparameters(leaf) for leaf in (adamw, sgd, amsgrad)]

    assert reset_optimizer_states(tree) == 3

    assert all(torch.equal(param, saved) for param, saved in zip(tree.master_params, before, strict=True))
    assert [hyperparameters(leaf) for leaf in (adamw, sgd, amsgrad)] == groups  # learning rates, betas untouched
    for optimizer, param in ((adamw, params[0]), (amsgrad, params[2])):
        state = optimizer.state[param]
        assert state["step"].item() == 0
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                assert not state[key].any(), key
    assert all(adamw.state[params[0]][key] is tensor for key, tensor in moments.items())  # zeroed in place
    assert "momentum_buffer" not in sgd.state[params[1]]


def test_the_step_after_a_reset_is_a_fresh_optimizer_s_first_step() -> None:
    """After the reset every leaf steps exactly as a newly built one from the same weights (bitwise: the same
    kernels on the same numbers); SGD's dropped buffer matters here, as zeros would damp its first step."""
    params = master_parameters(0)
    tree, _ = build_tree(params)
    step_with_gradients(tree, params, 1)
    reset_optimizer_states(tree)
    fresh_params = [torch.nn.Parameter(param.detach().clone()) for param in params]
    fresh, _ = build_tree(fresh_params)
    step_with_gradients(tree, params, 2)
    step_with_gradients(fresh, fresh_params, 2)
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_params, strict=True))


class Lion(torch.optim.Optimizer):
    """An optimizer class with no reset handler."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})


def test_an_unknown_optimizer_class_is_an_error_naming_it_and_the_known_ones() -> None:
    params = master_parameters(0)
    tree, (adamw, _, _) = build_tree(params)
    step_with_gradients(tree, params, 1)
    tree.optimizer.chained_optimizers.append(Lion([torch.nn.Parameter(torch.zeros(2))]))
    with pytest.raises(OptimizerResetError) as error:
        reset_optimizer_states(tree)
    message = str(error.value)
    assert "class tests.training.test_optimizer_reset.Lion" in message
    assert "torch.optim.adam.Adam, torch.optim.adamw.AdamW, torch.optim.sgd.SGD" in message
    assert "register_optimizer_reset" in message and "--train-reset-optimizer-states" in message
    assert adamw.state[params[0]]["step"].item() == 1  # every class is checked before anything is reset


@pytest.mark.parametrize("node", [object(), "adamw", 3, None], ids=["object", "string", "int", "none"])
def test_anything_that_is_no_optimizer_chain_or_wrapper_is_refused(node: Any) -> None:
    with pytest.raises(OptimizerResetError, match=f"class builtins.{type(node).__qualname__}: the known classes"):
        reset_optimizer_states(FakeChain([node]))


def test_a_subclass_with_state_its_base_handler_does_not_know_is_refused() -> None:
    """A subclass uses its base's handler, but a moment that handler would leave stale is an error."""

    class AdamWithExtraMoment(torch.optim.Adam):
        def step(self, closure: Any = None) -> Any:
            result = super().step(closure)
            for state in self.state.values():
                state["exp_avg_cubed"] = torch.ones(1)
            return result

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = AdamWithExtraMoment([param])
    param.grad = torch.ones(2)
    optimizer.step()
    with pytest.raises(OptimizerResetError, match=r"holds \['exp_avg_cubed'\].*register a handler"):
        reset_optimizer_states(optimizer)
    # registered for the rest of this process (singledispatch has no unregister): harmless, the class is this test's
    register_optimizer_reset(AdamWithExtraMoment, lambda optimizer: optimizer.state.clear())
    assert reset_optimizer_states(optimizer) == 1 and not optimizer.state


def test_a_cycle_or_runaway_nesting_is_refused_and_a_shared_leaf_is_reset_once() -> None:
    params = master_parameters(0)
    tree, leaves = build_tree(params)
    tree.optimizer.chained_optimizers.append(tree)
    with pytest.raises(OptimizerResetError, match="contains itself"):
        reset_optimizer_states(tree)
    deep: Any = leaves[0]
    for _ in range(40):
        deep = FakeMixedPrecision(deep)
    with pytest.raises(OptimizerResetError, match="nested more than 32 levels"):
        reset_optimizer_states(deep)
    shared = FakeChain([leaves[0], FakeMixedPrecision(leaves[0])])
    assert list(leaf_optimizers(shared)) == [leaves[0]]
    assert reset_optimizer_states(FakeChain([])) == 0  # a rank without trainable parameters


def training_batch(seed: int) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(6):
        response = torch.randint(3, 64, (3,), generator=generator).tolist()
        samples.append(TrainSample([2, 5 + index], response, [-2.0, -2.5, -3.0], float(index % 3 - 1), 0.0))
    return TrainBatch(samples)


def torch_trainer(**settings: Any) -> TorchTrainer:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    return TorchTrainer(model, TrainSection(lr=1e-2, **settings))


def test_a_torch_trainer_step_after_a_reset_equals_a_recreated_optimizer_s() -> None:
    resetting = torch_trainer(reset_optimizer_states=True)
    recreated = torch_trainer()
    kept = torch_trainer()
    for trainer in (resetting, recreated, kept):
        trainer.train_step(training_batch(1))
    recreated.optimizer = build_optimizer(recreated.model.parameters(), recreated.settings)
    for trainer in (resetting, recreated, kept):
        trainer.train_step(training_batch(2))
    pairs = list(zip(resetting.model.parameters(), recreated.model.parameters(), kept.model.parameters(), strict=True))
    assert all(torch.equal(reset, fresh) for reset, fresh, _ in pairs)  # same kernels on the same numbers: bitwise
    assert any(not torch.equal(reset, old) for reset, _, old in pairs)  # kept moments step elsewhere
    assert all(not state["exp_avg"].any() for state in resetting.optimizer.state.values())  # checkpoints hold this
