"""The extension surface of Miles: every hook a plugin may implement.

Plugins are modules (or objects) whose functions carry ``@miles_core.hookimpl``. The core calls the hooks below;
this module is their documentation. Conventions:

* **Registry hooks** (``provide_*``) are called once, when the :class:`~miles_core.registry.Registries` are built
  after all plugins are loaded. Each returns a list of :class:`~miles_core.registry.Implementation` entries (or
  ``None``). The core merges them per registry; a name that two plugins provide is an error naming both.
  Entries point at their code by an import string (``"package.module:attr"``) and are imported only when used, so
  listing plugins never imports torch, ray or a backend.
* **Configuration hooks** contribute pydantic sections and command-line flags, and validate the whole config once
  it is built.
* **Run-time hooks** (rollout preparation, run events, weight updates) are called by the RL loop; what they receive
  is typed (:class:`~miles_core.events.TrainerInfo`, :class:`~miles_core.events.EngineInfo`,
  :class:`~miles_core.events.RouterInfo`, the rollout's ``Sample``, the ``InferenceController``, the protocol and its
  ``TransferReport``), all importable from ``miles_core``.

None of the hooks is historic: plugins register before any hook is called. Every call goes through
:mod:`miles_core.plugin_guard`: what an implementation raises, or returns outside what its hook allows (checked by
:mod:`miles_core.hook_results`), is an error naming the plugin and the hook. Wrapper implementations are refused.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # annotations only: importing these at run time would be circular
    from miles_core.config.build import MilesConfig
    from miles_core.config.flags import ConfigFlag
    from miles_core.events import EngineInfo, RouterInfo, TrainerInfo
    from miles_core.registry import Implementation, Registries
    from miles_core.rollout.controller import InferenceController
    from miles_core.rollout.samples import Sample
    from miles_core.weight_transfer.protocol import TransferReport, WeightTransferProtocol

PROJECT_NAME = "miles"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""The marker of a hook specification (the core's, in this module)."""
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""The marker of a plugin's hook implementation: ``@hookimpl`` on a function named after a hook of this module
(``@hookimpl(wrapper=True)`` for a wrapper, as pluggy spells it)."""


# --------------------------------------------------------------------------------------------------------------
# Registries of named implementations
# --------------------------------------------------------------------------------------------------------------


@hookspec
def provide_training_backends() -> list[Implementation] | None:
    """Training backends (``--trainer NAME``), such as ``torch`` or ``megatron``.

    Called once when the registries are built. Each entry's target is a class satisfying
    :class:`miles_core.TrainingBackend`: ``for_run(config, *, model_path, initial_model_path, run_dir, token,
    registries)`` (a classmethod that builds the trainer of a run; ``initial_model_path`` is the KL reference, which a
    resumed run's checkpoint is not), ``train_step(batch) -> metrics`` (called in a worker thread),
    ``weight_iterator(bucket_bytes)`` (an ``HfWeightIterator``), ``save_checkpoint(directory)`` (an HF checkpoint
    directory with the model's tokenizer files: :func:`miles_core.models.hf_checkpoint.save_hf_checkpoint` copies
    them; the loop adds them when a trainer wrote none), ``load_checkpoint(directory)``, ``implementation``
    (``FAMILY/IMPL``), ``rank_names()`` and ``close()``. A trainer lacking one is refused, naming what it lacks.
    """


@hookspec
def provide_engine_backends() -> list[Implementation] | None:
    """Inference-engine backends (``--engine NAME``), such as ``local`` or ``sglang``.

    Called once when the registries are built. Each entry's target is a class satisfying
    :class:`miles_core.EngineBackend`: made once per run with no arguments, it returns the worker specs of each engine
    cell (servers speaking SGLang's native HTTP API) and of the router in front of them, if any. The controller
    starts exactly what the configured backend returns; no hook takes part in launching engines.
    """


@hookspec
def provide_worker_providers() -> list[Implementation] | None:
    """Worker providers (``--run-worker-provider NAME``), such as ``local`` (subprocesses) or ``ray``.

    Called once when the registries are built. Each entry's target is a ``BaseWorkerProvider`` subclass; a run makes
    its providers with ``for_run(config.run, token=..., run_dir=...)``, which by default calls the constructor with
    ``token`` and ``run_dir``.
    """


@hookspec
def provide_weight_transfer_protocols() -> list[Implementation] | None:
    """Weight-transfer protocols (``--update-weight-transfer-mode NAME``), such as ``disk`` or ``rdt``.

    Called once when the registries are built. Each entry's target is a
    :class:`~miles_core.weight_transfer.WeightTransferProtocol` subclass that declares its settings
    (``--weight-transfer-settings``) as a :class:`~miles_core.weight_transfer.settings.ProtocolSettings` model in
    ``settings_model``; the core validates the run's settings against it when the config is built, so no
    ``validate_config`` is needed for them. Packages that only add a protocol need no hook code: the core feeds the
    entry-point group ``miles.weight_transfer`` into this registry.
    """


@hookspec
def provide_model_implementations() -> list[Implementation] | None:
    """Model implementations, named ``"FAMILY/IMPL"`` (for example ``"qwen3/megatron"``).

    Called once when the registries are built. A family may have several implementations; all of them load the
    same HF checkpoint names. The user picks one per family with ``--model-impl FAMILY=IMPL`` (``--dsv4-impl IMPL``
    for ``deepseek_v4``). Build entries with :func:`miles_core.registry.model_implementation`; the family ``"*"``
    serves every family (the core's ``*/transformers``: any family transformers can load).
    """


@hookspec
def provide_reward_functions() -> list[Implementation] | None:
    """Reward functions (``--reward NAME``).

    Called once when the registries are built. Each target is a callable
    ``reward(*, prompt: str, response: str, label: Any, metadata: dict) -> float``, called once per sample (in the
    driver, for training and eval samples alike) with:

    * ``prompt``: the prompt's text as in the prompt file (no chat template);
    * ``response``: the generated token ids decoded with ``skip_special_tokens=True``: no ``<eos>``, pad or bos
      token, nothing else removed (whitespace is kept);
    * ``label`` and ``metadata``: the prompt line's ``"label"`` (any JSON value, ``None`` when absent) and
      ``"metadata"`` (``{}`` when absent).

    It must return a finite ``int`` or ``float``; ``True``/``False`` count as 1.0/0.0. It runs in a worker thread
    of the scoring pool with a timeout (``--rollout-reward-timeout-s``). A return value of any other type (a string,
    ``None``, a tensor), a NaN/infinite one, an exception or a timeout scores 0 and is counted (``reward/errors``,
    ``reward/timeouts``; the first of each kind is printed naming the sample and the function);
    ``--rollout-reward-max-consecutive-failures`` failures in a row stop the run. The same holds for a
    ``--reward module:function`` target. Names compose: ``--reward math:1.0,format:0.1``.
    """


@hookspec
def provide_tasks() -> list[Implementation] | None:
    """Tasks (``--task NAME``; the default is the embedded ``echo_last``): prompt sets, each with the reward function
    of the same name as its default reward.

    Called once when the registries are built. A run without ``--prompts FILE`` takes the task's prompts, and without
    ``--reward`` the reward function registered under the task's name. Each target is a callable
    ``prompts(*, seed: int) -> (train_prompts, eval_prompts)``, two non-empty lists of
    :class:`miles_core.rollout.prompts.Prompt`.
    """


@hookspec
def provide_rollout_filters() -> list[Implementation] | None:
    """Group filters (``--rollout-filters NAME,...``; DAPO's dynamic sampling): which finished groups may enter a
    training batch.

    Called once when the registries are built. Each target is a callable ``keep(group) -> bool`` taking a
    :class:`miles_core.Group` (its samples scored, with their token ids, rewards and weight versions); a group it
    refuses is counted in ``rollout/filtered_groups`` and replaced by another, in every schedule. The core provides
    ``nonzero_reward_std`` (a group whose rewards are all equal has zero advantage: it teaches nothing) and
    ``no_truncated`` (no sample stopped by ``max_new_tokens``: DAPO's overlong filter).
    """


@hookspec
def provide_agents() -> list[Implementation] | None:
    """Agents (``--rollout-agent NAME``; a task's default agent is the one named like the task): the code that plays
    one rollout sample as a multi-turn conversation with the policy, with tools and an environment of its own.

    Called once when the registries are built. Each target is ``async def agent(*, base_url: str, prompt: str,
    metadata: dict) -> float | None``: ``base_url`` is its session's OpenAI-compatible endpoint on a session server
    (any OpenAI client works unchanged), and it returns the sample's reward, or ``None`` to have the run's reward
    function score its last turn. The core provides ``single_turn`` (one question, one answer) and ``tool_lookup``
    (the agent of the embedded multi-turn task: a tool the policy must call).
    """


@hookspec
def provide_chat_formats() -> list[Implementation] | None:
    """Token-in-token-out chat formats (the session server's ``--chat-format NAME``): how a model family renders a
    conversation as token ids, appends new messages to the exact ids of the turns so far, and parses tool calls from
    the model's raw output ids.

    Called once when the registries are built. Each target is a callable ``make(tokenizer) -> ChatFormat`` taking
    the model directory's tokenizer and returning a :class:`miles_core.ChatFormat` (a class whose
    constructor takes the tokenizer is such a callable); it raises ``ChatFormatError`` when the tokenizer lacks a
    token the format needs. The core provides ``default`` (the embedded default's digit tokenizer) and ``qwen3``
    (Qwen3's chat template and ``<tool_call>`` JSON tool calls).
    """


@hookspec
def provide_advantage_estimators() -> list[Implementation] | None:
    """Advantage estimators (``--train-advantage-estimator NAME``, settings in
    ``--train-advantage-estimator-settings '{...}'``).

    Called once when the registries are built. Each target is a subclass of
    :class:`miles_core.AdvantageEstimator`: its ``settings_model`` is checked against the run's settings when the
    config is built, and :meth:`~miles_core.AdvantageEstimator.advantages` runs in the driver on each step's scored
    groups, returning one advantage per sample (or one per response token). The core provides ``grpo`` (the
    default), ``dr_grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline`` and ``gspo``.
    """


@hookspec
def provide_policy_losses() -> list[Implementation] | None:
    """Policy losses (``--train-policy-loss NAME``, settings in ``--train-policy-loss-settings '{...}'``; by default
    the estimator's choice).

    Called once when the registries are built. Each target is a subclass of :class:`miles_core.PolicyLoss` whose
    :meth:`~miles_core.PolicyLoss.token_losses` runs in every trainer process on each micro-batch, returning the loss
    of every token (the run's ``--train-loss-aggregation`` reduces it) and diagnostics. A trainer in another process
    imports the target again: give it as an import string of an installed module. The core provides ``ppo_clip``
    (the default) and ``gspo``.
    """


# --------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------


@hookspec
def config_sections() -> dict[str, type] | None:
    """Config sections this plugin contributes: ``{section_name: pydantic model class}``.

    Called once when the config model is assembled. Each model must be frozen with ``extra="forbid"`` (derive from
    :class:`miles_core.config.Section`) and have a default for every field. A section name contributed twice is an
    error naming both plugins (the core's own, ``run``, ``model``, ``rollout``, ``train``, ``engine`` and
    ``weight_transfer``, are the typed fields of :class:`~miles_core.config.build.MilesConfig`). A plugin reads its
    section back with ``config.section(name, ModelClass)``.
    """


@hookspec
def config_flags() -> list[ConfigFlag] | None:
    """Named command-line flags that set a config path, beyond the automatic ``--SECTION-FIELD`` flags.

    Called once when the command-line parser is built. Example:
    ``ConfigFlag(flag="--update-weight-transfer-mode", path="weight_transfer.mode")``.
    """


@hookspec
def validate_config(config: MilesConfig, registries: Registries) -> None:
    """Cross-section validation of a fully built config.

    Called once, right after the config is constructed (every source merged, every section validated). Raise
    :class:`miles_core.errors.ConfigError` with a message that names the fields, the values and what would be
    accepted; return ``None`` otherwise. Example: "the rdt protocol needs engines hosted in Ray actors".
    ``config`` is a :class:`~miles_core.config.build.MilesConfig`: the core's sections as typed attributes, a
    plugin's through :meth:`~miles_core.config.build.MilesConfig.section`.
    """


# --------------------------------------------------------------------------------------------------------------
# Rollout preparation
# --------------------------------------------------------------------------------------------------------------


@hookspec
def prepare_rollout(rollout_id: int, controller: InferenceController) -> None:
    """Runs before every training rollout is generated.

    Called by the RL loop with the rollout id and the ``InferenceController``; used to resume health monitoring,
    inject faults (the built-in plugin of ``--fault-injection``, :mod:`miles_core.fault_injection`), or register
    engines with the dashboard. Generation itself does none of this work.
    """


@hookspec
def prepare_eval(rollout_id: int, controller: InferenceController) -> None:
    """Runs before every evaluation, like :func:`prepare_rollout` but for eval generation; ``rollout_id`` is the
    step the eval follows (``0`` for the eval before training, ``N`` for the eval after step ``N``)."""


# --------------------------------------------------------------------------------------------------------------
# Dashboard registration and events
# --------------------------------------------------------------------------------------------------------------


@hookspec
def on_run_start(config: MilesConfig, run_dir: Path, start_step: int) -> None:
    """A run begins: called once by the RL loop after the run directory is prepared (an earlier run moved aside)
    and before the trainer and the engines start, with the config, the run directory and the first step (``0``,
    or the step a resumed run continues at). A dashboard opens its store in ``run_dir`` here."""


@hookspec
def on_run_resume(run_dir: Path, from_step: int) -> None:
    """A resumed run (``--run-resume true``) records steps ``from_step`` and later again: every record keeper drops
    (or supersedes) what it holds of those steps, so that each step appears once in its records.

    Called once, right after :func:`on_run_start` and before anything of the run is recorded, with the run
    directory and ``from_step``: the step after the checkpoint the run resumes from (what an interrupted run
    recorded after its last checkpoint is abandoned and will be recorded again), or ``0`` when there was no
    checkpoint (the run starts over, the eval before training included). ``metrics.jsonl`` is rewritten by the core
    at the same moment; the built-in dashboard deletes the steps' rows, the TensorBoard exporter marks them purged,
    and a keeper without history (Prometheus) does nothing. Not called for a run that is not resumed: a new run in a
    used directory moves the earlier one aside instead.
    """


@hookspec
def on_run_end(status: str, error: str | None) -> None:
    """A run ends: called once by the RL loop after the engines stopped, with ``status`` ``"finished"`` or
    ``"failed"`` and, for a failure, the error's type and message. Not called when the process is killed."""


@hookspec
def register_trainer(trainer: TrainerInfo) -> None:
    """The trainer of the run: ``backend``, ``implementation`` and ``ranks`` (one name per trainer rank). Called
    once, after the trainer is built."""


@hookspec
def register_engines(engines: list[EngineInfo]) -> None:
    """The engines now running: one :class:`~miles_core.events.EngineInfo` per engine (cell id, state, workers with
    their URLs, weight version).

    Called after engines start, after a cell is restarted (its URL may have changed), and with ``[]`` before the
    engines stop. A router plugin keeps its router's worker list equal to this list.
    """


@hookspec
def register_router(router: RouterInfo) -> None:
    """A router is up: called with its :class:`~miles_core.events.RouterInfo` (``name``, ``url``, ``pid``). Called
    after it starts."""


@hookspec
def on_phase(rollout_id: int, step: int, phase: str, started: float, ended: float) -> None:
    """A phase of a training step ended (``rollout``, ``train``, ``weight_update``, ``eval``, ``checkpoint``), with
    wall-clock times.

    ``step`` is the step's number everywhere a user sees it (the terminal, ``metrics.jsonl``, the checkpoint
    ``step_{step:06d}``, the dashboard): step ``N`` trains on rollout ``rollout_id = N - 1`` and publishes weight
    version ``N``. The eval before training belongs to no training step: it reaches only :func:`on_eval`.
    """


@hookspec
def on_metrics(rollout_id: int, step: int, metrics: dict[str, float]) -> None:
    """Metrics of a training step (reward, loss, KL, entropy, step time, and the eval's when one ran), called once
    per step after training and the step's eval and checkpoint; ``step`` and ``rollout_id`` as in :func:`on_phase`.
    """


@hookspec
def on_eval(step: int, metrics: dict[str, float], started: float, ended: float) -> None:
    """An evaluation ended: its metrics (``eval/reward_mean``, ...) and wall-clock times, after the step ``step``
    (``0``: the eval before training, which no other hook reports). Called for every eval, also when it is part of
    a training step (then before that step's :func:`on_metrics`, which holds the same ``eval/`` metrics)."""


@hookspec
def on_samples(rollout_id: int, step: int, samples: list[Sample]) -> None:
    """The samples of a training rollout (prompt, response, reward), called once per step after rewards are
    computed; ``step`` and ``rollout_id`` as in :func:`on_phase`."""


# --------------------------------------------------------------------------------------------------------------
# Weight-update lifecycle
# --------------------------------------------------------------------------------------------------------------


@hookspec
def before_weight_update(version: int, protocol: WeightTransferProtocol) -> None:
    """Called before every weight transfer, with the version about to be published and the protocol instance."""


@hookspec
def weight_update_wrapper(version: int, protocol: WeightTransferProtocol) -> contextlib.AbstractContextManager | None:
    """Wrap every weight transfer: return a context manager (or ``None``).

    Called before every transfer, after :func:`before_weight_update`. The core enters every returned context
    manager, in plugin order, around the transfer and exits them when it ends, also when it fails (the exception is
    passed to ``__exit__`` as usual), so a plugin can time, checksum or trace the whole transfer with one
    ``@contextlib.contextmanager`` function.
    """


@hookspec
def after_weight_update(version: int, protocol: WeightTransferProtocol, report: TransferReport) -> None:
    """Called after every successful weight transfer, with the version, the protocol and its
    :class:`~miles_core.weight_transfer.TransferReport` (bytes, seconds, GB/s, checksum result)."""
