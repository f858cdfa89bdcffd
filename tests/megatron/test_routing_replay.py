"""Routing replay on megatron-core's MoE layers (in process, and through the ranks at DP=2 x EP=2 and TP=2 with
sequence parallelism; Qwen3-MoE and DeepSeek-V3): every token goes to the recorded experts
(captured from the routing map each ``TopKRouter`` hands the dispatcher), the logits then equal transformers' under
the same replayed routing, tokens without recorded routing route themselves, and bad routing is refused.

Tolerance 1e-5, as in tests/megatron/test_moe.py: both sides in float32, different summation orders (measured
differences there 5e-7 to 1.4e-6), while a token sent to a wrong expert moves its logits by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.engines.routed_experts import NOT_ROUTED, RoutedExpertsError
from miles_core.models import moe_routing
from tests.megatron.test_moe import TOLERANCE, input_ids, perturbed_moe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models():
    """transformers' tiny Qwen3-MoE (4 experts, top-2, 2 layers) and megatron-core's GPT with its weights."""
    from miles_plugins_megatron.causal_lm import ensure_single_rank_parallel_state
    from miles_plugins_megatron.cpu_compat import causal_mask

    from miles_plugins_megatron import conversion, model, routing_replay

    ensure_single_rank_parallel_state()
    reference = perturbed_moe(norm_topk_prob=True)
    gpt = model.build_gpt_model(reference.config).eval()
    gpt.load_state_dict(conversion.hf_to_megatron(reference.state_dict(), reference.config), strict=False)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return gpt(input_ids=ids, position_ids=positions, attention_mask=causal_mask(ids.shape[1]))

    return reference, gpt, forward, routing_replay


def recorded_routing(ids: torch.Tensor) -> torch.Tensor:
    """Distinct random experts for every token and layer, ``[B, T, 2, 2]``; the last token of each row unrecorded."""
    generator = torch.Generator().manual_seed(7)
    experts = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(ids.numel() * 2)]).reshape(
        *ids.shape, 2, 2
    )
    experts[:, -1] = NOT_ROUTED
    return experts


def used_experts(gpt: torch.nn.Module, routing_replay) -> tuple[dict[int, torch.Tensor], list]:
    """The routing map ``[S*B, experts]`` each router handed the dispatcher in the latest forward, by layer."""
    used: dict[int, torch.Tensor] = {}
    hooks = [
        router.register_forward_hook(lambda m, a, out, layer=layer: used.__setitem__(layer, out[1].clone()))
        for layer, router in routing_replay.routers_by_layer(gpt).items()
    ]
    return used, hooks


def test_with_replay_every_recorded_token_uses_its_experts_and_the_logits_equal_transformers(models) -> None:
    reference, gpt, forward, routing_replay = models
    ids = input_ids()
    experts = recorded_routing(ids)
    used, hooks = used_experts(gpt, routing_replay)
    with torch.no_grad():
        plain = forward(ids)
        own = {layer: m.clone() for layer, m in used.items()}
        with routing_replay.replay_routing(gpt, experts):
            replayed = forward(ids)
        with moe_routing.replay_routing(reference, experts):
            expected = reference(ids).logits
    for hook in hooks:
        hook.remove()
    batch, length = ids.shape
    for layer, routing_map in used.items():
        chosen = routing_map.reshape(length, batch, -1).transpose(0, 1)  # megatron's [S, B] token order
        wanted = torch.zeros_like(chosen).scatter(-1, experts[:, :, layer].clamp(min=0), True)
        assert torch.equal(chosen[:, :-1], wanted[:, :-1])  # every recorded token, every layer
        own_map = own[layer].reshape(length, batch, -1).transpose(0, 1)
        assert torch.equal(chosen[:, -1], own_map[:, -1])  # the unrecorded last token routed itself
    assert (replayed - expected).abs().max().item() < TOLERANCE
    assert (replayed - plain).abs().max().item() > 1e-2  # the random routing is not the model's own


def test_replay_is_off_after_the_block_and_bad_routing_is_refused(models) -> None:
    _, gpt, forward, routing_replay = models
    ids = input_ids()
    with torch.no_grad():
        before = forward(ids)
        with routing_replay.replay_routing(gpt, recorded_routing(ids)):
            forward(ids)
        assert torch.equal(forward(ids), before)
    bad = recorded_routing(ids)
    bad[0, 0, 1, 0] = 4
    out_of_range = "expert id 4 is out of range: this model's experts are 0 to 3"
    with pytest.raises(RoutedExpertsError, match=out_of_range), routing_replay.replay_routing(gpt, bad):
        pass
    wrong_top_k = recorded_routing(ids)[..., :1]
    with (
        pytest.raises(RoutedExpertsError, match="the model needs \\[batch, tokens, layers >= 2, 2\\]"),
        routing_replay.replay_routing(gpt, wrong_top_k),
    ):
        pass


@pytest.mark.parametrize(
    "layout",
    [{"data_parallel": 2, "expert_parallel": 2}, {"tensor_parallel": 2}],
    ids=["dp2-ep2", "tp2-sequence-parallel"],
)
def test_replayed_logits_of_parallel_ranks_equal_transformers(models, tmp_path, layout: dict) -> None:
    """Across ranks: with the experts split over two ranks, or every tensor and the sequence split over two (each
    rank's routers then see half of the tokens, 11 padded to 12), the recorded routing replays as transformers'."""
    from tests.megatron.test_megatron_trainer import launch

    reference = models[0]
    reference.save_pretrained(tmp_path / "model")
    ids = input_ids()
    experts = recorded_routing(ids)
    with torch.no_grad(), moe_routing.replay_routing(reference, experts):
        expected = reference(ids).logits
    with launch(tmp_path / "model", tmp_path, **layout) as trainer:
        replayed, plain = trainer.logits(ids, experts), trainer.logits(ids)
    assert (replayed - expected).abs().max().item() < TOLERANCE
    assert (replayed - plain).abs().max().item() > 1e-2  # the random routing is not the model's own


def test_deepseek_v3_replays_in_process_and_under_sequence_parallelism(models, tmp_path) -> None:
    """DeepSeek-V3's sigmoid router with a selection bias and a group limit: a recorded choice skips both, and the
    weights are the sigmoid scores at the recorded experts, renormalised and scaled, in megatron-core as in
    transformers (its dense first layer has no router, so only layer 1's recorded experts apply)."""
    from miles_plugins_megatron.cpu_compat import causal_mask

    from miles_plugins_megatron import conversion, model
    from tests.megatron.test_deepseek_v3 import perturbed_dsv3
    from tests.megatron.test_megatron_trainer import launch

    routing_replay = models[3]
    reference = perturbed_dsv3()
    gpt = model.build_gpt_model(reference.config).eval()
    gpt.load_state_dict(conversion.hf_to_megatron(reference.state_dict(), reference.config), strict=False)
    reference.save_pretrained(tmp_path / "model")
    ids = input_ids() % reference.config.vocab_size
    experts = recorded_routing(ids)
    with torch.no_grad():
        with moe_routing.replay_routing(reference, experts):
            expected = reference(ids).logits
        plain = reference(ids).logits
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        with routing_replay.replay_routing(gpt, experts):
            in_process = gpt(input_ids=ids, position_ids=positions, attention_mask=causal_mask(ids.shape[1]))
    with launch(tmp_path / "model", tmp_path, tensor_parallel=2) as trainer:
        ranks = trainer.logits(ids, experts)
    assert (in_process - expected).abs().max().item() < TOLERANCE
    assert (ranks - expected).abs().max().item() < TOLERANCE
    assert (expected - plain).abs().max().item() > 1e-2  # the random routing is not the model's own
