"""Miles' loader inside an SGLang server (``engine_path/miles_sglang_weights.py``), driven as SGLang calls it, in this
environment (it imports only torch): what it loads, what it refuses before writing a parameter, and that it reports
instead of raising (an exception in a custom loader ends SGLang's scheduler)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from miles_plugins_sglang.launch import ENGINE_PATH

from miles_core.weight_transfer.staging_layout import StagingLayout, map_staging_file

spec = importlib.util.spec_from_file_location("miles_sglang_weights", Path(ENGINE_PATH) / "miles_sglang_weights.py")
loader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loader)


class Model(torch.nn.Module):
    """Records what ``load_weights`` was given (copies, as SGLang's loaders copy), or raises on ``fail_on``."""

    def __init__(self, fail_on: str | None = None) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_on = fail_on

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            if name == self.fail_on:
                raise AssertionError("param.size() != loaded_weight.size()")
            self.loaded[name] = tensor.clone()


@pytest.fixture()
def staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "staging"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(loader.STAGING_DIR_ENV, str(directory))
    return directory


def stage(directory: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    layout = StagingLayout.of(tensors)
    path = directory / "miles-staging-1-abc"
    path.write_bytes(bytes(layout.size))
    for view, (_, tensor) in zip(layout.views(map_staging_file(path, layout.size)).values(), tensors, strict=True):
        view.copy_(tensor)
    return {"staging_path": str(path), "buffer_size": layout.size, "layout": layout.to_wire(), "request": "r1"}


def outcome(directory: Path, rank: int = 0) -> dict:
    return json.loads((directory / f"miles-load-r1.tp{rank}.json").read_text())


TENSORS = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.tensor([1.5, -2.0]))]


def test_a_staged_version_is_loaded_and_reported(staging: Path) -> None:
    model = Model()
    loader.load_staged(model, [(json.dumps(stage(staging, TENSORS)), torch.empty(0))])
    result = outcome(staging)
    assert {key: result[key] for key in ("ok", "error", "loaded")} == {"ok": True, "error": None, "loaded": 2}
    assert 0 <= result["seconds"] < 60  # the time SGLang's copy took, for the sender's log
    assert all(torch.equal(model.loaded[name], tensor) for name, tensor in TENSORS)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"staging_path": "/etc/passwd"}, "is not a file of the weight-staging directory"),
        ({"buffer_size": True}, "buffer_size True is not a byte count"),
        ({"buffer_size": 1 << 40}, "is not a regular file of at least"),
        ({"layout": {"tensors": "all"}}, "layout.tensors is not a list"),
    ],
)
def test_a_bad_request_loads_nothing_and_says_why(staging: Path, change: dict, reason: str) -> None:
    model = Model()
    loader.load_staged(model, [(json.dumps({**stage(staging, TENSORS), **change}), torch.empty(0))])
    result = outcome(staging)
    assert result["ok"] is False and reason in result["error"] and result["error"].startswith("refused, nothing")
    assert model.loaded == {}


def test_a_layout_entry_that_does_not_fit_the_file_loads_nothing(staging: Path) -> None:
    spec_ = stage(staging, TENSORS)
    spec_["layout"]["tensors"][1]["offset"] = spec_["buffer_size"]  # b lies beyond the file
    model = Model()
    loader.load_staged(model, [(json.dumps(spec_), torch.empty(0))])
    assert "layout.tensors[1] (b)" in outcome(staging)["error"] and model.loaded == {}


def test_an_error_of_sglangs_loader_is_reported_naming_the_tensor_not_raised(staging: Path) -> None:
    loader.load_staged(Model(fail_on="b"), [(json.dumps(stage(staging, TENSORS)), torch.empty(0))])
    assert outcome(staging)["error"] == "SGLang could not load b: AssertionError: param.size() != loaded_weight.size()"


def test_each_tp_rank_reports_for_itself(staging: Path) -> None:
    spec_ = {**stage(staging, TENSORS), "tp_rank": 1}
    loader.load_staged(Model(), [(json.dumps(spec_), torch.empty(0))])
    assert outcome(staging, rank=1)["ok"] is True and not (staging / "miles-load-r1.tp0.json").exists()


class FusedModel(torch.nn.Module):
    """Parameters as SGLang holds them: a fused projection in bfloat16, a norm, and a router kept in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 12, bias=False, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        self.gate = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.float32))

    def load_weights(self, weights) -> None:
        raise AssertionError("a description loads nothing")


def test_a_describe_request_lists_each_parameters_dtype_and_dimensions_and_loads_nothing(staging: Path) -> None:
    spec_ = {"describe": True, "request": "r1", "tp_rank": 0}
    loader.load_staged(FusedModel(), [(json.dumps(spec_), torch.empty(0))])
    assert outcome(staging) == {
        "ok": True,
        "error": None,
        "parameters": {"norm": ["bfloat16", 1], "gate": ["float32", 2], "qkv_proj.weight": ["bfloat16", 2]},
    }
