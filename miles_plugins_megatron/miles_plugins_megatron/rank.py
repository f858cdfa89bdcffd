"""``MegatronRank``: one rank of the Megatron trainer, run as a worker (one process per rank).

The driver (:class:`~miles_plugins_megatron.trainer.MegatronTrainer`) calls the same method on every rank at once;
the ranks meet in torch.distributed collectives (gloo on CPU, NCCL on GPU). Rank 0 writes what leaves the group
(exported HF weights) to files the driver reads.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_core import (
    DSV4_FAMILY,
    NOT_ROUTED,
    MilesError,
    StepShape,
    TrainBatch,
    TrainSection,
    averaged,
    bind_collectives_to,
    build_optimizer,
    clipped_value_loss,
    kl_per_token,
    logits_dtype,
    mini_batches,
    node_address,
    objective_from_spec,
    reserve_rendezvous,
    reset_optimizer_states,
    response_values,
    rpc_method,
    tcp_init_method_address,
    tcp_store,
    trainer_side,
    with_trainer_advantages,
)

EXPORT_FILE = "weights.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MegatronRank:
    """Holds one rank's model shard, its optimizer, (with a KL term) a frozen reference shard and (with an estimator
    that needs one) a critic shard and its optimizer."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        tensor_parallel: int,
        expert_parallel: int = 1,
        model_path: str,
        train: dict[str, Any],
        seed: int,
        export_dir: str,
        backend: str,
        dtype: str = "float32",
        threads: int | None = None,
        reference_path: str | None = None,
        objective: dict[str, Any] | None = None,
    ) -> None:
        """``objective``: the run's loss (``AlgorithmChoice.trainer_spec()``, which the driver resolved)."""
        self.rank, self.world_size = rank, world_size
        self.tensor_parallel, self.backend, self.dtype = tensor_parallel, backend, DTYPES[dtype]
        self.expert_parallel = expert_parallel
        self.model_path, self.seed, self.export_dir = Path(model_path), seed, Path(export_dir)
        self.train = TrainSection.model_validate(train)  # the driver's train section, checked again here
        if objective is None:
            raise MilesError("a Megatron rank needs the run's objective (the driver's AlgorithmChoice.trainer_spec())")
        self.objective = objective_from_spec(self.train, objective)
        self.train = self.objective.train  # its kl_coef resolved by the driver (the estimator's default where unset)
        self.logits_dtype = logits_dtype(self.train.logits_dtype)
        self.threads = threads
        self.reference_path = reference_path
        self.model: torch.nn.Module | None = None
        self.critic: torch.nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self._rendezvous: socket.socket | None = None  # rank 0: the group's store socket, open ahead of setup

    # -- setup ------------------------------------------------------------------------------------------------

    @rpc_method(group="train")
    def rendezvous(self) -> str:
        """Rank 0's part before :meth:`setup`: where the ranks meet (``tcp://`` this rank's node address and a port
        free there), its socket held open for the group's store."""
        init_method, self._rendezvous = reserve_rendezvous(node_address())
        return init_method

    @rpc_method(group="train")
    def setup(self, init_method: str) -> dict[str, Any]:
        """Join the process group at ``init_method`` (what rank 0's :meth:`rendezvous` returned), build this rank's
        shard of the model and load the checkpoint into it."""
        from megatron.core import parallel_state  # deferred: megatron-core takes ~10 s to import

        from miles_plugins_megatron.checkpoint import read_hf_config
        from miles_plugins_megatron.cpu_compat import seed_model_parallel_rng

        if self.threads:
            torch.set_num_threads(self.threads)
        torch.manual_seed(self.seed)
        self.device = torch.device("cpu")
        if torch.cuda.is_available():  # each rank its own GPU (under Ray each actor sees only its own)
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(minutes=10)
        bind_collectives_to(node_address())  # the ranks' gloo/NCCL pairs on this node's address, not loopback
        host, port = tcp_init_method_address(init_method)
        store = tcp_store(
            host, port, world_size=self.world_size, is_master=self.rank == 0, timeout=timeout, listener=self._rendezvous
        )
        self._rendezvous = None  # the store owns the socket now
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_parallel, expert_model_parallel_size=self.expert_parallel
        )
        seed_model_parallel_rng(self.seed)
        self.hf_config = read_hf_config(self.model_path)  # the driver checked that it is supported
        self.model = self._build_model()
        self.model.to(self.device)
        self.load_weights(str(self.model_path))
        self.optimizer = build_optimizer(self.model.parameters(), self.train)
        self.reference = self._frozen_reference() if self.train.kl_coef > 0 else None
        estimator = self.objective.estimator
        if estimator is not None and estimator.needs_critic:
            self.critic = self._build_critic()
            self.critic_optimizer = torch.optim.AdamW(
                self.critic.parameters(), lr=estimator.settings.critic_lr, weight_decay=0.0
            )
        self.step = 0
        return {
            "rank": self.rank,
            "tensor_parallel_rank": parallel_state.get_tensor_model_parallel_rank(),
            "data_parallel_rank": parallel_state.get_data_parallel_rank(),
            "expert_parallel_rank": parallel_state.get_expert_model_parallel_rank(),
            "pid": os.getpid(),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "device": str(self.device),
        }

    def _build_model(self) -> torch.nn.Module:
        from miles_plugins_megatron.model import build_gpt_model

        if self.hf_config.model_type == DSV4_FAMILY:
            from miles_plugins_megatron.deepseek_v4 import build_deepseek_v4  # megatron-core's parallel layers

            return build_deepseek_v4(self.hf_config, dtype=self.dtype)
        return build_gpt_model(
            self.hf_config,
            tensor_parallel=self.tensor_parallel,
            expert_parallel=self.expert_parallel,
            dtype=self.dtype,
        )

    def _frozen_reference(self) -> torch.nn.Module:
        """A second shard with the reference weights (the run's initial model, else the current weights) and no
        gradients (megatron modules cannot be deep-copied)."""
        reference = self._build_model()
        if self.reference_path is not None and Path(self.reference_path) != self.model_path:
            self._load_into(reference, self.reference_path)
        else:
            reference.load_state_dict(self.model.state_dict())
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference.to(self.device).eval()

    def _build_critic(self) -> torch.nn.Module:
        """The critic shard: the policy's architecture loaded from ``critic_model`` (else the run's initial
        checkpoint), its output layer a zeroed value head (:mod:`miles_plugins_megatron.critic`)."""
        from miles_plugins_megatron.checkpoint import read_hf_config
        from miles_plugins_megatron.critic import architecture_difference, as_value_model

        critic = self._build_model()
        critic_model = self.objective.estimator.settings.critic_model
        if critic_model is not None:
            difference = architecture_difference(self.hf_config, read_hf_config(critic_model))
            if difference is not None:
                raise MilesError(f"critic_model {critic_model!r}: its {difference}; the critic has the policy's")
        self._load_into(critic, str(critic_model or self.reference_path or self.model_path))
        return as_value_model(critic, dtype=self.dtype).to(self.device)

    @rpc_method(group="train")
    def load_weights(self, path: str) -> int:
        """Load an HF checkpoint directory into this rank's shard; returns the number of tensors loaded."""
        return self._load_into(self.model, path)

    def _load_into(self, model: torch.nn.Module, path: str) -> int:
        from megatron.core import parallel_state

        from miles_plugins_megatron.checkpoint import read_hf_state
        from miles_plugins_megatron.conversion import (
            global_expert_name,
            hf_to_megatron,
            is_expert_parameter,
            num_experts,
            shard_for_rank,
        )

        if self.hf_config.model_type == DSV4_FAMILY:
            from miles_plugins_megatron.deepseek_v4 import load_hf_state

            return load_hf_state(model, read_hf_state(path), source=f"checkpoint {path!r}")
        full = hf_to_megatron(read_hf_state(path), self.hf_config)
        local = {name: t for name, t in model.state_dict().items() if not name.endswith("_extra_state")}
        ep_rank, local_experts = (
            parallel_state.get_expert_model_parallel_rank(),
            num_experts(self.hf_config) // self.expert_parallel,
        )
        sources = {name: global_expert_name(name, expert_rank=ep_rank, local_experts=local_experts) for name in local}
        missing = sorted(source for source in sources.values() if source not in full)
        if missing:
            raise MilesError(f"checkpoint {path!r} lacks Megatron weights {missing[:5]}")
        dense = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
        expert = (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
        with torch.no_grad():
            for name, tensor in local.items():
                tp_rank, tp_size = expert if is_expert_parameter(name) else dense
                tensor.copy_(shard_for_rank(name, full[sources[name]], tensor.shape, tp_rank, tp_size))
        return len(local)

    # -- training ---------------------------------------------------------------------------------------------

    @rpc_method(group="train")
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over the whole batch: this rank's data-parallel share of its samples in
        micro-batches, gradients summed over data-parallel ranks, clipped by the global norm. With ``tis_clip``,
        the shard's logprobs of every micro-batch are taken first, without gradient, as the old policy of the PPO
        ratio and of the TIS weights. With ``reset_optimizer_states``, the shard's optimizer moments are reset right
        after the step, as the torch trainer's. The batch arrives as a ``TrainBatch``: the RPC rebuilds it from this
        hint."""
        from megatron.core import parallel_state

        StepShape.of(batch)  # a batch with nothing to train on is an error, before any step
        critic_metrics: dict[str, float] = {}
        if trainer_side(self.objective.estimator, self.train):  # every rank, on the whole batch: the same numbers
            values = self._critic_values(batch) if self.critic is not None else None
            in_reward = self.train.kl_placement == "reward" and self.reference is not None
            penalties = self._reward_kl(batch) if in_reward else None
            batch, critic_metrics = with_trainer_advantages(
                batch, self.objective.estimator, values, kl_penalties=penalties, kl_coef=self.train.kl_coef
            )
        rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        plan = []
        for mini in mini_batches(batch, self.train.mini_batches_per_rollout):
            share = _data_parallel_share(mini, rank, size)
            pad = self._pad_id
            micros = [
                {k: v.to(self.device) for k, v in micro.tensors(pad_token_id=pad).items()}
                for micro in (share.micro_batches(self.train.micro_batch_size) if share.samples else [])
            ]
            if self.expert_parallel > 1:
                micros = self._aligned_micro_batches(micros, pad)
            old = [self._old_logprobs(t) if self.train.tis_clip is not None else None for t in micros]
            plan.append((StepShape.of(mini), micros, old))
        steps = [self._optimizer_step(*step) for _ in range(self.train.epochs_per_rollout) for step in plan]
        self.step += 1
        metrics = {**averaged(steps), **critic_metrics}
        return {**metrics, "optimizer_steps": float(len(steps))} if len(steps) > 1 else metrics

    def _critic_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The critic's value of each response token of every sample (1-D each), before the update, in eval mode."""
        self.critic.eval()
        found = []
        with torch.no_grad():
            for micro in batch.micro_batches(self.train.micro_batch_size):
                input_ids = micro.tensors(pad_token_id=self._pad_id)["input_ids"].to(self.device)
                found += response_values(self._values(input_ids).cpu(), micro)
        return found

    def _reward_kl(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Each sample's KL to the reference per response token (``kl_placement = reward``: subtracted from its
        token rewards), of the rollout's logprobs against the reference shard's, as the torch trainer takes it."""
        from miles_plugins_megatron.parallel_losses import vocab_parallel_logprobs_and_entropy

        found = []
        with torch.no_grad():
            for micro in batch.micro_batches(self.train.micro_batch_size):
                tensors = {k: v.to(self.device) for k, v in micro.tensors(pad_token_id=self._pad_id).items()}
                input_ids = tensors["input_ids"]
                ref, _ = vocab_parallel_logprobs_and_entropy(
                    self._forward(self.reference, input_ids, self._replayed(tensors))[:, :-1],
                    input_ids[:, 1:],
                    dtype=self.logits_dtype,
                )
                kl = kl_per_token(tensors["rollout_logprobs"], ref, self.objective.kl_estimator)
                found += response_values(kl.cpu(), micro)
        return found

    def _values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The critic's value of each position's next token ``[B, L-1]`` (aligned with the targets)."""
        return self._forward(self.critic, input_ids)[:, :-1, 0].float()

    def _critic_step(self, shape: StepShape, micros: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One optimizer step of the critic's clipped value loss over this rank's micro-batches, each weighted by its
        share of the (mini-)batch's tokens; gradients summed over data-parallel ranks and clipped as the policy's."""
        from megatron.core import parallel_state

        self.critic.train()
        self.critic_optimizer.zero_grad(set_to_none=True)
        clip = self.objective.estimator.settings.value_clip
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for tensors in micros:
            weight = float(tensors["response_mask"].sum()) / shape.tokens
            loss = clipped_value_loss(self._values(tensors["input_ids"]), tensors, clip=clip)
            (loss * weight).backward()
            total += float(loss.detach()) * weight
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        grad_norm = self._finish_gradients(self.critic)
        self.critic_optimizer.step()
        return {"critic/value_loss": float(total), "critic/grad_norm": grad_norm}

    def _critic_warming_up(self) -> bool:
        """Whether this step trains the critic only (``critic_warmup_steps``: the policy waits for useful values)."""
        return self.critic is not None and self.step < self.objective.estimator.settings.critic_warmup_steps

    def _optimizer_step(
        self, shape: StepShape, micros: list[dict[str, torch.Tensor]], old: list[torch.Tensor | None]
    ) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches of a (mini-)batch of the shape ``shape``."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for tensors, old_logprobs in zip(micros, old, strict=True):
            weight = self.objective.weight(tensors["response_mask"], shape)
            for key, value in self._accumulate(tensors, weight, old_logprobs).items():
                sums[key] = sums.get(key, 0.0) + value * weight
        metrics = self._reduce_metrics(sums)
        grad_norm = self._finish_gradients(self.model)
        if not self._critic_warming_up():
            self.optimizer.step()
        if self.train.reset_optimizer_states:
            reset_optimizer_states(self.optimizer)
        metrics = {**metrics, "grad_norm": grad_norm, "lr": self.train.lr}
        if self.critic is not None:
            metrics.update(self._critic_step(shape, micros))
        return metrics

    @property
    def _pad_id(self) -> int:
        return self.hf_config.pad_token_id or 0

    def _aligned_micro_batches(self, micros: list[dict[str, torch.Tensor]], pad: int) -> list[dict[str, torch.Tensor]]:
        """Expert-parallel ranks exchange every MoE layer's tokens, forward and backward, in collectives that need as
        many tokens from each rank: every rank runs as many micro-batches, each padded to the same ``[rows, length]``
        (the padding trains no token: its response mask is 0, and causal attention keeps it out of real tokens)."""
        longest = max((micro["input_ids"].shape[1] for micro in micros), default=2)
        shape = torch.tensor([len(micros), longest], device=self.device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX)
        count, length = shape.tolist()
        rows = self.train.micro_batch_size
        aligned = []
        for index in range(count):
            micro = micros[index] if index < len(micros) else None
            padded = {
                "input_ids": torch.full((rows, length), pad, dtype=torch.long, device=self.device),
                "response_mask": torch.zeros((rows, length - 1), device=self.device),
                "rollout_logprobs": torch.zeros((rows, length - 1), device=self.device),
                "rewards": torch.zeros((rows,), device=self.device),
                "advantages": torch.zeros(
                    (rows, length - 1) if micro is not None and micro["advantages"].dim() == 2 else (rows,),
                    device=self.device,
                ),
            }
            if self.critic is not None:  # the critic's targets, aligned as the mask
                for key in ("returns", "old_values"):
                    padded[key] = torch.zeros((rows, length - 1), device=self.device)
            if micro is not None and "routed_experts" in micro:
                routed = micro["routed_experts"]
                padded["routed_experts"] = torch.full(
                    (rows, length, *routed.shape[2:]), NOT_ROUTED, dtype=routed.dtype, device=self.device
                )
            for key, tensor in (micro or {}).items():
                padded[key][tuple(slice(0, size) for size in tensor.shape)] = tensor
            aligned.append(padded)
        return aligned

    def _forward(
        self, model: torch.nn.Module, input_ids: torch.Tensor, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's vocabulary slice of the logits ``[B, T, V/tp]``; with ``routed_experts`` (``[B, T, layers,
        top_k]``), every token routed to its recorded experts."""
        from miles_plugins_megatron.cpu_compat import causal_mask
        from miles_plugins_megatron.routing_replay import replay_routing

        length = input_ids.shape[1]
        if model.config.sequence_parallel:  # the sequence splits evenly over tensor-parallel ranks
            input_ids, routed_experts = _padded_to_multiple(
                input_ids, routed_experts, self.tensor_parallel, pad=self._pad_id
            )
        padded_length = input_ids.shape[1]
        positions = torch.arange(padded_length, device=self.device).expand(input_ids.shape[0], -1)
        with replay_routing(model, routed_experts):
            logits = model(
                input_ids=input_ids, position_ids=positions, attention_mask=causal_mask(padded_length).to(self.device)
            )
        return logits[:, :length]

    def _replayed(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The micro-batch's recorded experts when the run replays routing (``--train-routing-replay``)."""
        return tensors.get("routed_experts") if self.train.routing_replay else None

    def _old_logprobs(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The shard's logprobs of the targets before this step, without gradient, in eval mode (as the torch
        trainer takes them)."""
        from miles_plugins_megatron.parallel_losses import vocab_parallel_logprobs_and_entropy

        self.model.eval()
        with torch.no_grad():
            input_ids = tensors["input_ids"]
            logprobs, _ = vocab_parallel_logprobs_and_entropy(
                self._forward(self.model, input_ids, self._replayed(tensors))[:, :-1],
                input_ids[:, 1:],
                dtype=self.logits_dtype,
            )
        return logprobs

    def _accumulate(
        self, tensors: dict[str, torch.Tensor], weight: float, old_logprobs: torch.Tensor | None
    ) -> dict[str, float]:
        from miles_plugins_megatron.parallel_losses import vocab_parallel_logprobs_and_entropy

        input_ids = tensors["input_ids"]
        targets = input_ids[:, 1:]
        logprobs, token_entropy = vocab_parallel_logprobs_and_entropy(
            self._forward(self.model, input_ids, self._replayed(tensors))[:, :-1],
            targets,
            dtype=self.logits_dtype,
        )
        ref_logprobs = None
        if self.reference is not None and self.train.kl_placement == "loss":
            with torch.no_grad():
                ref_logprobs, _ = vocab_parallel_logprobs_and_entropy(
                    self._forward(self.reference, input_ids, self._replayed(tensors))[:, :-1],
                    targets,
                    dtype=self.logits_dtype,
                )
        total, metrics = self.objective.loss(
            logprobs, tensors, token_entropy=token_entropy, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs
        )
        (total * weight).backward()
        return {key: float(value.detach()) for key, value in metrics.items()}

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Token-weighted metric sums added over data-parallel ranks (a rank with no samples adds zeros)."""
        from megatron.core import parallel_state

        keys = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "approx_kl_rollout")
        if self.train.tis_clip is not None:  # every rank knows the keys from the settings, also one with no samples
            keys += ("tis_weight_mean", "tis_clip_fraction")
        values = torch.tensor([sums.get(key, 0.0) for key in keys], dtype=torch.float64, device=self.device)
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
        return dict(zip(keys, values.tolist(), strict=True))

    def _finish_gradients(self, model: torch.nn.Module) -> float:
        """Sum gradients over data-parallel ranks (an expert's over the ranks holding a copy of it), then clip by
        the global norm (each tensor-parallel shard counted once, each expert once, each replicated tensor once);
        returns the norm before clipping."""
        from megatron.core import parallel_state

        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        expert = [_is_expert(name, p) for name, p in named]
        dense_grads = [grad for grad, is_expert in zip(grads, expert, strict=True) if not is_expert]
        expert_grads = [grad for grad, is_expert in zip(grads, expert, strict=True) if is_expert]
        if parallel_state.get_data_parallel_world_size() > 1:
            _all_reduce_in_place(dense_grads, parallel_state.get_data_parallel_group())
        if expert_grads and parallel_state.get_expert_data_parallel_world_size() > 1:
            _all_reduce_in_place(expert_grads, parallel_state.get_expert_data_parallel_group())
        self._sum_replicated_partial_grads(model, params, grads)
        sharded, replicated, experts = (torch.zeros((), dtype=torch.float64, device=self.device) for _ in range(3))
        for param, grad, is_expert in zip(params, grads, expert, strict=True):
            square = grad.double().pow(2).sum()
            if is_expert:
                experts += square
            elif getattr(param, "tensor_model_parallel", False):
                sharded += square
            else:
                replicated += square
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        if expert_grads and parallel_state.get_expert_tensor_and_model_parallel_world_size() > 1:
            dist.all_reduce(experts, group=parallel_state.get_expert_tensor_and_model_parallel_group())
        norm = float((sharded + replicated + experts).sqrt())
        scale = min(1.0, self.train.max_grad_norm / (norm + 1e-6))
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.mul_(scale)
        return norm

    @rpc_method(group="train")
    def logits(
        self, input_ids: list[list[int]], routed_experts: list[list[list[list[int]]]] | None = None
    ) -> list[list[list[float]]]:
        """Full-vocabulary logits ``[B, T, V]`` for ``input_ids`` (gathered over tensor-parallel ranks); with
        ``routed_experts`` (``[B, T, layers, top_k]``), every token routed to its recorded experts."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        routes = None if routed_experts is None else torch.tensor(routed_experts, dtype=torch.long, device=self.device)
        self.model.eval()
        with torch.no_grad():
            local = self._forward(self.model, torch.tensor(input_ids, dtype=torch.long, device=self.device), routes)
            return gather_from_tensor_model_parallel_region(local).float().cpu().tolist()

    def _sum_replicated_partial_grads(
        self, model: torch.nn.Module, params: list[torch.nn.Parameter], grads: list[torch.Tensor]
    ) -> None:
        """Weights replicated on every tensor-parallel rank whose gradient each rank holds only part of: sum the parts
        (as megatron-core's finalize_model_grads does). They are the per-head qk-layernorms (each rank normalises
        only its own heads) and, under sequence parallelism, every weight marked ``sequence_parallel`` (norms and
        routers that see only this rank's shard of the sequence)."""
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return
        per_head_norms = not getattr(model.config, "multi_latent_attention", False)
        names = {id(param): name for name, param in model.named_parameters()}
        partial = [
            grad
            for param, grad in zip(params, grads, strict=True)
            if getattr(param, "sequence_parallel", False)
            or (per_head_norms and ("q_layernorm" in names[id(param)] or "k_layernorm" in names[id(param)]))
        ]
        if partial:
            _all_reduce_in_place(partial, parallel_state.get_tensor_model_parallel_group())

    # -- export and checkpoints -------------------------------------------------------------------------------

    @rpc_method(group="train")
    def export_hf(self) -> dict[str, Any]:
        """Gather the HF weights (every rank takes part); rank 0 writes them to ``export_dir/weights.safetensors``."""
        from safetensors.torch import save_file

        from miles_plugins_megatron.weight_iterator import hf_weight_iterator

        started = time.perf_counter()
        tensors = dict(hf_weight_iterator(self.model, self.hf_config, bucket_bytes=1 << 30).named_tensors())
        gathered = time.perf_counter()
        if self.rank != 0:
            return {}
        path = self.export_dir / EXPORT_FILE
        partial = path.with_suffix(".partial")
        save_file(
            {name: tensor.contiguous().cpu() for name, tensor in tensors.items()},
            str(partial),
            metadata={"format": "pt", "step": str(self.step)},
        )
        partial.rename(path)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {
            "path": str(path),
            "bytes": nbytes,
            "gather_s": gathered - started,
            "write_s": time.perf_counter() - gathered,
            "step": self.step,
        }

    @rpc_method(group="train")
    def run_weight_task(self, task: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Run a weight-transfer protocol's holder task on this rank's share of the HF tensors (every rank at once:
        they gather each tensor together, and each keeps every world-size-th one). A failing task (an engine that
        died, say) comes back as ``holder_error``: the protocol fails, the ranks live on."""
        from miles_core import round_robin_share, run_holder_task_safely
        from miles_plugins_megatron.weight_iterator import hf_weight_iterator

        tensors = hf_weight_iterator(self.model, self.hf_config, bucket_bytes=1 << 30).named_tensors()
        share = round_robin_share(tensors, holder=self.rank, holders=self.world_size)
        return run_holder_task_safely(task, share, holder=self.rank, holders=self.world_size, **kwargs)

    @rpc_method(group="train")
    def save_optimizer(self, directory: str) -> str:
        path = Path(directory) / f"optimizer_rank{self.rank:03d}.pt"
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "world_size": self.world_size,
                "tensor_parallel": self.tensor_parallel,
                "expert_parallel": self.expert_parallel,
                **(
                    {"critic": self.critic.state_dict(), "critic_optimizer": self.critic_optimizer.state_dict()}
                    if self.critic is not None
                    else {}
                ),
            },
            path,
        )
        return str(path)

    @rpc_method(group="train")
    def load_checkpoint(self, directory: str) -> int:
        """Weights from the HF files, optimizer state and step from this rank's optimizer file."""
        path = Path(directory) / f"optimizer_rank{self.rank:03d}.pt"
        if not path.is_file():
            raise MilesError(f"{path} is missing: was the checkpoint written by {self.world_size} Megatron ranks?")
        state = torch.load(path, weights_only=True, map_location=self.device)
        saved = (state["world_size"], state["tensor_parallel"], state.get("expert_parallel", 1))
        if saved != (self.world_size, self.tensor_parallel, self.expert_parallel):
            raise MilesError(
                f"checkpoint {directory} was written with world size {saved[0]}, tensor parallel {saved[1]} and "
                f"expert parallel {saved[2]}; this run has {self.world_size}, {self.tensor_parallel} and "
                f"{self.expert_parallel}"
            )
        self.load_weights(directory)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.critic is not None:
            if "critic" not in state:
                raise MilesError(f"checkpoint {directory} holds no critic: it was not a ppo run's")
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.step = state["step"]
        return self.step

    @rpc_method(group="control")
    def shutdown(self) -> None:
        """Leave the process group (the worker process is stopped by its provider afterwards)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_expert(name: str, param: torch.Tensor) -> bool:
    """Whether ``param`` is a routed expert's (held by one expert-parallel rank only): megatron-core's experts by
    name, the ``miles`` DeepSeek-V4's by megatron-core's mark, ``allreduce=False``."""
    from miles_plugins_megatron.conversion import is_expert_parameter

    return is_expert_parameter(name) or getattr(param, "allreduce", True) is False


def _all_reduce_in_place(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` over ``group`` in one collective (flattened into one buffer), in place."""
    flat = torch._utils._flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for tensor, reduced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True):
        tensor.copy_(reduced)


def _padded_to_multiple(
    input_ids: torch.Tensor, routed_experts: torch.Tensor | None, multiple: int, *, pad: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids`` (and recorded routes) padded on the right to a length divisible by ``multiple``: causal
    attention keeps the padding out of the real tokens, and a padded token routes by its own top-k."""
    extra = -input_ids.shape[1] % multiple
    if extra == 0:
        return input_ids, routed_experts
    input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=pad)
    if routed_experts is not None:
        filler = routed_experts.new_full((routed_experts.shape[0], extra, *routed_experts.shape[2:]), NOT_ROUTED)
        routed_experts = torch.cat([routed_experts, filler], dim=1)
    return input_ids, routed_experts


def _data_parallel_share(batch: TrainBatch, rank: int, size: int) -> TrainBatch:
    """Contiguous, nearly equal shares of the batch, one per data-parallel rank."""
    bounds = [len(batch) * index // size for index in range(size + 1)]
    return TrainBatch(batch.samples[bounds[rank] : bounds[rank + 1]])
