"""The config sections that the core contributes (through its built-in plugin)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import pydantic

from miles_core.bounds import MAX_BUFFER_MB, at_most_memory_share
from miles_core.config.section import Section
from miles_core.fault_injection import parse_faults
from miles_core.workers.ray_settings import check_ray_address, check_resources
from miles_core.workers.specs import ENGINE, ROUTER, SESSION_SERVER, TRAINER

FamilyName = Annotated[str, pydantic.StringConstraints(pattern=r"^[a-z0-9_]+$")]


MAX_THREADS = 1024
"""The most CPU threads one trainer or engine process may be asked for (more than the largest machine's cores)."""
MAX_ENGINES = 1024
"""The most engines a run may start."""
MAX_BATCH = 65536
"""The most requests one engine may be asked to sample together."""


class RunSection(Section):
    """Where a run writes and how it is seeded."""

    seed: int = pydantic.Field(default=1234, ge=0, description="Seed of every random generator of the run.")
    output_dir: str = pydantic.Field(default="runs/latest", min_length=1, description="Directory of the run.")
    num_steps: int = pydantic.Field(default=200, gt=0, description="RL steps to run.")
    schedule: Literal["sync", "one_step_off", "fully_async"] = pydantic.Field(
        default="sync",
        description="sync: generate, train, update; one_step_off: generate step k+1 while training k; fully_async: "
        "generation never stops, the trainer takes finished groups from a buffer (--rollout-max-staleness bounds how "
        "old they may be).",
    )
    eval_every: int = pydantic.Field(default=25, ge=0, description="Evaluate every N steps (0: only at start/end).")
    checkpoint_every: int = pydantic.Field(default=50, ge=0, description="Checkpoint every N steps (0: at end).")
    resume: bool = pydantic.Field(default=False, description="Continue from the newest checkpoint in output_dir.")
    worker_provider: str = pydantic.Field(default="local", description="Worker provider (`miles plugins`).")
    ray_address: str | None = pydantic.Field(
        default=None,
        description="With --run-worker-provider ray: the Ray cluster to join, HOST:PORT of its head (GCS) or 'auto'; "
        "None: RAY_ADDRESS if set, else a local Ray on 127.0.0.1. A cluster with token authentication also needs "
        "RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).",
    )
    ray_trainer_resources: dict[str, float] = pydantic.Field(
        default_factory=dict,
        description="Custom Ray resources each trainer rank's bundle asks for besides its CPUs and GPUs, pinning the "
        "ranks to the nodes that offer them, e.g. {trainer_node: 0.001}.",
    )
    ray_engine_resources: dict[str, float] = pydantic.Field(
        default_factory=dict,
        description="Custom Ray resources each engine worker's bundle asks for, pinning engines to the nodes that "
        "offer them, e.g. {engine_node: 0.001}.",
    )
    ray_router_resources: dict[str, float] = pydantic.Field(
        default_factory=dict,
        description="Custom Ray resources the router's bundle asks for, pinning it to the nodes that offer them.",
    )
    ray_session_resources: dict[str, float] = pydantic.Field(
        default_factory=dict,
        description="Custom Ray resources each session server's bundle asks for (agent runs), pinning the session "
        "servers to the nodes that offer them.",
    )

    fault_injection: list[str] = pydantic.Field(
        default_factory=list,
        description="Faults to inject, to watch the recovery: kill_engine[:ENGINE]@step=N (as step N's rollout "
        "starts) or kill_engine[:ENGINE]@weight_update=N (as step N's weight update starts); ENGINE defaults to "
        "engine-0; comma-separated on the command line.",
    )

    @pydantic.field_validator("fault_injection", mode="before")
    @classmethod
    def _faults(cls, value: object) -> object:
        return parse_faults(value)

    @pydantic.field_validator("ray_address")
    @classmethod
    def _known_address_form(cls, value: str | None) -> str | None:
        return None if value is None else check_ray_address(value)

    @pydantic.field_validator(
        "ray_trainer_resources", "ray_engine_resources", "ray_router_resources", "ray_session_resources"
    )
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        return check_resources(value)

    @pydantic.model_validator(mode="after")
    def _ray_settings_need_ray(self) -> RunSection:
        given = [name for name in RAY_FIELDS if getattr(self, name)]
        if given and self.worker_provider != "ray":
            flags = ", ".join(f"--run-{name.replace('_', '-')}" for name in given)
            raise ValueError(
                f"{', '.join(given)} ({flags}) place workers with Ray; they need worker_provider ray "
                f"(--run-worker-provider ray), not {self.worker_provider!r}"
            )
        return self

    @property
    def ray_resources_by_role(self) -> dict[str, dict[str, float]]:
        """Role (``trainer``, ``engine``, ``router``, ``session_server``) -> the custom resources its workers'
        bundles ask for."""
        by_role = {
            TRAINER: self.ray_trainer_resources,
            ENGINE: self.ray_engine_resources,
            ROUTER: self.ray_router_resources,
            SESSION_SERVER: self.ray_session_resources,
        }
        return {role: resources for role, resources in by_role.items() if resources}


RAY_FIELDS = (
    "ray_address",
    "ray_trainer_resources",
    "ray_engine_resources",
    "ray_router_resources",
    "ray_session_resources",
)
"""The ``run`` fields that only the Ray worker provider reads."""


class ModelSection(Section):
    """The policy model and the implementation chosen for each model family."""

    path: str | None = pydantic.Field(
        default=None, description="HF checkpoint directory; None runs the embedded tiny default model."
    )
    implementations: dict[FamilyName, str] = pydantic.Field(
        default_factory=dict,
        description="Model family -> implementation name (see `miles plugins`); set with --model-impl FAMILY=NAME.",
    )


class RolloutSection(Section):
    """How prompts are sampled and answered."""

    batch_size: int = pydantic.Field(default=16, gt=0, description="Prompts per step.")
    group_size: int = pydantic.Field(
        default=8,
        ge=1,
        le=4096,
        description="Samples per prompt (a group; grpo, dr_grpo, rloo and the baselines need at least 2).",
    )
    max_new_tokens: int = pydantic.Field(default=8, gt=0, description="Maximum response length in tokens.")
    temperature: float = pydantic.Field(default=1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = pydantic.Field(default=-1, ge=-1, description="Top-k sampling; -1 disables it.")
    task: str = pydantic.Field(
        default="echo_last",
        description="Task (`miles plugins` lists them): its prompts when no prompt file is given, and the reward "
        "function of the same name when no reward is.",
    )
    prompts: list[str] | None = pydantic.Field(
        default=None,
        description="Prompt data: JSONL, JSON, Parquet or Arrow files (comma-separated on the command line) or a "
        "directory of them; None: the task's prompts.",
    )
    eval_prompts: list[str] | None = pydantic.Field(
        default=None, description="Held-out eval prompts, given as --prompts is; None: the first 64 prompts."
    )
    prompt_key: str | None = pydantic.Field(
        default=None,
        description="Column of the prompt (a string or a list of chat messages); None: 'prompt', and a column "
        "other than prompt, label, metadata and tools is refused. Naming any key ignores unnamed columns.",
    )
    label_key: str | None = pydantic.Field(default=None, description="Column of the label; None: 'label'.")
    metadata_keys: list[str] = pydantic.Field(
        default_factory=list,
        description="Columns collected into each prompt's metadata (comma-separated on the command line), merged "
        "into a 'metadata' object column if there is one.",
    )
    tools_key: str | None = pydantic.Field(
        default=None, description="Column of the tool definitions given to the chat template; None: 'tools'."
    )
    apply_chat_template: bool | None = pydantic.Field(
        default=None,
        description="None (auto): chat-message prompts are rendered with the tokenizer's chat template, strings "
        "are not; true: strings too, each as one user message; false: chat-message prompts are refused.",
    )
    chat_template_kwargs: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description="Keyword arguments of the chat template, e.g. {enable_thinking: false}.",
    )
    chat_template_file: str | None = pydantic.Field(
        default=None, description="Jinja file replacing the tokenizer's chat template."
    )
    eval_samples: int = pydantic.Field(
        default=1,
        ge=1,
        le=1024,
        description="K: each eval prompt is also sampled K times at the rollout temperature, besides its greedy "
        "answer, for eval/pass@K and eval/mean@K; 1: the greedy answer only.",
    )
    eval_pass_threshold: float | None = pydantic.Field(
        default=None,
        allow_inf_nan=False,
        description="An eval sample passes (eval/pass@K) when its reward is at least this; None: when it is above 0.",
    )
    reward: str | None = pydantic.Field(
        default=None,
        description="Reward: a registry name or module:function, or weighted parts summed, NAME[:WEIGHT],... "
        "(math:1.0,format:0.1; remote is the --reward-url server); None: the task's own (remote with --reward-url).",
    )
    reward_dispatch_key: str | None = pydantic.Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Metadata field naming each sample's data source, whose reward reward_by_source gives.",
    )
    reward_by_source: dict[str, str] = pydantic.Field(
        default_factory=dict,
        description="Data source -> reward (same syntax as reward), with reward_dispatch_key; a source not in it "
        "takes reward, or is an error without one. YAML: '{gsm8k: gsm8k, math: \"math:1.0,format:0.1\"}'.",
    )
    reward_timeout_s: float = pydantic.Field(
        default=30.0,
        gt=0,
        le=3600,
        description="The longest one reward call may run; a call past it scores 0 and is counted (reward/timeouts).",
    )
    reward_workers: int = pydantic.Field(
        default=2,
        ge=1,
        le=MAX_THREADS,
        description="Threads that run reward functions off the event loop, at most 8 per CPU of this machine.",
    )
    reward_max_consecutive_failures: int = pydantic.Field(
        default=16,
        ge=1,
        le=1_000_000,
        description="Failures (errors, non-finite values, timeouts) of one reward in a row that stop the run.",
    )
    reward_url: str | None = pydantic.Field(
        default=None,
        max_length=2000,
        description="Base URL of a reward server (POST /score, GET /health; see the rewards page of the docs), the "
        "reward part named remote.",
    )
    reward_url_token: pydantic.SecretStr | None = pydantic.Field(
        default=None,
        description="Bearer token sent to the reward server; None: the environment variable MILES_REWARD_URL_TOKEN, "
        "if set.",
    )
    reward_url_timeout_s: float = pydantic.Field(
        default=60.0, gt=0, le=3600, description="The longest one request to the reward server may take."
    )
    reward_url_retries: int = pydantic.Field(
        default=2,
        ge=0,
        le=10,
        description="Retries of a failed request to the reward server (then its samples score 0).",
    )
    reward_url_batch_size: int = pydantic.Field(
        default=64, ge=1, le=4096, description="Samples per request to the reward server."
    )
    reward_url_concurrency: int = pydantic.Field(
        default=4, ge=1, le=64, description="Requests to the reward server in flight at once."
    )
    filters: list[str] = pydantic.Field(
        default_factory=list,
        description="Group filters (`miles plugins` lists them, e.g. nonzero_reward_std), applied before a group "
        "enters a batch, in every schedule; comma-separated on the command line.",
    )
    over_sampling: int = pydantic.Field(
        default=0,
        ge=0,
        description="Extra groups generated beyond the batch (fully_async: kept in flight), so that filtered-out "
        "groups leave no batch short.",
    )
    max_staleness: int = pydantic.Field(
        default=2,
        ge=0,
        description="fully_async: the most weight versions a group may lag the trainer when it is trained on.",
    )
    stale_groups: Literal["drop", "retry"] = pydantic.Field(
        default="drop", description="fully_async: a group beyond max_staleness is dropped, or generated again."
    )
    partial: bool = pydantic.Field(
        default=False,
        description="A request cut by a weight update (fully_async, one_step_off) continues under the new weights, "
        "keeping the tokens (and logprobs) generated before it; false: fully_async generates it again from the start, "
        "one_step_off holds it until the update is done.",
    )
    mask_off_policy: bool = pydantic.Field(
        default=False,
        description="With partial: the tokens of a sample generated under an older weight version than its last "
        "ones are masked off the loss.",
    )

    agent: str | None = pydantic.Field(
        default=None,
        description="Agent playing each sample as a multi-turn conversation through session servers (`miles plugins` "
        "lists them; or module:function); None: the task's agent if it registers one, else batched single-turn "
        "generation.",
    )
    session_servers: int = pydantic.Field(
        default=1, ge=1, le=64, description="Session servers an agent run starts (sessions go to them in turn)."
    )
    chat_format: str | None = pydantic.Field(
        default=None,
        description="Token-in-token-out chat format of the session servers (`miles plugins` lists them); None: "
        "'default' for the embedded default model, required with --model.",
    )

    @pydantic.field_validator("filters", "prompts", "eval_prompts", "metadata_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        """``--rollout-filters a,b`` as well as a YAML list."""
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @pydantic.field_validator("reward_workers")
    @classmethod
    def _workers_fit_machine(cls, value: int) -> int:
        most = 8 * (os.cpu_count() or 1)
        if value > most:
            raise ValueError(f"at most {most} (8 per CPU of this machine)")
        return value

    @pydantic.field_validator("reward_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
            raise ValueError("an http:// or https:// base URL such as http://127.0.0.1:8000")
        return value

    @pydantic.model_validator(mode="after")
    def _dispatch_complete(self) -> RolloutSection:
        if bool(self.reward_dispatch_key) != bool(self.reward_by_source):
            raise ValueError(
                "reward_dispatch_key (--rollout-reward-dispatch-key) and reward_by_source "
                "(--rollout-reward-by-source) go together: give both or neither"
            )
        return self

    @pydantic.field_validator("apply_chat_template", mode="before")
    @classmethod
    def _auto_is_none(cls, value: object) -> object:
        """``--rollout-apply-chat-template auto`` as well as none."""
        return None if isinstance(value, str) and value.strip().lower() == "auto" else value

    @pydantic.model_validator(mode="after")
    def _mask_needs_partial(self) -> RolloutSection:
        if self.mask_off_policy and not self.partial:
            raise ValueError("mask_off_policy (--rollout-mask-off-policy) needs partial (--rollout-partial true)")
        return self


class TrainSection(Section):
    """The policy update."""

    backend: str = pydantic.Field(default="torch", description="Training backend (`miles plugins`).")
    cpu_threads: int | None = pydantic.Field(
        default=None,
        ge=1,
        le=MAX_THREADS,
        description="torch CPU threads of the torch trainer, at most 1024 (and, with the local worker provider, at "
        "most 4 per CPU of this machine) (None: 1 for the embedded default model under "
        "one_step_off and fully_async, where it shares the cores with the engine, else torch's default, one per "
        "core); on a small machine, split the cores between trainer and engines for fully_async.",
    )
    optimizer: Literal["adamw", "sgd"] = pydantic.Field(default="adamw", description="Optimizer of every trainer.")
    lr: float = pydantic.Field(default=3e-3, gt=0, description="Learning rate.")
    weight_decay: float = pydantic.Field(default=0.0, ge=0)
    max_grad_norm: float = pydantic.Field(default=1.0, gt=0, description="Gradient clipping norm.")
    micro_batch_size: int = pydantic.Field(default=64, gt=0, description="Samples per forward/backward pass.")
    clip_eps: float = pydantic.Field(default=0.2, gt=0, description="PPO clip range.")
    clip_eps_high: float | None = pydantic.Field(
        default=None, gt=0, description="Upper clip range (default: clip_eps)."
    )
    tis_clip: float | None = pydantic.Field(
        default=None,
        gt=0,
        description="Truncated importance sampling: each token's loss weighted by min(exp(trainer logprob - "
        "rollout logprob), TIS_CLIP), the PPO ratio against the trainer's pre-step logprobs (default: off).",
    )
    kl_coef: float | None = pydantic.Field(
        default=None,
        ge=0,
        description="Weight of the KL to the initial (reference) model; 0 turns it off (unset: the advantage "
        "estimator's own default_kl_coef, which `miles config show` prints; 0 for the default grpo).",
    )
    entropy_coef: float | None = pydantic.Field(
        default=None,
        ge=0,
        description="Weight of the entropy bonus (the mean token entropy, subtracted from the loss); 0 turns it off "
        "(unset: the advantage estimator's own default_entropy_coef, which `miles config show` prints; 0 for the "
        "default grpo).",
    )
    advantage_estimator: str = pydantic.Field(
        default="grpo",
        description="How rewards become advantages (`miles plugins`): grpo, dr_grpo, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, gspo, or a plugin's.",
    )
    advantage_estimator_settings: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description='The estimator\'s own settings, checked against its settings model: {"normalize_std": false} '
        '(grpo), {"gamma": 0.99} (reinforce_plus_plus).',
    )
    policy_loss: str | None = pydantic.Field(
        default=None,
        description="The policy loss (`miles plugins`): ppo_clip, gspo, or a plugin's (None: the estimator's "
        "choice, ppo_clip but for gspo).",
    )
    policy_loss_settings: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description='The policy loss\'s own settings: {"clip_eps": 3e-4, "clip_eps_high": 4e-4} (gspo).',
    )
    loss_aggregation: (
        Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] | None
    ) = pydantic.Field(
        default=None,
        description="How token losses become the step's loss: token-mean, seq-mean-token-mean, seq-mean-token-sum, "
        "or seq-mean-token-sum-norm (Dr. GRPO's: divided by samples times max_new_tokens) (None: the estimator's "
        "choice, token-mean but for dr_grpo and gspo).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = pydantic.Field(
        default="k3",
        description="Estimator of the KL to the reference per token (weighted by kl_coef): k1 = log p - log p_ref, "
        "k2 = (log p - log p_ref)^2 / 2, k3 = exp(r) - r - 1 with r = log p_ref - log p.",
    )
    kl_placement: Literal["loss", "reward"] = pydantic.Field(
        default="loss",
        description="Where the KL to the reference goes: loss (kl_coef x KL, a loss term) or reward (kl_coef x KL "
        "subtracted from each token's reward before the advantages: ppo, reinforce_plus_plus; torch trainer).",
    )
    mini_batches_per_rollout: int = pydantic.Field(
        default=1,
        ge=1,
        le=1024,
        description="Optimizer steps per epoch over a rollout's batch: the batch splits into this many mini-batches "
        "(at most one per sample), each an optimizer step with the rollout's logprobs as the ratio's anchor.",
    )
    epochs_per_rollout: int = pydantic.Field(
        default=1, ge=1, le=64, description="Passes over a rollout's batch (each of mini_batches_per_rollout steps)."
    )
    reset_optimizer_states: bool = pydantic.Field(
        default=False,
        description="Reset the optimizer's moments (Adam's averages and step count, SGD's momentum) after each "
        "rollout's optimizer step, so the next rollout's step starts as a fresh optimizer's first step.",
    )
    logits_dtype: Literal["float32", "model"] = pydantic.Field(
        default="float32",
        description="Dtype of the policy logprob and entropy math: float32 (the logits upcast) or model (the "
        "model's own dtype: less memory with a bfloat16 model, bf16 rounding in the loss).",
    )
    routing_replay: bool = pydantic.Field(
        default=False,
        description="Routing replay (R3) for Mixture-of-Experts models: the engines return the experts each token "
        "was routed to (return_routed_experts) and the trainer's forward routes every token to them, the routing "
        "weights from its own router logits.",
    )

    lora_rank: int | None = pydantic.Field(
        default=None,
        ge=1,
        description="LoRA: the rank of the adapters trained over the frozen base (peft), which alone reach the "
        "engines after each step; at least 1; unset: no LoRA, every weight trains.",
    )
    lora_alpha: float | None = pydantic.Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="LoRA: alpha (the update scaled by alpha / rank); None: the rank.",
    )
    lora_dropout: float = pydantic.Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="LoRA: dropout on the adapters' input while training.",
    )
    lora_target_modules: list[str] = pydantic.Field(
        default_factory=lambda: ["all-linear"],
        min_length=1,
        description="LoRA: the layers that get adapters, by name (q_proj,v_proj; matched against each module "
        "path's last parts) or the preset all-linear (every linear layer but the output head).",
    )

    @pydantic.field_validator("lora_target_modules", mode="before")
    @classmethod
    def _target_names(cls, value: object) -> object:
        """``--train-lora-target-modules q_proj,v_proj`` as well as a YAML list."""
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @pydantic.model_validator(mode="after")
    def _lora_settings_need_rank(self) -> TrainSection:
        # by value, not by the fields set: a section dumped and validated again (the Megatron ranks) sets them all
        given = [
            name
            for name, value in (
                ("lora_alpha", self.lora_alpha),
                ("lora_dropout", self.lora_dropout or None),
                ("lora_target_modules", None if self.lora_target_modules == ["all-linear"] else True),
            )
            if value is not None
        ]
        if given and self.lora_rank is None:
            raise ValueError(f"{', '.join(given)} set without lora_rank (--train-lora-rank): give the LoRA rank too")
        return self

    removed_fields: ClassVar[Mapping[str, str]] = {
        "normalize_advantages": "GRPO's std division is a setting of the grpo estimator now: "
        "--train-advantage-estimator-settings '{\"normalize_std\": false}', or --train-advantage-estimator dr_grpo"
    }


class EngineSection(Section):
    """The inference engines."""

    backend: str = pydantic.Field(default="local", description="Engine backend (`miles plugins`).")
    num_engines: int = pydantic.Field(
        default=1,
        ge=1,
        le=MAX_ENGINES,
        description="Engines (cells) to run, at most 1024 (with the local worker provider, each a process on this "
        "machine: at most 4 per CPU).",
    )
    max_batch_size: int = pydantic.Field(
        default=256, gt=0, le=MAX_BATCH, description="Requests one engine samples together (at most 65536)."
    )
    cpu_threads: int | None = pydantic.Field(
        default=None,
        ge=1,
        le=MAX_THREADS,
        description="torch CPU threads of each local engine, at most 1024 (and, with the local worker provider, at "
        "most 4 per CPU of this machine) (None: 1 for the embedded default model, else torch's default).",
    )
    startup_timeout_s: float = pydantic.Field(default=180.0, gt=0)
    health_check_interval_s: float = pydantic.Field(default=2.0, gt=0)
    health_check_timeout_s: float = pydantic.Field(
        default=30.0,
        gt=0,
        description="How long one health check may take before it counts as failed (SGLang's "
        "/health_generate waits up to SGLANG_HEALTH_CHECK_TIMEOUT, 20 s, for the next output of a busy server).",
    )
    health_check_failures: int = pydantic.Field(
        default=2,
        ge=1,
        description="Failed health checks in a row after which an engine whose process lives is restarted (one "
        "whose process exited is restarted at once).",
    )

    removed_fields: ClassVar[Mapping[str, str]] = {
        "router_url": "the external router mode (--engine-router-url) sent generation to a router that Miles never "
        "registered its engines with, while weights went to Miles' own engines; use --sglang-router true "
        "(with --engine sglang, miles-plugins-sglang) for a router in front of Miles' engines"
    }


class WeightTransferSection(Section):
    """How new weights reach the engines."""

    mode: str = pydantic.Field(
        default="auto",
        description="Weight-transfer protocol (see `miles plugins`); auto: per engine, tensor on the trainer's node, "
        "rdt (NIXL, Ray) or broadcast on another.",
    )
    settings: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description="The protocol's settings, checked against the settings model it declares; auto's are per protocol "
        'it may choose: {"tensor": {"zero_copy": false}}.',
    )
    bucket_size_mb: Annotated[int, at_most_memory_share(2, what="transfer buckets")] = pydantic.Field(
        default=512,
        gt=0,
        le=MAX_BUFFER_MB,
        description="Bytes per transfer bucket, in MiB: at most 1048576 (1 TiB), and at most a quarter of the "
        "physical memory of the machine that builds the config (a bucket and its copy must fit in half of it).",
    )
    verify_checksum: bool = pydantic.Field(
        default=False,
        description="Check that engines hold the exact weights: the local engine's checksum; SGLang: sampled "
        "parameters read back (/get_weights_by_name).",
    )
