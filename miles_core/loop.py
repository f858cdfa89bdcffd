"""The RL loop: prepare, generate, reward, train, publish weights, evaluate, checkpoint; repeat.

``schedule="sync"`` generates step k with the weights of step k. ``schedule="one_step_off"`` generates step k+1
while step k trains (with weights one version old; the PPO importance ratio against the rollout logprobs corrects
for it). Step k's data depends only on k, so a resumed run continues with the same data order.
``schedule="fully_async"`` never stops generating: a :class:`RolloutStream` fills a buffer that each step takes its
groups from, within ``--rollout-max-staleness`` versions of the trainer; its checkpoints keep which groups were
used, so a resumed run neither repeats nor skips one.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers

from miles_core.engines.backend import load_engine_backend
from miles_core.errors import ConfigError, MilesError
from miles_core.events import TrainerInfo
from miles_core.models.hf_checkpoint import copy_tokenizer_files, tokenizer_files
from miles_core.progress import waiting_for
from miles_core.registry import Registries
from miles_core.reporting import METRICS_FILE, RunReporter, drop_rows_from
from miles_core.rollout.agents import agent_for_task, chat_format_target, close_session_clients
from miles_core.rollout.controller import InferenceController
from miles_core.rollout.executor import RolloutExecutor
from miles_core.rollout.filters import load_filters
from miles_core.rollout.sessions.pool import SessionServers
from miles_core.rollout.stream import RolloutStream, StreamState
from miles_core.run_setup import CHECKPOINTS, RunSetup, prepare_run
from miles_core.targets import describe_callable
from miles_core.training.algorithms import choose_algorithm
from miles_core.training.backend import TrainingBackend, missing_members, weight_holders
from miles_core.weight_transfer.auto import AutoProtocol
from miles_core.weight_transfer.protocol import WeightTransferProtocol
from miles_core.weight_transfer.routes import LORA_ADAPTERS, EngineCapabilities, capabilities_of

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig


async def run_training(config: MilesConfig, manager: Any, *, progress: bool = True) -> RunReporter:
    """Run ``config.run.num_steps`` RL steps; returns the reporter holding every metric."""
    registries: Registries = manager.registries
    transformers.utils.logging.disable_progress_bar()  # the run has its own progress bar
    setup = prepare_run(config, registries)
    manager.hook.on_run_start(config=config, run_dir=setup.run_dir, start_step=setup.start_step)
    try:
        if config.run.resume:
            _drop_abandoned_records(manager, setup)
        reporter = await _run_with_setup(config, manager, setup, progress=progress)
    except BaseException as exc:
        manager.hook.on_run_end(status="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    manager.hook.on_run_end(status="finished", error=None)
    return reporter


def _drop_abandoned_records(manager: Any, setup: RunSetup) -> None:
    """A resumed run records again every step after its checkpoint (every step, the eval before training too, when
    there was none): what an interrupted run recorded of those steps goes first, from ``metrics.jsonl`` and from
    every record keeper (the ``on_run_resume`` hook), so that each step appears once."""
    from_step = setup.start_step + 1 if setup.start_step else 0
    dropped = drop_rows_from(setup.run_dir / METRICS_FILE, from_step=from_step)
    if dropped:
        print(
            f"miles: --run-resume true: the earlier run's records of steps {from_step} and later ({dropped} "
            f"{'row' if dropped == 1 else 'rows'} of {METRICS_FILE}) are dropped: those steps run again",
            flush=True,
        )
    manager.hook.on_run_resume(run_dir=setup.run_dir, from_step=from_step)


async def _run_with_setup(config: MilesConfig, manager: Any, setup: RunSetup, *, progress: bool) -> RunReporter:
    registries: Registries = manager.registries
    protocol = make_protocol(config, registries)  # bad protocol settings fail before any worker starts
    trainer = _build_trainer(config, registries, setup)
    print(f"miles: {config.train.backend} trainer, model {trainer.implementation}", flush=True)
    try:
        ranks = tuple(trainer.rank_names())
        manager.hook.register_trainer(trainer=TrainerInfo(config.train.backend, trainer.implementation, ranks))
        if setup.start_step:
            trainer.load_checkpoint(setup.model_path)
        return await _run_with_trainer(config, manager, setup, trainer, protocol, progress=progress)
    finally:
        trainer.close()


def _build_trainer(config: MilesConfig, registries: Registries, setup: RunSetup) -> TrainingBackend:
    """The run's trainer from its backend's ``for_run``; one lacking a :class:`TrainingBackend` member is closed
    (when it can be) and refused, naming the backend and what it lacks."""
    entry = registries.training_backends.get_or_raise(config.train.backend)
    trainer = entry.load().for_run(
        config,
        model_path=setup.model_path,
        initial_model_path=setup.initial_model_path,
        run_dir=setup.run_dir,
        token=setup.token,
        registries=registries,
    )
    missing = missing_members(trainer)
    if missing:
        if callable(getattr(trainer, "close", None)):
            trainer.close()
        raise MilesError(
            f"training backend {config.train.backend!r} ({entry.target}) made a trainer without "
            f"{', '.join(missing)} (miles_core.TrainingBackend lists what a trainer provides)"
        )
    return trainer


VERIFY_SAMPLES = 4
"""With ``--weight-transfer-verify-checksum``, the parameters each update reads back from every SGLang engine."""


def make_protocol(config: MilesConfig, registries: Registries) -> WeightTransferProtocol:
    """The configured weight-transfer protocol, built from ``weight_transfer.settings`` (which the config build
    validated against the protocol's settings model); a protocol that refuses to be built here (NCCL without a CUDA
    device) is a :class:`ConfigError` naming it and its settings."""
    mode, settings = config.weight_transfer.mode, config.weight_transfer.settings
    protocol = _build_protocol(registries, mode, settings, field="weight_transfer.settings")
    if config.weight_transfer.verify_checksum:
        protocol.verify_samples = VERIFY_SAMPLES
    if isinstance(protocol, AutoProtocol):
        provider = registries.worker_providers.get_or_raise(config.run.worker_provider).load()
        protocol.bind(_protocol_factory(registries), engines_in_ray=getattr(provider, "hosts_in_ray", False))
    return protocol


def _build_protocol(
    registries: Registries, name: str, settings: dict[str, Any], *, field: str
) -> WeightTransferProtocol:
    protocol_cls = registries.weight_transfer_protocols.get_or_raise(name).load()
    try:
        return protocol_cls(**settings)
    except ConfigError:  # settings its model refuses: the error names them already
        raise
    except MilesError as exc:  # a refusal that depends on this machine
        raise ConfigError(
            f"{field} (--weight-transfer-settings) {json.dumps(settings, default=str)} do not fit the protocol "
            f"{name!r} ({describe_callable(protocol_cls)}): {type(exc).__name__}: {exc}"
        ) from None


def _protocol_factory(registries: Registries) -> Any:
    """Builds the protocols ``auto`` chooses, by name, with the settings ``auto`` keeps for each."""

    def build(name: str, settings: dict[str, Any]) -> WeightTransferProtocol:
        return _build_protocol(registries, name, settings, field=f"weight_transfer.settings.{name}")

    return build


async def _run_with_trainer(
    config: MilesConfig,
    manager: Any,
    setup: RunSetup,
    trainer: Any,
    protocol: WeightTransferProtocol,
    *,
    progress: bool,
) -> RunReporter:
    registries: Registries = manager.registries
    provider = (
        registries.worker_providers.get_or_raise(config.run.worker_provider)
        .load()
        .for_run(config.run, token=setup.token, run_dir=setup.run_dir)
    )
    provider.require_shared(setup.model_path, what="the model directory", setting="model.path (--model)")
    for shared in protocol.shared_directories():
        provider.require_shared(shared.path, what=shared.what, setting=shared.setting, owned=shared.owned)
    backend = load_engine_backend(registries, config.engine.backend)
    controller = InferenceController(
        config=config,
        hooks=manager.hook,
        provider=provider,
        protocol=protocol,
        backend=backend,
        model_path=str(setup.model_path),
    )
    agent = agent_for_task(config.rollout.task, config.rollout.agent, registries.agents)
    adapters = _adapter_sync(config, trainer, capabilities_of(backend, config), protocol, agent_run=agent is not None)
    reporter = RunReporter(
        setup.run_dir, total_steps=config.run.num_steps, start_step=setup.start_step, enabled=progress
    )
    sessions: SessionServers | None = None
    executor: RolloutExecutor | None = None
    try:
        await controller.start(version=setup.start_step)  # in the try: started engines stop if another fails
        print(
            f"miles: engines by the {config.run.worker_provider} provider: {controller.describe_placement()}",
            flush=True,
        )
        if agent is not None:
            sessions = await _start_session_servers(config, provider, controller, setup, registries)
        algorithm = choose_algorithm(
            config.train,
            registries,
            group_size=config.rollout.group_size,
            max_new_tokens=config.rollout.max_new_tokens,
        )
        print(f"miles: algorithm: {algorithm.describe()}", flush=True)
        executor = RolloutExecutor(
            run=config.run,
            rollout=config.rollout,
            train=config.train,
            engine=config.engine,
            tokenizer=setup.tokenizer,
            train_prompts=setup.train_prompts,
            eval_prompts=setup.eval_prompts,
            reward=setup.reward,
            controller=controller,
            advantages=algorithm.estimator,
            filters=load_filters(config.rollout.filters, registries.rollout_filters),
            initial_version=setup.start_step,
            agent=agent,
            sessions=sessions,
            routing=setup.routing,
            encoder=setup.encoder,
        )
        if adapters and setup.start_step:  # a resumed LoRA run: the engines started on the base
            await publish_adapter(trainer, controller, setup, setup.start_step)
        await _steps(config, manager, setup, trainer, controller, executor, reporter, adapters=adapters)
    finally:
        reporter.close()
        if sessions is not None:
            await sessions.stop()
            await close_session_clients()
        await controller.stop()
        if executor is not None:
            executor.close()
    return reporter


async def _start_session_servers(
    config: MilesConfig, provider: Any, controller: InferenceController, setup: RunSetup, registries: Registries
):
    """The session servers of an agent run, in front of the router or the first engine (each session names its
    engine: the rollout spreads them)."""
    default_engine = controller.router_client or controller.engine_clients()[0]
    sessions = await SessionServers.start(
        provider,
        count=config.rollout.session_servers,
        startup_timeout_s=config.engine.startup_timeout_s,
        engine_url=default_engine.url,
        engine_is_router=default_engine.is_router,
        model_path=str(setup.model_path),
        chat_format=chat_format_target(config, registries.chat_formats),
    )
    placed = ", ".join(worker.describe() for worker in sessions.workers)
    print(f"miles: session servers by the {config.run.worker_provider} provider: {placed}", flush=True)
    return sessions


async def _steps(config, manager, setup: RunSetup, trainer, controller, executor, reporter, *, adapters: bool) -> None:
    """Steps ``start_step + 1 .. num_steps``. Step N (as in the terminal, metrics.jsonl, the checkpoint
    ``step_N`` and the dashboard) trains on rollout ``N - 1`` and publishes weight version N; step 0 is the eval
    before training."""
    if setup.start_step == 0:
        reporter.eval(0, await _evaluate(manager, controller, executor, 0))
    stream = None
    if config.run.schedule == "fully_async":
        default_low = setup.start_step * config.rollout.batch_size  # where a sync run's checkpoint left off
        state = StreamState.load(setup.model_path, default_low=default_low) if setup.start_step else StreamState()
        stream = RolloutStream(executor, controller, config.rollout, state=state)
        stream.start()
    try:
        await _step_loop(config, manager, setup, trainer, controller, executor, reporter, stream, adapters)
    finally:
        if stream is not None:
            await stream.stop()


async def _step_loop(config, manager, setup, trainer, controller, executor, reporter, stream, adapters) -> None:
    bucket_bytes = config.weight_transfer.bucket_size_mb << 20
    next_rollout = None
    for rollout_id in range(setup.start_step, config.run.num_steps):
        step = rollout_id + 1
        phases = _Phases(manager, rollout_id=rollout_id, step=step)
        if stream is not None:
            manager.hook.prepare_rollout(rollout_id=rollout_id, controller=controller)
            rollout = await phases.run("rollout", stream.take(rollout_id))
        else:
            rollout = await phases.run("rollout", next_rollout or _rollout(manager, controller, executor, rollout_id))
        if config.run.schedule == "one_step_off" and step < config.run.num_steps:
            next_rollout = asyncio.create_task(_rollout(manager, controller, executor, rollout_id + 1))
        train_metrics = await phases.run("train", asyncio.to_thread(trainer.train_step, rollout.batch))
        if adapters:
            report = await phases.run("weight_update", publish_adapter(trainer, controller, setup, step))
        else:
            report = await phases.run(
                "weight_update",
                controller.update_weights(
                    lambda: trainer.weight_iterator(bucket_bytes), version=step, holders=weight_holders(trainer)
                ),
            )
        metrics = {
            **rollout.stats,
            **{f"train/{k}": v for k, v in train_metrics.items()},
            "weight_transfer/gb_per_s": report.gb_per_s,
            "weight_transfer/seconds": report.seconds,
            **phases.seconds,
        }
        manager.hook.on_samples(rollout_id=rollout_id, step=step, samples=rollout.samples)
        if (config.run.eval_every and step % config.run.eval_every == 0) or step == config.run.num_steps:
            metrics.update(await phases.run("eval", _evaluate(manager, controller, executor, step)))
        if (config.run.checkpoint_every and step % config.run.checkpoint_every == 0) or step == config.run.num_steps:
            state = stream.state.copy() if stream is not None else None  # the producer settles groups meanwhile
            await phases.run("checkpoint", asyncio.to_thread(save_checkpoint, trainer, setup, step, state))
        metrics["time/step"] = time.time() - phases.started
        manager.hook.on_metrics(rollout_id=rollout_id, step=step, metrics=metrics)
        reporter.step(step, metrics, labels={"weight_transfer/protocol": report.protocol})


ADAPTERS = "adapters"
"""The run directory's folder of the adapters published to the engines (LoRA), one per weight version."""
ADAPTERS_KEPT = 2
"""Published adapters kept on disk: the one served and the one before (a restarted engine loads the newest)."""


def _adapter_sync(
    config: MilesConfig, trainer: Any, capabilities: EngineCapabilities, protocol: Any, *, agent_run: bool
) -> bool:
    """Whether the engines get the trainer's LoRA adapter alone after each step (engines that serve adapters), or,
    said here once, the merged weights through the run's protocol; ``False`` without LoRA."""
    lora = getattr(trainer, "lora", None)
    if lora is None:
        return False
    if not capabilities.serves(LORA_ADAPTERS):
        print(
            f"miles: LoRA rank {lora.rank}: the {config.engine.backend} engines serve no adapters, so each step "
            f"sends them the merged weights (base + adapter) through the {protocol.name} protocol",
            flush=True,
        )
        return False
    if agent_run:
        raise ConfigError(
            "LoRA (--train-lora-rank) generates through /generate with the adapter's lora_path; agent runs' "
            "session servers do not pass it yet: run LoRA without an agent"
        )
    print(
        f"miles: LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}: after each step "
        "the engines load the adapter alone (/load_lora_adapter by path), checked by its digest",
        flush=True,
    )
    return True


async def publish_adapter(trainer: Any, controller: InferenceController, setup: RunSetup, step: int):
    """Write the trainer's adapter under the run directory and have every engine serve it as version ``step``;
    adapters older than the last :data:`ADAPTERS_KEPT` are removed."""
    directory = setup.run_dir / ADAPTERS / f"step_{step:06d}"
    if directory.exists():  # a resumed run publishes a step again
        shutil.rmtree(directory)
    digest = await asyncio.to_thread(trainer.save_adapter, directory)
    report = await controller.update_adapter(directory, version=step, digest=digest)
    for old in sorted((setup.run_dir / ADAPTERS).glob("step_*"))[:-ADAPTERS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return report


def save_checkpoint(trainer: Any, setup: RunSetup, step: int, stream_state: StreamState | None = None) -> Path:
    """``checkpoints/step_{step:06d}``, written by the trainer; a trainer that wrote no tokenizer (a third-party
    backend) gets the run model's tokenizer files added, so every checkpoint is a ``--model`` directory. A
    fully_async run's checkpoint also keeps which groups were used (:class:`StreamState`)."""
    directory = setup.run_dir / CHECKPOINTS / f"step_{step:06d}"
    trainer.save_checkpoint(directory)
    if not tokenizer_files(directory):
        copy_tokenizer_files(setup.initial_model_path, directory)
    if stream_state is not None:
        stream_state.save(directory)
    return directory


class _Phases:
    """Times the phases of one step and reports each through the ``on_phase`` hook."""

    def __init__(self, manager: Any, *, rollout_id: int, step: int) -> None:
        self.manager, self.rollout_id, self.step = manager, rollout_id, step
        self.started = time.time()
        self.seconds: dict[str, float] = {}

    async def run(self, phase: str, awaitable: Any) -> Any:
        started = time.time()
        with waiting_for(f"step {self.step}'s {phase.replace('_', ' ')}"):  # a slow step says where it is
            result = await awaitable
        ended = time.time()
        self.seconds[f"time/{phase}"] = ended - started
        self.manager.hook.on_phase(
            rollout_id=self.rollout_id, step=self.step, phase=phase, started=started, ended=ended
        )
        return result


async def _rollout(manager, controller, executor, rollout_id: int):
    manager.hook.prepare_rollout(rollout_id=rollout_id, controller=controller)
    return await executor.get(rollout_id)


async def _evaluate(manager, controller, executor, step: int) -> dict[str, float]:
    """The eval after step ``step`` (0: before training), reported through ``on_eval``."""
    manager.hook.prepare_eval(rollout_id=step, controller=controller)
    started = time.time()
    metrics = (await executor.evaluate(step)).stats
    manager.hook.on_eval(step=step, metrics=metrics, started=started, ended=time.time())
    return metrics
