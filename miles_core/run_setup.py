"""What a run needs before its first step: its directory, model, tokenizer, prompts and reward function."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers

from miles_core.default.tokenizer import DigitTokenizer
from miles_core.engines.routed_experts import RoutingShape
from miles_core.errors import ConfigError, MilesError
from miles_core.models.checkpoint_dir import CONTEXT_LENGTH_KEYS, checkpoint_family, read_model_config
from miles_core.models.hf_checkpoint import load_tokenizer, tokenizer_files
from miles_core.models.selection import check_families_given
from miles_core.registry import Implementation, Registries
from miles_core.rollout.chat_prompts import ChatRenderer
from miles_core.rollout.prompt_data import PromptKeys, open_prompt_source
from miles_core.rollout.prompt_encoding import PromptEncoder
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.reward_specs import REMOTE, check_reward_specs, parse_reward_spec
from miles_core.rollout.rewards import BatchReward, CompositeReward, RewardPart, RewardPlan
from miles_core.targets import describe_callable, registered_or_target
from miles_core.training.lora import LoraSettings, check_target_modules
from miles_core.workers.rpc.wire import new_run_token

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig
    from miles_core.config.sections import RolloutSection

CHECKPOINTS = "checkpoints"
DEFAULT_MODEL_FAMILY = "llama"  # the embedded default model (default_model)
DEFAULT_CONTEXT_LENGTH = 64  # its max_position_embeddings
REWARD_TOKEN_ENV = "MILES_REWARD_URL_TOKEN"


@dataclasses.dataclass
class RunSetup:
    run_dir: Path
    model_path: Path  # what the trainer and engines load first
    initial_model_path: Path  # the run's starting point: the KL reference
    tokenizer: Any
    train_prompts: Sequence[Prompt]
    eval_prompts: Sequence[Prompt]
    reward: RewardPlan
    token: str
    encoder: PromptEncoder | None = None  # checks each prompt as the executor encodes it
    start_step: int = 0
    routing: RoutingShape | None = None  # the model's routing shape when --train-routing-replay is on


def prepare_run(config: MilesConfig, registries: Registries) -> RunSetup:
    """The run's directory, model, tokenizer, prompts and reward. Everything is checked before the run directory
    changes, so a refused run moves no earlier run aside."""
    check_model_family(config)  # before an earlier run is moved aside: nothing moves for a refused run
    # absolute: workers on other nodes start in directories of their own, so every path they are given must be
    run_dir = Path(config.run.output_dir).absolute()
    model_path = Path(config.model.path).absolute() if config.model.path is not None else None
    tokenizer = load_tokenizer(model_path) if model_path is not None else DigitTokenizer()
    train_prompts, eval_prompts = load_prompts(config, registries, tokenizer=tokenizer)
    encoder = check_prompts_encode(
        tokenizer,
        {"train": train_prompts, "eval": eval_prompts},
        model_path=model_path,
        max_new_tokens=config.rollout.max_new_tokens,
    )
    reward = load_reward(config, registries)
    check_chat_format(config, registries, tokenizer)
    routing = routing_replay_shape(config, model_path)
    try:
        if not config.run.resume:
            archive = archive_previous_run(run_dir)
            if archive is not None and model_path is not None:  # --model runs/latest/checkpoints/step_000200
                model_path = moved_with_run(model_path, run_dir=run_dir, archive=archive)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # checked at config time, but the file system may have changed since
        raise ConfigError(
            f"run.output_dir (--output-dir) = {str(run_dir)!r}: cannot create the run directory: "
            f"{exc.strerror or exc}; name a directory you can write"
        ) from exc
    if model_path is None:
        model_path = default_model(run_dir, seed=config.run.seed)
    setup = RunSetup(
        run_dir,
        model_path,
        model_path,
        tokenizer,
        train_prompts,
        eval_prompts,
        reward,
        token=new_run_token(),
        encoder=encoder,
        routing=routing,
    )
    if config.run.resume:
        resume_from_latest(setup, num_steps=config.run.num_steps)
    check_lora_targets(config, setup.model_path)
    return setup


def check_lora_targets(config: MilesConfig, model_path: Path) -> None:
    """With LoRA, every target module names linear layers of the model (its config.json, built on the meta device):
    a :class:`ConfigError` before any worker starts otherwise."""
    lora = LoraSettings.of(config.train)
    if lora is not None:
        model_config = transformers.AutoConfig.from_pretrained(model_path, local_files_only=True)
        check_target_modules(model_config, lora.target_modules)


def resume_from_latest(setup: RunSetup, *, num_steps: int) -> None:
    """Point ``setup`` at the newest checkpoint of its run directory (``--run-resume true``), checked as a model
    directory: a corrupt or truncated one (killed while it was written) is an error saying what to do, not a
    traceback from the trainer. No checkpoint: the run starts at step 0, and says so."""
    latest = latest_checkpoint(setup.run_dir)
    if latest is None:
        print(
            f"miles: --run-resume true: {str(setup.run_dir / CHECKPOINTS)!r} holds no checkpoint; starting at step 0",
            flush=True,
        )
        return
    step = checkpoint_step(latest)
    assert step is not None
    if step >= num_steps:
        raise ConfigError(
            f"run.resume (--run-resume true): the newest checkpoint {str(latest)!r} is step {step}, and "
            f"run.num_steps (--num-steps) is {num_steps}: nothing is left to run; give --num-steps "
            f"above {step} to continue the run"
        )
    try:
        read_model_config(latest)
        if not tokenizer_files(latest):
            raise MilesError("it holds no tokenizer files")
    except MilesError as exc:
        raise MilesError(
            f"run.resume (--run-resume true): the newest checkpoint {str(latest)!r} cannot be resumed "
            f"from ({exc}); move it out of {CHECKPOINTS}/ to resume from the one before it, or start a "
            "new run with --run-resume false"
        ) from None
    setup.model_path, setup.start_step = latest, step


def moved_with_run(path: Path, *, run_dir: Path, archive: Path) -> Path:
    """Where ``path`` is after :func:`archive_previous_run` moved ``run_dir`` to ``archive`` (itself when it was
    not inside): a checkpoint of the earlier run given as ``--model`` moves with it."""
    try:
        inside = path.resolve().relative_to(run_dir.resolve())
    except ValueError:
        return path
    moved = archive / inside
    print(f"miles: --model {path} moved with the earlier run; loading it from {moved}", flush=True)
    return moved


def check_chat_format(config: MilesConfig, registries: Registries, tokenizer: Any) -> None:
    """An agent run's chat format, made for the run's tokenizer here as each session server will make it: a
    format that cannot serve this tokenizer (its special tokens missing, no chat template for ``hf``) is a
    :class:`ConfigError` before any worker starts."""
    from miles_core.rollout.agents import agent_for_task, session_chat_format
    from miles_core.rollout.sessions.formats import ChatFormatError

    if agent_for_task(config.rollout.task, config.rollout.agent, registries.agents) is None:
        return
    name = session_chat_format(config)
    try:
        registries.chat_formats.get_or_raise(name).load()(tokenizer)
    except ChatFormatError as exc:
        raise ConfigError(f"rollout.chat_format (--rollout-chat-format) = {name!r}: {exc}") from None


def routing_replay_shape(config: MilesConfig, model_path: Path | None) -> RoutingShape | None:
    """With ``--train-routing-replay``, the routing shape of the run's model (layers, ``top_k``, experts); a model
    without routed experts (the embedded default is a dense Llama), or an agent run, is a :class:`ConfigError`."""
    if not config.train.routing_replay:
        return None
    what = "train.routing_replay (--train-routing-replay) = true"
    if config.rollout.agent is not None:
        raise ConfigError(f"{what} is not available with --rollout-agent yet (agent turns carry no routed experts)")
    model_config = read_model_config(model_path) if model_path is not None else None
    shape = RoutingShape.of_config(model_config) if model_config is not None else None
    if shape is None:
        model = repr(str(model_path)) if model_path is not None else "the embedded default (a dense Llama)"
        kind = (model_config or {}).get("model_type", "llama")
        raise ConfigError(
            f"{what}, but the model {model} ({kind}) has no routing Miles can replay: replay takes routed "
            "experts (config.json with num_experts or n_routed_experts, and num_experts_per_tok: Qwen3-MoE, "
            "DeepSeek-V3); train such a model or turn routing replay off"
        )
    return shape


def check_model_family(config: MilesConfig) -> None:
    """An implementation given for a family other than the model's would be ignored by every trainer: refuse it."""
    if config.model.path is None:
        family, description = DEFAULT_MODEL_FAMILY, "the default model (a tiny Llama)"
    else:
        family, description = checkpoint_family(config.model.path), f"the checkpoint {config.model.path!r}"
    check_families_given(config.model.implementations, family=family, checkpoint=description)


def default_model(run_dir: Path, *, seed: int) -> Path:
    """The embedded default's tiny Llama, built from a config and saved once per run directory, with its
    tokenizer's HF files (so that its checkpoints are model directories of their own)."""
    path = run_dir / "initial_model"
    if not tokenizer_files(path):  # also an initial model written before tokenizer files were saved with it
        DigitTokenizer().save_pretrained(path)
    if not (path / "config.json").is_file():
        import torch  # deferred: only the default run builds a model here
        import transformers

        tokenizer = DigitTokenizer()
        config = transformers.LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=DEFAULT_CONTEXT_LENGTH,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


CHECKED_AT_START = 1024
"""Prompts of each set encoded and checked before any worker starts; the executor checks the others as it encodes
them (a prompt file of millions of rows is not encoded whole at start)."""


def check_prompts_encode(
    tokenizer: Any,
    prompt_sets: dict[str, Sequence[Prompt]],
    *,
    model_path: Path | None,
    max_new_tokens: int = 0,
    limit: int = CHECKED_AT_START,
) -> PromptEncoder:
    """The first ``limit`` prompts of each set encode to a non-empty list of token ids that the model's vocabulary
    holds and that leaves room for ``max_new_tokens`` in its context (``model_path`` ``None``: the default model and
    its built-in tokenizer): checked before any worker starts, so a wrong tokenizer or a too-long prompt is an error
    in seconds instead of a failed request minutes later. Returns the encoder, which checks the same for every
    prompt the executor encodes."""
    encoder = prompt_encoder(tokenizer, model_path=model_path, max_new_tokens=max_new_tokens)
    for kind, prompts in prompt_sets.items():
        for number in range(min(limit, len(prompts))):
            encoder.ids(prompts[number], where=f"{kind} prompt {number}")
    return encoder


def prompt_encoder(tokenizer: Any, *, model_path: Path | None, max_new_tokens: int) -> PromptEncoder:
    """The :class:`PromptEncoder` of the model at ``model_path`` (``None``: the default model)."""
    if model_path is None:
        return PromptEncoder(
            tokenizer,
            source="the built-in tokenizer",
            vocab_size=getattr(tokenizer, "vocab_size", None),
            context=DEFAULT_CONTEXT_LENGTH,
            max_new_tokens=max_new_tokens,
            files_hint="is it the model's tokenizer? (its files: none)",
        )
    model_config = read_model_config(model_path)
    files = ", ".join(path.name for path in tokenizer_files(model_path))
    return PromptEncoder(
        tokenizer,
        source=f"the tokenizer of {str(model_path)!r}",
        vocab_size=_int_of(model_config, "vocab_size"),
        context=next((_int_of(model_config, key) for key in CONTEXT_LENGTH_KEYS if _int_of(model_config, key)), None),
        max_new_tokens=max_new_tokens,
        files_hint=f"is it the model's tokenizer? (its files: {files or 'none'})",
    )


def _int_of(model_config: dict[str, Any], key: str) -> int | None:
    """``model_config[key]`` when it is an int (not a bool), else ``None``."""
    value = model_config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


DEFAULT_TASK = "echo_last"
"""The embedded task, made for the embedded default model (its character tokenizer)."""


def load_prompts(
    config: MilesConfig, registries: Registries, *, tokenizer: Any = None
) -> tuple[Sequence[Prompt], Sequence[Prompt]]:
    """The prompt data's prompts, or else the task's own; eval: ``--rollout-eval-prompts`` when given (with a task's
    prompts too), else the prompt data's first 64 or the task's eval prompts. ``tokenizer``
    renders chat prompts (:class:`~miles_core.rollout.chat_prompts.ChatRenderer`; ``None``: the built-in one, which
    has no chat template)."""
    rollout = config.rollout
    keys = PromptKeys.from_config(rollout)
    renderer = ChatRenderer.from_config(tokenizer if tokenizer is not None else DigitTokenizer(), rollout)
    evaluation = None
    if rollout.eval_prompts:
        evaluation = open_prompt_source(
            rollout.eval_prompts, keys=keys, renderer=renderer, flag="--rollout-eval-prompts"
        )
    if rollout.prompts is not None:
        train = open_prompt_source(rollout.prompts, keys=keys, renderer=renderer)
        return train, evaluation if evaluation is not None else train[: min(64, len(train))]
    if config.model.path is not None and not task_given(config):
        raise ConfigError(
            "--model needs --prompts FILE.jsonl (or a --task made for that model): the default task is "
            f"made for the default model (give --task {DEFAULT_TASK} to run it on this model anyway)"
        )
    train, task_evaluation = task_prompts(
        rollout.task, registries.tasks.get_or_raise(rollout.task), seed=config.run.seed
    )
    return train, evaluation if evaluation is not None else task_evaluation


def task_given(config: MilesConfig) -> bool:
    """Whether the run names its task (``--task``, or ``rollout.task`` in the config file) rather than taking the
    default one."""
    return "task" in config.rollout.model_fields_set


def task_prompts(name: str, entry: Implementation, *, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """Call the task's ``prompts(seed=...)``; an error or anything but two non-empty lists of prompts is a
    :class:`ConfigError` naming the task."""
    what = f"task {name!r} ({entry.target})"
    try:
        result = entry.load()(seed=seed)
    except Exception as exc:
        raise ConfigError(f"{what} failed to make its prompts: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise ConfigError(f"{what} returned {result!r:.80}; expected (train_prompts, eval_prompts)")
    for kind, prompts in zip(("train", "eval"), result, strict=True):
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, Prompt) for p in prompts)):
            raise ConfigError(f"{what} returned {kind} prompts {prompts!r:.80}; expected a non-empty list of Prompt")
    return result[0], result[1]


def load_reward(config: MilesConfig, registries: Registries) -> RewardPlan:
    """The run's reward: ``--reward`` (a registered name, module:function, or weighted parts; ``remote`` is the
    ``--reward-url`` server, probed here), per data source with ``--rollout-reward-by-source``; without either, the
    reward function named like the task (with ``--prompts`` too, when the task was named or the model is the
    default one: the default task's reward is made for the default model)."""
    rollout = config.rollout
    check_reward_specs(config, registries)
    text = rollout.reward
    if text is None and rollout.reward_url is not None and not rollout.reward_by_source:
        text = REMOTE
    if text is None and not rollout.reward_by_source:
        fn, name = task_reward(config, registries)
        return RewardPlan(CompositeReward(name, (RewardPart(name, 1.0, fn=fn),)))
    remote = remote_reward(rollout) if rollout.reward_url is not None else None
    default = resolve_reward(text, registries, field="--reward", remote=remote) if text is not None else None
    by_source = {
        source: resolve_reward(spec, registries, field=f"--rollout-reward-by-source {source}", remote=remote)
        for source, spec in rollout.reward_by_source.items()
    }
    return RewardPlan(default, by_source, rollout.reward_dispatch_key)


def task_reward(config: MilesConfig, registries: Registries) -> tuple[Callable[..., float], str]:
    """The reward function named like the task, when no reward is given."""
    task = config.rollout.task
    if config.rollout.prompts is not None and config.model.path is not None and not task_given(config):
        raise ConfigError(
            "--prompts needs --reward to score the responses: add --reward NAME (registered: "
            f"{', '.join(registries.reward_functions)}) or --reward module:function (a module in the working "
            f"directory), or --task NAME to score them with that task's reward (the default task, {task!r}, "
            "is made for the default model)"
        )
    if task not in registries.reward_functions:
        raise ConfigError(
            f"task {task!r} needs --reward NAME or module:function: no reward function is named "
            f"like it (registered: {', '.join(registries.reward_functions) or 'none'})"
        )
    if config.rollout.prompts is not None:
        print(f"miles: --prompts without --reward: scoring with the reward of task {task!r}", flush=True)
    return registries.reward_functions[task].load(), task


def resolve_reward(text: str, registries: Registries, *, field: str, remote: BatchReward | None) -> CompositeReward:
    """A reward spec (:func:`parse_reward_spec`) with each part loaded and its signature checked."""
    parts = []
    for name, weight in parse_reward_spec(text, field=field):
        if name == REMOTE:
            if remote is None:
                raise ConfigError(f"{field} {text!r} names {REMOTE!r}, the reward server: give --reward-url URL")
            parts.append(RewardPart(name, weight, batch=remote))
            continue
        fn = registered_or_target(name, registries.reward_functions, flag=field, kind="reward function")
        if not callable(fn):
            raise ConfigError(f"{field} {name!r} is {fn!r:.80}, not a function")
        described = describe_callable(fn)
        _check_reward_signature(fn, what=f"{field} {name!r}" + ("" if described == name else f" ({described})"))
        parts.append(RewardPart(name, weight, fn=fn))
    return CompositeReward(text, tuple(parts))


def remote_reward(rollout: RolloutSection) -> BatchReward:
    """The ``--reward-url`` server's client, probed: an unreachable server stops the run before it starts."""
    from miles_core.rollout.remote_reward import RemoteReward  # deferred: httpx's client, only for --reward-url

    token = rollout.reward_url_token.get_secret_value() if rollout.reward_url_token is not None else None
    client = RemoteReward(
        rollout.reward_url,
        token=token if token is not None else os.environ.get(REWARD_TOKEN_ENV) or None,
        timeout_s=rollout.reward_url_timeout_s,
        retries=rollout.reward_url_retries,
        batch_size=rollout.reward_url_batch_size,
        concurrency=rollout.reward_url_concurrency,
    )
    client.probe()
    return client


def _check_reward_signature(reward: Callable[..., Any], *, what: str) -> None:
    """The reward can be called as ``reward(*, prompt, response, label, metadata)`` and returns its value (not a
    coroutine): checked when the run starts rather than at the first sample, minutes later."""
    if inspect.iscoroutinefunction(reward):
        raise ConfigError(f"{what} is an async function; a reward is a plain function returning a number")
    try:
        inspect.signature(reward).bind(prompt="", response="", label=None, metadata={})
    except ValueError:  # no signature to inspect (some builtins): the first call tells
        return
    except TypeError as exc:
        raise ConfigError(f"{what} cannot be called as fn(*, prompt, response, label, metadata): {exc}") from None


def archive_previous_run(run_dir: Path) -> Path | None:
    """A new run in a directory that holds an earlier run moves the earlier one aside (nothing is deleted)."""
    if not ((run_dir / "metrics.jsonl").exists() or (run_dir / CHECKPOINTS).exists()):
        return None
    archive = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(archive)
    print(f"miles: the earlier run in {run_dir} was moved to {archive} (use --run-resume true to continue it)")
    return archive


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint directory ``checkpoints/step_N`` of ``run_dir`` with the largest N (by number, not by name:
    ``step_1000000`` follows ``step_999999``); other names there (``step_x1``, a file) are not checkpoints."""
    try:
        entries = list(os.scandir(run_dir / CHECKPOINTS))
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = {
        step: Path(entry.path)
        for entry in entries
        if (step := checkpoint_step(Path(entry.name))) is not None and entry.is_dir()
    }
    return steps[max(steps)] if steps else None


def checkpoint_step(path: Path) -> int | None:
    """N of a checkpoint directory named ``step_N`` (ASCII digits, as :func:`miles_core.loop.save_checkpoint`
    writes them), or ``None`` for any other name."""
    match = re.fullmatch(r"step_([0-9]{1,12})", path.name)
    return int(match[1]) if match else None
