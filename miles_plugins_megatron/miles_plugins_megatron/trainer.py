"""``MegatronTrainer``: the ``megatron`` training backend, a driver for ranks that run as workers.

The driver checks the checkpoint and the parallel layout before any rank starts, starts
``tensor_parallel * data_parallel`` :class:`~miles_plugins_megatron.rank.MegatronRank` workers through a worker
provider (the run's: local processes or Ray placement groups), and calls each method on every rank at once. When a
rank fails, the others (which may be waiting in a collective) are stopped and the failing rank's error and log tail
are raised: nothing hangs. After each step rank 0 exports the HF weights to a file in shared memory, which the
driver reads once and serves to every weight-transfer protocol through :meth:`MegatronTrainer.weight_iterator`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from miles_core import (
    DSV4_FAMILY,
    TRAINER,
    HfWeightIterator,
    MilesError,
    PythonWorkerSpec,
    TrainBatch,
    WorkerHandle,
    choose_algorithm,
    copy_tokenizer_files,
    raise_holder_errors,
    trained_tokens,
)
from miles_plugins_megatron.checkpoint import check_checkpoint, load_hf_config, read_hf_config
from miles_plugins_megatron.config import MegatronSection
from miles_plugins_megatron.conversion import check_expert_parallel, check_tensor_parallel
from miles_plugins_megatron.rank import MegatronRank

if TYPE_CHECKING:
    from miles_core import MilesConfig

STATE_FILE = "trainer_state.json"
RANK_TARGET = "miles_plugins_megatron.rank:MegatronRank"


def implementation_of(family: str) -> str:
    """The model implementation the Megatron trainer trains a family with: ``miles`` for DeepSeek-V4 (on
    megatron-core's parallel layers), ``megatron`` (megatron-core's ``GPTModel``) for the others."""
    return "miles" if family == DSV4_FAMILY else "megatron"


def checked_hf_config(model_path: Path, layout: MegatronSection) -> Any:
    """The checkpoint's HF config, once the model, the parallel layout and the checkpoint's tensors are known to
    fit (a :class:`MilesError` saying what would work otherwise)."""
    hf_config = read_hf_config(model_path)
    if hf_config.model_type == DSV4_FAMILY:
        from miles_plugins_megatron.deepseek_v4.checks import check_deepseek_v4  # megatron-core's layers
        from miles_plugins_megatron.deepseek_v4.parallel import Layout

        dtype = torch.bfloat16 if layout.dtype == "bfloat16" else torch.float32
        planned = Layout(
            tp_size=layout.tensor_parallel, tp_rank=0, ep_size=layout.expert_parallel, ep_rank=0, dtype=dtype
        )
        check_deepseek_v4(hf_config, layout=planned)
    else:
        hf_config = load_hf_config(model_path)
        check_tensor_parallel(hf_config, layout.tensor_parallel)
        check_expert_parallel(hf_config, layout.expert_parallel, data_parallel=layout.data_parallel)
    check_checkpoint(model_path, hf_config)
    return hf_config


class MegatronTrainer:
    """Trains an HF checkpoint with megatron-core ``GPTModel`` ranks (tensor, data and expert parallel), or, for
    DeepSeek-V4, ranks of the ``miles`` implementation on megatron-core's parallel layers."""

    def __init__(
        self,
        *,
        model_path: Path,
        hf_config: Any,
        layout: MegatronSection,
        ranks: _Ranks,
        export_dir: Path,
        tokenizer_from: Path | None = None,
    ) -> None:
        self.model_path, self.hf_config, self.layout = model_path, hf_config, layout
        self.tokenizer_from = tokenizer_from  # checkpoints copy this model directory's tokenizer files
        self.ranks, self.export_dir = ranks, export_dir
        self.step = 0
        self.implementation = f"{hf_config.model_type}/{implementation_of(hf_config.model_type)}"
        self.export_report: dict[str, Any] = {}
        self._weights: list[tuple[str, torch.Tensor]] | None = None

    @classmethod
    def for_run(
        cls,
        config: MilesConfig,
        *,
        model_path: Path,
        initial_model_path: Path,
        run_dir: Path,
        token: str,
        registries: Any,
    ) -> MegatronTrainer:
        """The trainer of a ``miles train`` run: ranks started by the run's worker provider."""
        layout = config.section("megatron", MegatronSection)
        provider_cls = registries.worker_providers.get_or_raise(config.run.worker_provider).load()
        trainer = cls.launch(
            model_path,
            train=config.train,
            layout=layout,
            seed=config.run.seed,
            provider_factory=lambda: _run_provider(
                provider_cls.for_run(config.run, token=token, run_dir=run_dir),
                model_path=model_path,
                reference_path=initial_model_path,
            ),
            reference_path=initial_model_path,
            tokenizer_from=initial_model_path,
            # ranks on other nodes write the export where the driver reads it: the run directory (shared storage)
            export_parent=None if config.run.worker_provider == "local" else run_dir,
            objective=choose_algorithm(
                config.train,
                registries,
                group_size=config.rollout.group_size,
                max_new_tokens=config.rollout.max_new_tokens,
            ).trainer_spec(),
        )
        print(
            f"miles: {layout.world_size} megatron ranks by the {config.run.worker_provider} provider: "
            f"{trainer.ranks.describe()}",
            flush=True,
        )
        return trainer

    @classmethod
    def launch(
        cls,
        model_path: str | Path,
        *,
        train: Any,
        layout: MegatronSection,
        seed: int,
        provider_factory: Callable[[], Any],
        reference_path: str | Path | None = None,
        tokenizer_from: str | Path | None = None,
        export_parent: str | Path | None = None,
        objective: dict[str, Any] | None = None,
    ) -> MegatronTrainer:
        """Check the checkpoint and layout, start every rank and load the checkpoint into it. The KL reference
        is ``reference_path`` (default: the checkpoint itself); checkpoints copy the tokenizer files of the model
        directory ``tokenizer_from`` (none when ``None``). Rank 0 writes exported weights for the driver under
        ``export_parent`` (default: this machine's shared memory). ``objective``: the run's loss
        (:meth:`~miles_core.training.algorithms.AlgorithmChoice.trainer_spec`; default: PPO-clip, token-mean, k3)."""
        model_path = Path(model_path)
        hf_config = checked_hf_config(model_path, layout)
        # named with the driver's pid: a killed driver's is an orphan that the workers' watchdogs remove
        export_dir = Path(
            tempfile.mkdtemp(prefix=f"miles-megatron-{os.getpid()}-", dir=export_parent or _shared_memory_dir())
        )
        ranks = _Ranks(provider_factory)
        try:
            specs = _rank_specs(
                model_path,
                train=train,
                layout=layout,
                seed=seed,
                export_dir=export_dir,
                reference_path=Path(reference_path or model_path),
                objective=objective or DEFAULT_OBJECTIVE,
            )
            ranks.start(specs, timeout_s=layout.startup_timeout_s)
        except BaseException:
            ranks.close()
            shutil.rmtree(export_dir, ignore_errors=True)
            raise
        return cls(
            model_path=model_path,
            hf_config=hf_config,
            layout=layout,
            ranks=ranks,
            export_dir=export_dir,
            tokenizer_from=Path(tokenizer_from) if tokenizer_from is not None else None,
        )

    # -- the training-backend interface ------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on every rank; returns rank 0's metrics. The weights stay on the ranks: they send them
        (:meth:`weight_holders`), or the driver gathers them when asked (:meth:`weight_iterator`)."""
        if not batch.samples:
            raise MilesError("the batch has no samples to train on")
        trained_tokens(batch)  # a batch with nothing to train on is refused here, before any rank works on it
        metrics = self.ranks.call("train_step", batch)[0]
        self.step += 1
        self._weights = None  # the driver's copy, if one was asked for, is now stale
        return metrics

    def weight_holders(self) -> MegatronWeightHolders:
        """The ranks as the holders of the weights: each sends its share (a protocol that sends from holders runs
        its task on every rank), and no weight passes through the driver."""
        return MegatronWeightHolders(self.ranks)

    def weight_iterator(self, bucket_bytes: int) -> HfWeightIterator:
        """The weights of the last step under HF names, in buckets, gathered into the driver (rank 0 exports them to
        shared memory, the driver reads them: ``export_report`` says how fast)."""
        if self._weights is None:
            self._export()
        return _ExportedWeights(self._weights, bucket_bytes=bucket_bytes)

    def save_checkpoint(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """HF checkpoint (config, safetensors, the tokenizer's files), every rank's optimizer state and the step,
        written atomically."""
        directory = Path(directory)
        if directory.exists():
            raise MilesError(f"checkpoint {directory} already exists")
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self._save_sharded_weights(partial)
        self.ranks.call("save_optimizer", str(partial))
        state = {
            "step": self.step,
            "tensor_parallel": self.layout.tensor_parallel,
            "data_parallel": self.layout.data_parallel,
            "expert_parallel": self.layout.expert_parallel,
            **(extra or {}),
        }
        (partial / STATE_FILE).write_text(json.dumps(state))
        partial.rename(directory)
        return directory

    def _save_sharded_weights(self, directory: Path) -> None:
        """The HF checkpoint's weights as one shard per rank (written by the ranks, as the ``disk`` protocol's, so no
        weight passes through the driver), its index, ``config.json`` and the tokenizer files."""
        from miles_core import write_index, write_shard

        directory.mkdir(parents=True)
        self.hf_config.save_pretrained(directory)
        if self.tokenizer_from is not None:
            copy_tokenizer_files(self.tokenizer_from, directory)
        task = f"{write_shard.__module__}:{write_shard.__name__}"
        write_index(directory, self.weight_holders().run_task(task, directory=str(directory), digests=False))

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer state and step on every rank from :meth:`save_checkpoint`'s directory."""
        directory = Path(directory)
        check_checkpoint(directory, self.hf_config)
        self.ranks.call("load_checkpoint", str(directory))
        state = json.loads((directory / STATE_FILE).read_text())
        self.step = state["step"]
        self._weights = None
        return state

    def logits(self, input_ids: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Megatron's full-vocabulary logits ``[B, T, V]`` for ``input_ids`` (for checks and evaluation); with
        ``routed_experts`` (``[B, T, layers, top_k]``), every token routed to its recorded experts."""
        routes = None if routed_experts is None else routed_experts.tolist()
        return torch.tensor(self.ranks.call("logits", input_ids.tolist(), routes)[0])

    def rank_names(self) -> list[str]:
        """The rank workers' names, in rank order (the dashboard's topology shows them)."""
        return list(self.ranks.names)

    def close(self) -> None:
        """Stop every rank and remove the export directory."""
        self.ranks.close()
        shutil.rmtree(self.export_dir, ignore_errors=True)

    def __enter__(self) -> MegatronTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------------

    def _export(self) -> None:
        started = time.perf_counter()
        report = self.ranks.call("export_hf")[0]
        with safe_open(report["path"], framework="pt") as exported:
            self._weights = [(name, exported.get_tensor(name)) for name in exported.keys()]  # noqa: SIM118
        seconds = time.perf_counter() - started
        self.export_report = {**report, "seconds": seconds, "gb_per_s": report["bytes"] / seconds / 1e9}


class MegatronWeightHolders:
    """The Megatron ranks as :class:`~miles_core.weight_transfer.holders.WeightHolders`: every rank gathers the HF
    tensors in the same order (the gathers are collectives) and keeps every world-size-th one as its share."""

    def __init__(self, ranks: Any) -> None:
        self.ranks = ranks

    def describe(self) -> list[str]:
        return list(self.ranks.names)

    def run_task(self, task: str, **kwargs: Any) -> list[dict[str, Any]]:
        return raise_holder_errors(task, self.ranks.call("run_weight_task", task, kwargs), self.describe())


class _ExportedWeights(HfWeightIterator):
    def __init__(self, weights: list[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.weights = weights

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return iter(self.weights)


DEFAULT_OBJECTIVE = {
    "policy_loss_target": "miles_core.builtin.algorithms:PpoClip",
    "policy_loss_settings": {},
    "aggregation": "token-mean",
    "kl_estimator": "k3",
    "norm_constant": 1.0,
}
"""The loss of ranks launched outside a run (tests, tools): the run's defaults."""


def _rank_specs(
    model_path: Path,
    *,
    train: Any,
    layout: MegatronSection,
    seed: int,
    export_dir: Path,
    reference_path: Path,
    objective: dict[str, Any],
) -> list[PythonWorkerSpec]:
    backend = layout.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    threads = layout.threads_per_rank or max(1, (torch.get_num_threads() or 1) // layout.world_size)
    common = dict(
        world_size=layout.world_size,
        tensor_parallel=layout.tensor_parallel,
        expert_parallel=layout.expert_parallel,
        model_path=str(model_path),
        train=train.model_dump(),
        seed=seed,
        export_dir=str(export_dir),
        backend=backend,
        dtype=layout.dtype,
        threads=threads,
        reference_path=str(reference_path),
        objective=objective,
    )
    return [
        PythonWorkerSpec(
            name=f"megatron-rank{rank}",
            target=RANK_TARGET,
            kwargs={"rank": rank, **common},
            rpc_groups={"train": 1, "control": None},
            num_cpus=layout.cpus_per_rank,
            num_gpus=1.0 if backend == "nccl" else 0.0,
            startup_timeout_s=layout.startup_timeout_s,
            role=TRAINER,
        )
        for rank in range(layout.world_size)
    ]


def _run_provider(provider: Any, *, model_path: Path, reference_path: Path) -> Any:
    """The run's provider, told what the ranks read on their nodes (it checks those nodes see it)."""
    provider.require_shared(model_path, what="the model directory", setting="model.path (--model)")
    provider.require_shared(reference_path, what="the run's initial model (the KL reference)", setting="model.path")
    return provider


def _shared_memory_dir() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


class _Ranks:
    """The rank workers and the event loop (a thread of its own) their provider and clients live in, so the
    trainer's methods are plain synchronous calls usable from any thread."""

    def __init__(self, provider_factory: Callable[[], Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="megatron-driver", daemon=True)
        self.thread.start()
        self.provider = self._run(self._make_provider(provider_factory))
        self.names: list[str] = []
        self.handles: list[WorkerHandle] = []

    async def _make_provider(self, provider_factory: Callable[[], Any]) -> Any:
        return provider_factory()

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def start(self, specs: list[PythonWorkerSpec], *, timeout_s: float) -> list[dict[str, Any]]:
        self.names = [spec.name for spec in specs]
        return self._run(self._start(specs, timeout_s))

    async def _start(self, specs: list[PythonWorkerSpec], timeout_s: float) -> list[dict[str, Any]]:
        if hasattr(self.provider, "place"):  # Ray: one placement group, ranks in placement order
            await self.provider.place(specs)  # bounded by the specs' start-up timeout
        await asyncio.gather(*(self.provider.start(spec) for spec in specs))
        self.handles = [
            WorkerHandle(self.provider.client(name, timeout_s=timeout_s), MegatronRank) for name in self.names
        ]
        init_method = await self.handles[0].rendezvous()  # rank 0's node address, a port free there
        return await self._on_every_rank("setup", init_method)

    def describe(self) -> str:
        """Where each rank runs: ``name pid N [node ADDRESS (id ABCDEF12) bundle I]``."""
        return ", ".join(self.provider.workers[name].describe() for name in self.names)

    def call(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every rank at once; the results in rank order."""
        return self._run(self._on_every_rank(method, *args))

    async def _on_every_rank(self, method: str, *args: Any) -> list[Any]:
        tasks = [asyncio.ensure_future(getattr(handle, method)(*args)) for handle in self.handles]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [(rank, task.exception()) for rank, task in enumerate(tasks) if task in done and task.exception()]
        if not failed:
            return [task.result() for task in tasks]
        for task in pending:  # the other ranks may wait in a collective for the failed one: stop them all
            task.cancel()
        rank, error = await self._root_cause(failed)
        tail = self.provider.logs(self.names[rank], tail_bytes=2000).strip()
        await self._stop_all()
        raise MilesError(
            f"Megatron rank {rank} failed in {method}: {error}; every rank was stopped"
            + (f"\n--- {self.names[rank]} log tail ---\n{tail}" if tail else "")
        )

    async def _root_cause(
        self, failed: list[tuple[int, BaseException]], *, grace_s: float = 1.0
    ) -> tuple[int, BaseException | str]:
        """The rank to blame: one whose process died (its peers' collective errors are the consequence, and may
        arrive first: a dying process closes its sockets before it can be reaped, so it is given ``grace_s`` to show
        as dead), else the first rank that raised."""
        deadline = asyncio.get_running_loop().time() + grace_s
        while True:
            for rank, name in enumerate(self.names):
                if not await self.provider.is_alive(name):
                    return rank, dict(failed).get(rank) or "its process died"
            if asyncio.get_running_loop().time() > deadline:
                return failed[0]
            await asyncio.sleep(0.05)

    async def _stop_all(self) -> None:
        for handle in self.handles:
            await handle.client.aclose()
        self.handles = []
        await self.provider.shutdown()

    def close(self) -> None:
        if self.thread.is_alive():
            try:
                self._run(self._stop_all())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)
