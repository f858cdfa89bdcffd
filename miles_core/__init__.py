"""Miles core: hookspecs, plugin manager, config and CLI of the Miles RL post-training toolkit.

The public API is this flat namespace: plugins import from ``miles_core``, not from its modules. The contracts a
third party programs against are here (:class:`TrainingBackend`, :class:`EngineBackend`,
:class:`WeightTransferProtocol` and its types, :class:`StagingLayout`, :class:`HfWeightIterator`,
:class:`CausalLM`, the worker specs, a rollout's :class:`Sample` and :class:`Group` (what a rollout filter sees),
an engine's typed ``/generate`` request and answer, :class:`SamplingParams` and :class:`GenerateOutput`, a chat
format for the session server, :class:`ChatFormat` with :class:`ChatMessage`, :class:`ToolCall` and
:class:`ChatFormatError`); those that need torch or pydantic are imported on first use, so that ``import miles_core``
stays light (every ``miles`` command imports it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError, EngineError, MilesError, PluginHookError, PluginLoadError, RegistryError
from miles_core.events import EngineInfo, EngineWorker, RouterInfo, TrainerInfo
from miles_core.hookspecs import hookimpl, hookspec
from miles_core.registry import Implementation, model_implementation

if TYPE_CHECKING:
    from miles_core.engines.backend import EngineBackend
    from miles_core.engines.generate_types import GenerateOutput, SamplingParams
    from miles_core.models.causal_lm import CausalLM
    from miles_core.rollout.prompts import Prompt
    from miles_core.rollout.samples import Group, Sample
    from miles_core.rollout.sessions.formats import ChatFormat, ChatFormatError, ChatMessage, ToolCall
    from miles_core.training.backend import TrainingBackend
    from miles_core.training.batch import TrainBatch
    from miles_core.training.weight_iterator import HfWeightIterator
    from miles_core.weight_transfer.protocol import EngineEndpoint, TransferReport, WeightBucket, WeightTransferProtocol
    from miles_core.weight_transfer.staging_layout import StagingLayout
    from miles_core.workers.specs import CommandWorkerSpec, PythonWorkerSpec, WorkerSpec

__version__ = "0.2.0"

_LAZY = {
    "CausalLM": "miles_core.models.causal_lm",
    "ChatFormat": "miles_core.rollout.sessions.formats",
    "ChatFormatError": "miles_core.rollout.sessions.formats",
    "ChatMessage": "miles_core.rollout.sessions.formats",
    "CommandWorkerSpec": "miles_core.workers.specs",
    "EngineBackend": "miles_core.engines.backend",
    "EngineEndpoint": "miles_core.weight_transfer.protocol",
    "GenerateOutput": "miles_core.engines.generate_types",
    "Group": "miles_core.rollout.samples",
    "HfWeightIterator": "miles_core.training.weight_iterator",
    "Prompt": "miles_core.rollout.prompts",
    "PythonWorkerSpec": "miles_core.workers.specs",
    "Sample": "miles_core.rollout.samples",
    "SamplingParams": "miles_core.engines.generate_types",
    "ToolCall": "miles_core.rollout.sessions.formats",
    "StagingLayout": "miles_core.weight_transfer.staging_layout",
    "TrainBatch": "miles_core.training.batch",
    "TrainingBackend": "miles_core.training.backend",
    "TransferReport": "miles_core.weight_transfer.protocol",
    "WeightBucket": "miles_core.weight_transfer.protocol",
    "WeightTransferProtocol": "miles_core.weight_transfer.protocol",
    "WorkerSpec": "miles_core.workers.specs",
}
"""Public names imported on first use, and the module of each."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'miles_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CausalLM",
    "ChatFormat",
    "ChatFormatError",
    "ChatMessage",
    "CommandWorkerSpec",
    "ConfigError",
    "EngineBackend",
    "EngineEndpoint",
    "EngineError",
    "EngineInfo",
    "EngineWorker",
    "GenerateOutput",
    "Group",
    "HfWeightIterator",
    "Implementation",
    "MilesError",
    "PluginHookError",
    "PluginLoadError",
    "Prompt",
    "PythonWorkerSpec",
    "RegistryError",
    "RouterInfo",
    "Sample",
    "SamplingParams",
    "StagingLayout",
    "ToolCall",
    "TrainBatch",
    "TrainerInfo",
    "TrainingBackend",
    "TransferReport",
    "WeightBucket",
    "WeightTransferProtocol",
    "WorkerSpec",
    "__version__",
    "hookimpl",
    "hookspec",
    "model_implementation",
]
