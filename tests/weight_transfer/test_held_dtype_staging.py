"""``tensor`` stages each weight matrix in the dtype the engine holds it in (``TensorSettings.held_dtype``): which
tensors :func:`staging_dtypes` narrows for a given engine description, that the staged values are exactly what the
engine's own copy into its parameter would hold (round to nearest even), and the batching helpers of the transfer.
Into a real SGLang server: ``tests/sglang/test_real_sglang.py``."""

from __future__ import annotations

import pytest
import torch

from miles_core.config.build import build_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.weight_transfer.staged_load import staging_dtypes
from miles_core.weight_transfer.staging_layout import StagingLayout
from miles_core.weight_transfer.tensor import TensorProtocol, _copy_into, with_last

BF16, F32 = ("bfloat16", 2), ("float32", 2)
LLAMA_HELD = {  # SGLang's names: q/k/v and gate/up are fused
    "model.embed_tokens.weight": BF16,
    "model.layers.0.self_attn.qkv_proj.weight": BF16,
    "model.layers.0.mlp.gate_up_proj.weight": BF16,
    "model.layers.0.input_layernorm.weight": ("bfloat16", 1),
    "lm_head.weight": BF16,
}
SENT = [
    ("model.embed_tokens.weight", torch.randn(8, 4)),
    ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4)),  # fused by the engine: its matrices' dtype
    ("model.layers.0.input_layernorm.weight", torch.randn(4)),  # a vector: as sent
    ("model.layers.0.rotary.inv_freq", torch.arange(4)),  # not floating: as sent
    ("lm_head.weight", torch.randn(8, 4)),
]


def test_matrices_held_in_bfloat16_are_staged_in_bfloat16_and_vectors_and_integers_as_sent() -> None:
    assert staging_dtypes(SENT, [LLAMA_HELD]) == {
        "model.embed_tokens.weight": torch.bfloat16,
        "model.layers.0.self_attn.q_proj.weight": torch.bfloat16,
        "lm_head.weight": torch.bfloat16,
    }


def test_a_matrix_the_engine_holds_in_float32_stays_float32_and_then_renamed_ones_do_too() -> None:
    """A router kept in float32 (minimax's ``gate``, DeepSeek's with ``router_fp32``): its own name keeps it wide;
    and since the engine's matrices no longer share one dtype, tensors it renames are not narrowed either."""
    held = {**LLAMA_HELD, "model.layers.0.mlp.gate.weight": F32}
    sent = [*SENT, ("model.layers.0.mlp.gate.weight", torch.randn(2, 4))]
    chosen = staging_dtypes(sent, [held])
    assert "model.layers.0.mlp.gate.weight" not in chosen
    assert "model.layers.0.self_attn.q_proj.weight" not in chosen
    assert chosen["model.embed_tokens.weight"] == torch.bfloat16  # named alike: its own dtype


@pytest.mark.parametrize(
    ("engines", "why"),
    [
        ([], "no engine on this machine"),
        ([LLAMA_HELD, {}], "one engine (Miles' local engine) does not describe what it holds"),
        ([LLAMA_HELD, {name: ("float16", dims) for name, (_, dims) in LLAMA_HELD.items()}], "engines disagree"),
        ([{name: ("float32", dims) for name, (_, dims) in LLAMA_HELD.items()}], "held in float32"),
        ([{name: ("float8_e4m3fn", dims) for name, (_, dims) in LLAMA_HELD.items()}], "quantized: the engine's"),
    ],
)
def test_nothing_is_narrowed_unless_every_engine_loading_the_file_holds_it_narrower(engines, why) -> None:
    assert staging_dtypes(SENT, engines) == {}, why


def test_a_tensor_already_narrow_is_not_cast_again() -> None:
    sent = [("model.embed_tokens.weight", torch.randn(8, 4, dtype=torch.bfloat16))]
    assert staging_dtypes(sent, [LLAMA_HELD]) == {}


def test_staged_values_are_the_senders_rounded_as_the_engines_copy_rounds_them() -> None:
    """The staging copy casts; SGLang's loader copies into a bfloat16 parameter the same way (``copy_``): equal bits,
    including values half-way between two bfloat16 numbers (ties to even) and ones beyond its range of exact ints."""
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e38, 1e-40]).reshape(1, 5)
    sent = [("a", torch.randn(64, 33)), ("b", halfway), ("c", torch.randn(7))]
    layout = StagingLayout.of(sent, dtypes=staging_dtypes(sent, [{"a": BF16, "b": BF16, "c": ("bfloat16", 1)}]))
    assert [entry.dtype for entry in layout.tensors] == ["bfloat16", "bfloat16", "float32"]
    buffer = torch.zeros(layout.size, dtype=torch.uint8)
    _copy_into(buffer, layout, sent)
    views = layout.views(buffer)
    for name, tensor in sent:
        engine_parameter = torch.empty(tensor.shape, dtype=views[name].dtype)
        engine_parameter.copy_(tensor)  # what the engine's load would hold from the full-width tensor
        bits = torch.int16 if engine_parameter.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(views[name].view(bits), engine_parameter.view(bits))
    assert layout.tensors[0].nbytes == 64 * 33 * 2  # half the bytes of the sender's float32


def test_with_last_marks_only_the_last_item() -> None:
    assert list(with_last(iter("abc"))) == [("a", False), ("b", False), ("c", True)]
    assert list(with_last(iter([]))) == []
    assert list(with_last(iter([None]))) == [(None, True)]  # an item that is None is an item


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"staging_mb": 0}, "tensor setting staging_mb = 0: expected"),
        ({"staging_mb": "big"}, "tensor setting staging_mb = 'big': expected"),
        ({"held_dtype": "yes"}, "tensor setting held_dtype = 'yes': expected true or false"),
    ],
)
def test_held_dtype_and_staging_mb_are_checked_when_the_config_is_built(settings: dict, error: str) -> None:
    manager = MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})
    with pytest.raises(ConfigError, match=error):
        build_config(manager, overrides={"weight_transfer.mode": "tensor", "weight_transfer.settings": settings})
    assert TensorProtocol(held_dtype=False, staging_mb=0.5).settings.staging_mb == 0.5
