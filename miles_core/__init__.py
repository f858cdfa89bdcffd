"""Miles core: the plugin API of the Miles RL post-training toolkit, as one flat namespace.

This module is the contract for plugin authors: a plugin (the first-party ``miles_plugins_*`` distributions, the
examples in ``plugins/``, a third party's package) imports from ``miles_core`` and nothing deeper, and
``tests/test_plugin_api_boundary.py`` holds every first-party plugin to that. What it holds, by kind:

* **hooks and registries**: :func:`hookimpl` (the marker of a hook implementation; the hooks themselves are
  documented in :mod:`miles_core.hookspecs`), :class:`Implementation` and :func:`model_implementation`;
* **backends**: :class:`TrainingBackend`, :class:`EngineBackend`, :class:`CausalLM`, :class:`HfWeightIterator`,
  the :class:`TrainBatch` a trainer trains on, and the losses and optimizer helpers the torch trainer uses;
* **weight-transfer protocols**: :class:`WeightTransferProtocol` and its types, :class:`ProtocolSettings` (the base
  of the settings model a protocol declares), the weight holders of the trainer ranks, and the ``disk`` protocol's
  shard writer (a trainer's checkpoint uses it);
* **wire formats** both ends of a weight transfer read: :class:`StagingLayout` and the weight digests;
* **workers and providers**: the worker specs, :class:`WorkerHandle`, :func:`rpc_method`, the local provider, and
  the node address and rendezvous helpers of collectives;
* **config sections**: :class:`MilesConfig` (the core's sections as typed fields; a plugin reads its own with
  :meth:`MilesConfig.section`) and :class:`Section`, the base of a plugin's section;
* **value types**: a rollout's :class:`Sample` and :class:`Group`, an engine's :class:`SamplingParams` and
  :class:`GenerateOutput`, the session server's :class:`ChatFormat` and its messages, the typed run events;
* **errors**: :class:`MilesError` and its kinds;
* **test kit**: :class:`ProtocolContract`, the contract tests a protocol's package runs against its protocol.

Names that need torch or pydantic are imported on first use, so that ``import miles_core`` stays light (every
``miles`` command imports it). The site's plugin API page (``docs/reference/plugin-api.md``) renders every name
with its docstring.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError, EngineError, MilesError, PluginHookError, PluginLoadError, RegistryError
from miles_core.events import EngineInfo, EngineWorker, RouterInfo, TrainerInfo
from miles_core.hookspecs import hookimpl, hookspec
from miles_core.registry import Implementation, model_implementation

if TYPE_CHECKING:
    from miles_core.bounds import (
        MAX_BUFFER_MB,
        MAX_KEPT_VERSIONS,
        MAX_LANES,
        at_most_memory_share,
        at_most_per_cpu,
    )
    from miles_core.config.build import MilesConfig
    from miles_core.config.section import Section
    from miles_core.config.sections import TrainSection
    from miles_core.distributed import reserve_rendezvous, tcp_init_method_address, tcp_store
    from miles_core.engines.backend import EngineBackend
    from miles_core.engines.client import EngineClient
    from miles_core.engines.generate_types import GenerateOutput, SamplingParams
    from miles_core.engines.routed_experts import NOT_ROUTED, RoutedExpertsError, check_replayable
    from miles_core.engines.staging import STAGING_DIR_ENV, remove_orphan_files, weight_staging_dir
    from miles_core.models.causal_lm import CausalLM
    from miles_core.models.checkpoint_dir import checkpoint_family, read_model_config, require_checkpoint_dir
    from miles_core.models.hf_checkpoint import checkpoint_named_tensors, copy_tokenizer_files
    from miles_core.models.selection import DSV4_FAMILY
    from miles_core.rollout.prompts import Prompt
    from miles_core.rollout.samples import Group, Sample
    from miles_core.rollout.sessions.formats import ChatFormat, ChatFormatError, ChatMessage, ToolCall
    from miles_core.testkit.protocol_contract import ProtocolContract
    from miles_core.training.algorithms import (
        AdvantageEstimator,
        AlgorithmSettings,
        PolicyLoss,
        ScoredSample,
        choose_algorithm,
        trainer_side,
    )
    from miles_core.training.backend import TrainingBackend
    from miles_core.training.batch import TrainBatch, trained_tokens
    from miles_core.training.critic_targets import clipped_value_loss, response_values, with_trainer_advantages
    from miles_core.training.losses import kl_k3, kl_per_token, logits_dtype, masked_mean, policy_loss
    from miles_core.training.objective import Objective, StepShape, averaged, mini_batches, objective_from_spec
    from miles_core.training.optimizer import build_optimizer
    from miles_core.training.optimizer_reset import reset_optimizer_states
    from miles_core.training.weight_iterator import HfWeightIterator
    from miles_core.weight_transfer.digests import checksum, combine_digests, tensor_digest
    from miles_core.weight_transfer.disk import write_index, write_shard
    from miles_core.weight_transfer.holders import (
        NamedTensorShare,
        WeightHolders,
        merged_digests,
        raise_holder_errors,
        round_robin_share,
        run_holder_task_safely,
    )
    from miles_core.weight_transfer.http_engines import HttpEngineProtocol
    from miles_core.weight_transfer.protocol import (
        EngineEndpoint,
        SendsFromHolders,
        TransferReport,
        WeightBucket,
        WeightTransferProtocol,
    )
    from miles_core.weight_transfer.routes import (
        CHECKSUM,
        DISK,
        DISTRIBUTED,
        LOCAL_ENGINE,
        SGLANG_HTTP_API,
        STAGING_COPY,
        STAGING_SWAP,
        TENSOR_BYTES,
        WEIGHTS_BY_NAME,
        EngineCapabilities,
        route_for,
    )
    from miles_core.weight_transfer.settings import ProtocolSettings
    from miles_core.weight_transfer.staged_load import load_staged, sample_names, verify_sampled, weight_update_sessions
    from miles_core.weight_transfer.staging_layout import (
        StagedTensor,
        StagingLayout,
        StagingLayoutError,
        StagingOverflowError,
        map_staging_file,
    )
    from miles_core.workers.handle import WorkerHandle
    from miles_core.workers.local_provider import LocalWorkerProvider
    from miles_core.workers.node import LOOPBACK, bind_collectives_to, node_address
    from miles_core.workers.provider import WorkerInfo
    from miles_core.workers.rpc.server import rpc_method
    from miles_core.workers.specs import TRAINER, CommandWorkerSpec, PythonWorkerSpec, WorkerSpec

__version__ = "0.2.0"

_LAZY = {
    # backends and the trainer's toolkit
    "TrainingBackend": "miles_core.training.backend",
    "EngineBackend": "miles_core.engines.backend",
    "CausalLM": "miles_core.models.causal_lm",
    "HfWeightIterator": "miles_core.training.weight_iterator",
    "TrainBatch": "miles_core.training.batch",
    "AdvantageEstimator": "miles_core.training.algorithms",
    "AlgorithmSettings": "miles_core.training.algorithms",
    "PolicyLoss": "miles_core.training.algorithms",
    "ScoredSample": "miles_core.training.algorithms",
    "objective_from_spec": "miles_core.training.objective",
    "choose_algorithm": "miles_core.training.algorithms",
    "trainer_side": "miles_core.training.algorithms",
    "with_trainer_advantages": "miles_core.training.critic_targets",
    "response_values": "miles_core.training.critic_targets",
    "clipped_value_loss": "miles_core.training.critic_targets",
    "Objective": "miles_core.training.objective",
    "StepShape": "miles_core.training.objective",
    "averaged": "miles_core.training.objective",
    "mini_batches": "miles_core.training.objective",
    "trained_tokens": "miles_core.training.batch",
    "policy_loss": "miles_core.training.losses",
    "kl_per_token": "miles_core.training.losses",
    "kl_k3": "miles_core.training.losses",
    "masked_mean": "miles_core.training.losses",
    "logits_dtype": "miles_core.training.losses",
    "build_optimizer": "miles_core.training.optimizer",
    "reset_optimizer_states": "miles_core.training.optimizer_reset",
    "NOT_ROUTED": "miles_core.engines.routed_experts",
    "RoutedExpertsError": "miles_core.engines.routed_experts",
    "check_replayable": "miles_core.engines.routed_experts",
    # checkpoints and model implementations
    "DSV4_FAMILY": "miles_core.models.selection",
    "checkpoint_family": "miles_core.models.checkpoint_dir",
    "checkpoint_named_tensors": "miles_core.models.hf_checkpoint",
    "copy_tokenizer_files": "miles_core.models.hf_checkpoint",
    "read_model_config": "miles_core.models.checkpoint_dir",
    "require_checkpoint_dir": "miles_core.models.checkpoint_dir",
    # weight-transfer protocols
    "WeightTransferProtocol": "miles_core.weight_transfer.protocol",
    "EngineEndpoint": "miles_core.weight_transfer.protocol",
    "TransferReport": "miles_core.weight_transfer.protocol",
    "WeightBucket": "miles_core.weight_transfer.protocol",
    "SendsFromHolders": "miles_core.weight_transfer.protocol",
    "ProtocolSettings": "miles_core.weight_transfer.settings",
    "MAX_BUFFER_MB": "miles_core.bounds",
    "MAX_KEPT_VERSIONS": "miles_core.bounds",
    "MAX_LANES": "miles_core.bounds",
    "at_most_memory_share": "miles_core.bounds",
    "at_most_per_cpu": "miles_core.bounds",
    "HttpEngineProtocol": "miles_core.weight_transfer.http_engines",
    "WeightHolders": "miles_core.weight_transfer.holders",
    "NamedTensorShare": "miles_core.weight_transfer.holders",
    "merged_digests": "miles_core.weight_transfer.holders",
    "raise_holder_errors": "miles_core.weight_transfer.holders",
    "round_robin_share": "miles_core.weight_transfer.holders",
    "run_holder_task_safely": "miles_core.weight_transfer.holders",
    "write_shard": "miles_core.weight_transfer.disk",
    "write_index": "miles_core.weight_transfer.disk",
    # declared capabilities: the weight routes engines serve and protocols use
    "EngineCapabilities": "miles_core.weight_transfer.routes",
    "DISK": "miles_core.weight_transfer.routes",
    "DISTRIBUTED": "miles_core.weight_transfer.routes",
    "STAGING_SWAP": "miles_core.weight_transfer.routes",
    "STAGING_COPY": "miles_core.weight_transfer.routes",
    "TENSOR_BYTES": "miles_core.weight_transfer.routes",
    "CHECKSUM": "miles_core.weight_transfer.routes",
    "WEIGHTS_BY_NAME": "miles_core.weight_transfer.routes",
    "LOCAL_ENGINE": "miles_core.weight_transfer.routes",
    "SGLANG_HTTP_API": "miles_core.weight_transfer.routes",
    "route_for": "miles_core.weight_transfer.routes",
    "load_staged": "miles_core.weight_transfer.staged_load",
    "sample_names": "miles_core.weight_transfer.staged_load",
    "verify_sampled": "miles_core.weight_transfer.staged_load",
    "weight_update_sessions": "miles_core.weight_transfer.staged_load",
    "EngineClient": "miles_core.engines.client",
    # weight wire formats
    "StagingLayout": "miles_core.weight_transfer.staging_layout",
    "StagedTensor": "miles_core.weight_transfer.staging_layout",
    "StagingLayoutError": "miles_core.weight_transfer.staging_layout",
    "StagingOverflowError": "miles_core.weight_transfer.staging_layout",
    "map_staging_file": "miles_core.weight_transfer.staging_layout",
    "weight_staging_dir": "miles_core.engines.staging",
    "remove_orphan_files": "miles_core.engines.staging",
    "STAGING_DIR_ENV": "miles_core.engines.staging",
    "tensor_digest": "miles_core.weight_transfer.digests",
    "combine_digests": "miles_core.weight_transfer.digests",
    "checksum": "miles_core.weight_transfer.digests",
    # workers, providers and their network
    "WorkerSpec": "miles_core.workers.specs",
    "PythonWorkerSpec": "miles_core.workers.specs",
    "CommandWorkerSpec": "miles_core.workers.specs",
    "TRAINER": "miles_core.workers.specs",
    "WorkerHandle": "miles_core.workers.handle",
    "WorkerInfo": "miles_core.workers.provider",
    "LocalWorkerProvider": "miles_core.workers.local_provider",
    "rpc_method": "miles_core.workers.rpc.server",
    "LOOPBACK": "miles_core.workers.node",
    "node_address": "miles_core.workers.node",
    "bind_collectives_to": "miles_core.workers.node",
    "reserve_rendezvous": "miles_core.distributed",
    "tcp_init_method_address": "miles_core.distributed",
    "tcp_store": "miles_core.distributed",
    # config sections
    "MilesConfig": "miles_core.config.build",
    "Section": "miles_core.config.section",
    "TrainSection": "miles_core.config.sections",
    # value types of a rollout and an engine's answers
    "Sample": "miles_core.rollout.samples",
    "Group": "miles_core.rollout.samples",
    "Prompt": "miles_core.rollout.prompts",
    "SamplingParams": "miles_core.engines.generate_types",
    "GenerateOutput": "miles_core.engines.generate_types",
    # chat formats of the session server
    "ChatFormat": "miles_core.rollout.sessions.formats",
    "ChatFormatError": "miles_core.rollout.sessions.formats",
    "ChatMessage": "miles_core.rollout.sessions.formats",
    "ToolCall": "miles_core.rollout.sessions.formats",
    # test kit
    "ProtocolContract": "miles_core.testkit.protocol_contract",
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
    "CHECKSUM",
    "DISK",
    "DISTRIBUTED",
    "DSV4_FAMILY",
    "LOCAL_ENGINE",
    "LOOPBACK",
    "MAX_BUFFER_MB",
    "MAX_KEPT_VERSIONS",
    "MAX_LANES",
    "NOT_ROUTED",
    "SGLANG_HTTP_API",
    "STAGING_COPY",
    "STAGING_DIR_ENV",
    "STAGING_SWAP",
    "TENSOR_BYTES",
    "TRAINER",
    "WEIGHTS_BY_NAME",
    "AdvantageEstimator",
    "AlgorithmSettings",
    "CausalLM",
    "ChatFormat",
    "ChatFormatError",
    "ChatMessage",
    "CommandWorkerSpec",
    "ConfigError",
    "EngineBackend",
    "EngineCapabilities",
    "EngineClient",
    "EngineEndpoint",
    "EngineError",
    "EngineInfo",
    "EngineWorker",
    "GenerateOutput",
    "Group",
    "HfWeightIterator",
    "HttpEngineProtocol",
    "Implementation",
    "LocalWorkerProvider",
    "MilesConfig",
    "MilesError",
    "NamedTensorShare",
    "Objective",
    "PluginHookError",
    "PluginLoadError",
    "PolicyLoss",
    "Prompt",
    "ProtocolContract",
    "ProtocolSettings",
    "PythonWorkerSpec",
    "RegistryError",
    "RoutedExpertsError",
    "RouterInfo",
    "Sample",
    "SamplingParams",
    "ScoredSample",
    "Section",
    "SendsFromHolders",
    "StagedTensor",
    "StagingLayout",
    "StagingLayoutError",
    "StagingOverflowError",
    "StepShape",
    "ToolCall",
    "TrainBatch",
    "TrainSection",
    "TrainerInfo",
    "TrainingBackend",
    "TransferReport",
    "WeightBucket",
    "WeightHolders",
    "WeightTransferProtocol",
    "WorkerHandle",
    "WorkerInfo",
    "WorkerSpec",
    "__version__",
    "at_most_memory_share",
    "at_most_per_cpu",
    "averaged",
    "bind_collectives_to",
    "build_optimizer",
    "check_replayable",
    "checkpoint_family",
    "checkpoint_named_tensors",
    "checksum",
    "choose_algorithm",
    "clipped_value_loss",
    "combine_digests",
    "copy_tokenizer_files",
    "hookimpl",
    "hookspec",
    "kl_k3",
    "kl_per_token",
    "load_staged",
    "logits_dtype",
    "map_staging_file",
    "masked_mean",
    "merged_digests",
    "mini_batches",
    "model_implementation",
    "node_address",
    "objective_from_spec",
    "policy_loss",
    "raise_holder_errors",
    "read_model_config",
    "remove_orphan_files",
    "require_checkpoint_dir",
    "reserve_rendezvous",
    "reset_optimizer_states",
    "response_values",
    "round_robin_share",
    "route_for",
    "rpc_method",
    "run_holder_task_safely",
    "sample_names",
    "tcp_init_method_address",
    "tcp_store",
    "tensor_digest",
    "trained_tokens",
    "trainer_side",
    "verify_sampled",
    "weight_staging_dir",
    "weight_update_sessions",
    "with_trainer_advantages",
    "write_index",
    "write_shard",
]
