"""``TorchTrainer``: the built-in training backend. A model implementation of the checkpoint's family (by default
``FAMILY/transformers``; ``--model-impl FAMILY=NAME`` chooses another) trained in this process with the PPO-clip
loss on GRPO advantages (importance ratio against the rollout logprobs), optional KL to a frozen reference model and
an entropy bonus; micro-batches, AdamW or SGD (optionally reset after every step) and gradient clipping; checkpoints
in HF format plus optimizer state. With ``--train-lora-rank``, adapters (``peft``) train over the frozen base: only
their parameters are in the optimizer, checkpoints hold the adapter in peft's format beside the unchanged base, and
the engines receive the adapter alone (see :meth:`TorchTrainer.save_adapter`)."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from miles_core.builtin.algorithms import PpoClip
from miles_core.builtin.critic import Critic, load_value_model
from miles_core.default.threads import trainer_threads
from miles_core.engines.weights import unique_named_tensors
from miles_core.errors import MilesError
from miles_core.models.causal_lm import CausalLM
from miles_core.models.hf_checkpoint import (
    checkpoint_named_tensors,
    load_causal_lm,
    require_checkpoint_dir,
    save_hf_checkpoint,
    tokenizer_files,
)
from miles_core.models.moe_routing import replay_routing
from miles_core.models.selection import DSV4_FAMILY, model_implementation_for
from miles_core.models.transformers_impl import TransformersCausalLM
from miles_core.registry import ANY_FAMILY, Implementation
from miles_core.training.algorithms import choose_algorithm, trainer_side, with_weights
from miles_core.training.batch import TrainBatch
from miles_core.training.critic_targets import with_trainer_advantages
from miles_core.training.lora import (
    LoraSettings,
    adapter_digest,
    adapter_tensors,
    add_adapter,
    base_and_merged,
    load_adapter_weights,
    save_adapter,
)
from miles_core.training.losses import entropy, kl_per_token, logits_dtype, token_logprobs
from miles_core.training.objective import Objective, StepShape, averaged, mini_batches, objective_from_spec
from miles_core.training.optimizer import build_optimizer
from miles_core.training.optimizer_reset import reset_optimizer_states
from miles_core.training.weight_iterator import HfWeightIterator
from miles_core.user_files import parse_json_text, read_text
from miles_core.weight_transfer.holders import InProcessHolders

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
ADAPTER_DIR = "adapter"
"""A LoRA checkpoint's adapter, in peft's format (``PeftModel.from_pretrained(base, checkpoint / ADAPTER_DIR)``)."""
DEFAULT_IMPLEMENTATION = "transformers"


class TorchTrainer:
    """Trains ``model`` (a :class:`CausalLM`, or a transformers causal LM) with a ``train`` config section's
    settings. ``hf_config`` (the checkpoint's config) is written into checkpoints; a transformers model brings its
    own. Checkpoints get a copy of the tokenizer files of the model directory ``tokenizer_from`` (none when
    ``None``)."""

    def __init__(
        self,
        model: CausalLM | transformers.PreTrainedModel,
        settings: Any,
        *,
        seed: int = 0,
        reference: CausalLM | None = None,
        hf_config: Any = None,
        tokenizer_from: str | Path | None = None,
        objective: Objective | None = None,
        critic: Critic | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        """``lora``: train a LoRA adapter over the frozen ``model`` (a transformers one) instead of every weight."""
        torch.manual_seed(seed)
        if isinstance(model, transformers.PreTrainedModel):
            hf_config = hf_config or model.config
            model = TransformersCausalLM(model)
        if hf_config is None:
            raise MilesError("TorchTrainer needs the checkpoint's hf_config for a non-transformers model")
        self.lora = lora
        self.adapter = _with_adapter(model, lora) if lora is not None else None
        self.model = model.train()
        self.hf_config = hf_config
        self.tokenizer_from = tokenizer_from
        self.pad_token_id = hf_config.pad_token_id or 0
        self.objective = objective or Objective(train=settings, policy_loss=PpoClip())
        # The weights the objective resolved (the estimator's defaults where unset): the loss, the reference model
        # and the entropy's gradient agree.
        resolved = self.objective.train
        self.settings = settings = with_weights(settings, kl_coef=resolved.kl_coef, entropy_coef=resolved.entropy_coef)
        self.critic = critic
        estimator = self.objective.estimator
        if (critic is not None) != (estimator is not None and estimator.needs_critic):
            raise MilesError("a critic is trained exactly when the objective's estimator needs one (ppo)")
        self.optimizer = build_optimizer(self.trained_parameters(), settings)
        self.logits_dtype = logits_dtype(settings.logits_dtype)
        self.reference = self._reference(reference) if settings.kl_coef > 0 else None
        self.step = 0
        self.implementation = f"{getattr(hf_config, 'model_type', 'model')}/{type(model).__name__}"  # for_run names it

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps: every one, or with LoRA the adapter's alone."""
        return [parameter for parameter in self.model.parameters() if parameter.requires_grad]

    def _reference(self, reference: torch.nn.Module | None) -> torch.nn.Module:
        """The frozen KL reference: the one given, the base under the adapter (LoRA: no copy), or a copy."""
        if reference is not None:
            return _frozen(reference)
        if self.adapter is not None:
            return _AdapterDisabled(self.model, self.adapter)
        return _frozen(copy.deepcopy(self.model))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        settings: Any,
        *,
        seed: int = 0,
        objective: Objective | None = None,
        lora: LoraSettings | None = None,
    ) -> TorchTrainer:
        """The trainer of the HF checkpoint ``path`` (``objective``: the run's loss; default PPO-clip, token-mean;
        ``lora``: a LoRA adapter trained over it, by default ``settings``' own)."""
        tokenizer_from = path if tokenizer_files(path) else None
        lora = lora or LoraSettings.of(settings)
        return cls(
            load_causal_lm(path), settings, seed=seed, tokenizer_from=tokenizer_from, objective=objective, lora=lora
        )

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
    ) -> TorchTrainer:
        """The trainer of a ``miles train`` run (the training-backend interface every backend offers): the model
        implementation chosen for the checkpoint's family. The KL reference is the run's initial model, also when
        ``model_path`` is a checkpoint to resume from."""
        threads = trainer_threads(config)
        if threads is not None:
            torch.set_num_threads(threads)
        hf_config = transformers.AutoConfig.from_pretrained(require_checkpoint_dir(model_path), local_files_only=True)
        name, entry = model_implementation_for(
            config.model.implementations,
            registries,
            family=hf_config.model_type,
            checkpoint=model_path,
            default=DEFAULT_IMPLEMENTATION,
        )
        load = _loader(entry)
        algorithm = choose_algorithm(
            config.train,
            registries,
            group_size=config.rollout.group_size,
            max_new_tokens=config.rollout.max_new_tokens,
        )
        train = with_weights(config.train, kl_coef=algorithm.kl_coef, entropy_coef=algorithm.entropy_coef)
        lora = LoraSettings.of(train)
        if lora is not None and name.rsplit("/", 1)[-1] != DEFAULT_IMPLEMENTATION:
            raise MilesError(
                f"LoRA (--train-lora-rank) trains through peft on the transformers implementation; the model "
                f"implementation {name!r} has no LoRA: drop --model-impl"
            )
        # with LoRA the reference is the frozen base under the adapter (no second copy)
        reference = load(initial_model_path) if algorithm.kl_coef > 0 and lora is None else None
        objective = objective_from_spec(train, algorithm.trainer_spec())
        critic = None
        if algorithm.estimator.needs_critic:
            settings = algorithm.estimator.settings
            source = settings.critic_model or initial_model_path
            what = "train.advantage_estimator_settings.critic_model" if settings.critic_model else "the policy"
            critic = Critic(load_value_model(source, vocab_size=hf_config.vocab_size, what=what), settings, train)
        trainer = cls(
            load(model_path),
            train,
            seed=config.run.seed,
            reference=reference,
            hf_config=hf_config,
            tokenizer_from=initial_model_path,
            objective=objective,
            critic=critic,
            lora=lora,
        )
        trainer.implementation = f"{hf_config.model_type}/{name}"
        return trainer

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""

    def rank_names(self) -> list[str]:
        """One rank: the driver process itself."""
        return ["driver"]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout's update: ``epochs_per_rollout`` passes over the batch, each ``mini_batches_per_rollout``
        optimizer steps (one of each by default), each accumulated over micro-batches; returns the metrics averaged
        over the optimizer steps. With ``tis_clip``, the model's logprobs of every micro-batch are taken first,
        without gradient, before any step, as the old policy of the PPO ratio and of the TIS weights. With
        ``reset_optimizer_states``, the optimizer's moments are reset right after each optimizer step (and a
        checkpoint written after this update holds the reset state)."""
        StepShape.of(batch)  # a batch with nothing to train on is an error, before any step
        critic_metrics: dict[str, float] = {}
        if trainer_side(self.objective.estimator, self.settings):
            batch, critic_metrics = self._with_trainer_advantages(batch)
        plan = []
        for mini in mini_batches(batch, self.settings.mini_batches_per_rollout):
            micros = [
                micro.tensors(pad_token_id=self.pad_token_id)
                for micro in mini.micro_batches(self.settings.micro_batch_size)
            ]
            old = [self._old_logprobs(t) if self.settings.tis_clip is not None else None for t in micros]
            plan.append((StepShape.of(mini), micros, old))
        steps = [self._optimizer_step(*step) for _ in range(self.settings.epochs_per_rollout) for step in plan]
        self.step += 1
        metrics = {**averaged(steps), **critic_metrics}
        return {**metrics, "optimizer_steps": float(len(steps))} if len(steps) > 1 else metrics

    def _with_trainer_advantages(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """The estimator's advantages per token, computed here (:func:`with_trainer_advantages`): from each token's
        reward (less ``kl_coef`` x the KL to the reference with ``kl_placement = reward``) and the critic's values
        of the batch before the update, which also give each sample's returns and old values; and the metrics."""
        penalties = self._reward_kl(batch) if self.settings.kl_placement == "reward" else None
        values = self.critic.response_values(batch, self.pad_token_id) if self.critic is not None else None
        return with_trainer_advantages(
            batch, self.objective.estimator, values, kl_penalties=penalties, kl_coef=self.settings.kl_coef
        )

    @torch.no_grad()
    def _reward_kl(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Each sample's KL to the reference per response token (the run's estimator), of the rollout's logprobs
        (the policy that sampled the tokens) against the reference's."""
        found = []
        for micro in batch.micro_batches(self.settings.micro_batch_size):
            tensors = micro.tensors(pad_token_id=self.pad_token_id)
            input_ids = tensors["input_ids"]
            with self._replayed(self.reference, tensors):
                ref = token_logprobs(self.reference(input_ids)[:, :-1], input_ids[:, 1:], dtype=self.logits_dtype)
            kl = kl_per_token(tensors["rollout_logprobs"], ref, self.objective.kl_estimator)
            for row, sample in enumerate(micro.samples):
                start = len(sample.prompt_ids) - 1
                found.append(kl[row, start : start + len(sample.response_ids)].float().clone())
        return found

    def _optimizer_step(
        self, shape: StepShape, micros: list[dict[str, torch.Tensor]], old: list[torch.Tensor | None]
    ) -> dict[str, float]:
        weights = [self.objective.weight(tensors["response_mask"], shape) for tensors in micros]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for tensors, weight, old_logprobs in zip(micros, weights, old, strict=True):
            metrics = self._accumulate(tensors, weight, old_logprobs)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trained_parameters(), self.settings.max_grad_norm)
        if not self._critic_warming_up():
            self.optimizer.step()
        if self.settings.reset_optimizer_states:
            reset_optimizer_states(self.optimizer)
        metrics = {**sums, "grad_norm": float(grad_norm), "lr": self.settings.lr}
        if self.critic is not None:
            shares = [float(tensors["response_mask"].sum()) / shape.tokens for tensors in micros]
            metrics.update(self.critic.step(micros, shares))
        return metrics

    def _critic_warming_up(self) -> bool:
        """Whether this step trains the critic only (``critic_warmup_steps``: the policy waits for useful values)."""
        return self.critic is not None and self.step < self.critic.settings.critic_warmup_steps

    def _old_logprobs(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's logprobs of the targets before this step, without gradient, in eval mode (no dropout: the
        engines sample without it, and the TIS weight compares with them)."""
        self.model.eval()
        with torch.no_grad():
            input_ids = tensors["input_ids"]
            with self._replayed(self.model, tensors):
                logits = self.model(input_ids)
            return token_logprobs(logits[:, :-1], input_ids[:, 1:], dtype=self.logits_dtype)

    def _replayed(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
        """Routing replay (``routing_replay``) of the micro-batch's routed experts in ``model``'s forwards: each
        token routed to the experts the engine routed it to (tokens without them route themselves)."""
        experts = tensors.get("routed_experts")
        if not self.settings.routing_replay or experts is None:
            return contextlib.nullcontext()
        return replay_routing(model, experts)

    def _accumulate(
        self, tensors: dict[str, torch.Tensor], weight: float, old_logprobs: torch.Tensor | None
    ) -> dict[str, float]:
        input_ids = tensors["input_ids"]
        with self._replayed(self.model, tensors):
            logits = self.model(input_ids)[:, :-1]
        targets = input_ids[:, 1:]
        logprobs = token_logprobs(logits, targets, dtype=self.logits_dtype)
        # Only a bonus needs the entropy's gradient; as a metric alone it stays out of the backward pass (0 times its
        # gradient adds exact zeros to the weights' gradients, at the cost of a pass through softmax and exp).
        with torch.no_grad() if self.settings.entropy_coef == 0 else contextlib.nullcontext():
            token_entropy = entropy(logits, dtype=self.logits_dtype)
        ref_logprobs = None
        if self.reference is not None and self.settings.kl_placement == "loss":
            with torch.no_grad(), self._replayed(self.reference, tensors):
                ref_logprobs = token_logprobs(self.reference(input_ids)[:, :-1], targets, dtype=self.logits_dtype)
        total, metrics = self.objective.loss(
            logprobs, tensors, token_entropy=token_entropy, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs
        )
        (total * weight).backward()
        return {key: float(value.detach()) for key, value in metrics.items()}

    def weight_iterator(self, bucket_bytes: int) -> HfWeightIterator:
        """The HF-named weights, in buckets (tied weights once, as HF checkpoints store them); with LoRA, the base
        with the adapter merged in (for engines that cannot take adapters; the base itself is never changed)."""
        if self.adapter is not None:
            return LoraWeightIterator(self.model.model, merged=True, bucket_bytes=bucket_bytes)
        return CausalLMWeightIterator(self.model, bucket_bytes=bucket_bytes)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """LoRA: the adapter's tensors under peft's saved names."""
        if self.adapter is None:
            raise MilesError("this trainer trains no LoRA adapter (--train-lora-rank)")
        return adapter_tensors(self.adapter)

    def save_adapter(self, directory: str | Path) -> str:
        """LoRA: write the adapter in peft's format to ``directory`` (what engines load by path, as SGLang's
        ``/load_lora_adapter``) and return its digest (:func:`~miles_core.training.lora.adapter_digest`), which the
        engines' report of what they loaded must match."""
        if self.adapter is None:
            raise MilesError("this trainer trains no LoRA adapter (--train-lora-rank)")
        save_adapter(self.adapter, directory)
        return adapter_digest(adapter_tensors(self.adapter))

    def weight_holders(self) -> InProcessHolders:
        """The driver as the one holder of the weights (the degenerate case of protocols that send from holders)."""
        return InProcessHolders(lambda: self.weight_iterator(1 << 62).named_tensors())

    def save_checkpoint(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """HF checkpoint (config, safetensors, the tokenizer's files) plus optimizer state and the trainer's step,
        written atomically."""
        directory = Path(directory)
        partial = directory.with_name(directory.name + ".partial")
        weights = (
            LoraWeightIterator(self.model.model, merged=False, bucket_bytes=1 << 62)
            if self.adapter is not None
            else self.weight_iterator(1 << 62)
        )
        save_hf_checkpoint(partial, dict(weights.named_tensors()), self.hf_config, tokenizer_from=self.tokenizer_from)
        if self.adapter is not None:  # the base above is the run's unchanged one, so the directory is a --model
            save_adapter(self.adapter, partial / ADAPTER_DIR)
        torch.save(self.optimizer.state_dict(), partial / OPTIMIZER_FILE)
        if self.critic is not None:
            self.critic.save(partial)
        (partial / STATE_FILE).write_text(json.dumps({"step": self.step, **(extra or {})}))
        if directory.exists():
            raise MilesError(f"checkpoint {directory} already exists")
        partial.rename(directory)
        return directory

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore weights (LoRA: the adapter; the base is the checkpoint's own, which the trainer was built from),
        optimizer and step from :meth:`save_checkpoint`'s directory; returns its state."""
        directory = Path(directory)
        try:
            if self.adapter is not None:
                load_adapter_weights(self.adapter, directory / ADAPTER_DIR)
            else:
                loaded = type(self.model).from_pretrained(directory)
                self.model.load_state_dict(loaded.state_dict())
            self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))
            if self.critic is not None:
                self.critic.load(directory)
            state = parse_json_text(
                read_text(directory / STATE_FILE, what=STATE_FILE, expected="the trainer's state", limit=1 << 20),
                what=STATE_FILE,
            )
            step = state["step"] if isinstance(state, dict) else None
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"{STATE_FILE} holds no step number: {str(state)[:80]}")
        except Exception as exc:  # torch, safetensors and transformers raise many types for a corrupt checkpoint
            raise MilesError(
                f"cannot resume from the checkpoint {str(directory)!r}: {type(exc).__name__}: {exc}; "
                "move it aside to resume from the one before it"
            ) from None
        self.step = step
        return state


class CausalLMWeightIterator(HfWeightIterator):
    """A :class:`CausalLM`'s :meth:`~CausalLM.hf_state_dict`, tied tensors once (under their first name)."""

    def __init__(self, model: CausalLM, *, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.model = model

    def named_tensors(self):
        for name, tensor in unique_named_tensors(self.model.hf_state_dict().items()):
            yield name, tensor.detach()


class LoraWeightIterator(HfWeightIterator):
    """A LoRA model's weights under their HF checkpoint names: the frozen base, or (``merged``) the base with the
    adapter merged in, computed as new tensors."""

    def __init__(self, model: transformers.PreTrainedModel, *, merged: bool, bucket_bytes: int) -> None:
        super().__init__(bucket_bytes=bucket_bytes)
        self.model, self.merged = model, merged

    def named_tensors(self):
        yield from checkpoint_named_tensors(self.model, base_and_merged(self.model, merged=self.merged))


class _AdapterDisabled(torch.nn.Module):
    """A LoRA model's frozen base as a model of its own: the forward runs with the adapter switched off."""

    def __init__(self, model: torch.nn.Module, adapter: Any) -> None:
        super().__init__()
        self._model, self._adapter = [model], adapter  # in a list: not a submodule (its parameters are not ours)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with self._adapter.disable_adapter():
            return self._model[0](input_ids)


def _with_adapter(model: CausalLM, lora: LoraSettings) -> Any:
    """A peft adapter injected into a :class:`TransformersCausalLM`'s transformers model (in place)."""
    if not isinstance(model, TransformersCausalLM):
        raise MilesError(f"LoRA trains a transformers model through peft; got a {type(model).__name__}")
    return add_adapter(model.model, lora)


def _loader(entry: Implementation) -> Callable[[str | Path], CausalLM]:
    """A function loading a checkpoint with the implementation ``entry`` (the core's transformers one with the
    model's default attention, which is what the engines use too)."""
    if entry.name in (f"{ANY_FAMILY}/{DEFAULT_IMPLEMENTATION}", f"{DSV4_FAMILY}/{DEFAULT_IMPLEMENTATION}"):
        return lambda path: TransformersCausalLM(load_causal_lm(path))
    return entry.load().from_pretrained


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
