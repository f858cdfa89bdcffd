"""What a run needs before its first step: its directory, model, tokenizer, prompts and reward function."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_core.default.task import echo_last_prompts, echo_last_reward
from miles_core.default.tokenizer import DigitTokenizer
from miles_core.errors import ConfigError, MilesError
from miles_core.models.hf_checkpoint import require_checkpoint_dir
from miles_core.registry import Implementation, Registries
from miles_core.rollout.prompts import Prompt, read_prompts_jsonl

CHECKPOINTS = "checkpoints"


@dataclasses.dataclass
class RunSetup:
    run_dir: Path
    model_path: Path  # what the trainer and engines load first
    initial_model_path: Path  # the run's starting point: the KL reference
    tokenizer: Any
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    reward_fn: Callable[..., float]
    reward_name: str
    token: str
    start_step: int = 0


def prepare_run(config: Any, registries: Registries) -> RunSetup:
    run_dir = Path(config.run.output_dir)
    try:
        if not config.run.resume:
            archive_previous_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # checked at config time, but the file system may have changed since
        raise ConfigError(f"run.output_dir (--output-dir) = {str(run_dir)!r}: cannot create the run directory: "
                          f"{exc.strerror or exc}; name a directory you can write") from exc  # fmt: skip
    if config.model.path is None:
        model_path, tokenizer = default_model(run_dir, seed=config.run.seed), DigitTokenizer()
    else:
        model_path, tokenizer = Path(config.model.path), load_tokenizer(Path(config.model.path))
    train_prompts, eval_prompts = load_prompts(config)
    reward_fn, reward_name = load_reward(config, registries)
    setup = RunSetup(run_dir, model_path, model_path, tokenizer, train_prompts, eval_prompts, reward_fn, reward_name,
                     token=secrets.token_urlsafe(24))  # fmt: skip
    if config.run.resume:
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            setup.model_path, setup.start_step = latest, int(latest.name.removeprefix("step_"))
    return setup


def default_model(run_dir: Path, *, seed: int) -> Path:
    """The embedded default's tiny Llama, built from a config and saved once per run directory."""
    path = run_dir / "initial_model"
    if not (path / "config.json").is_file():
        import torch  # deferred: only the default run builds a model here
        import transformers

        tokenizer = DigitTokenizer()
        config = transformers.LlamaConfig(
            vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )  # fmt: skip
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def load_tokenizer(model_path: Path) -> Any:
    require_checkpoint_dir(model_path)
    import transformers  # deferred: heavy

    try:
        return transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception as exc:  # transformers raises many types
        raise MilesError(f"cannot load a tokenizer from {str(model_path)!r}: {type(exc).__name__}: {exc}") from None


def load_prompts(config: Any) -> tuple[list[Prompt], list[Prompt]]:
    rollout = config.rollout
    if rollout.prompts is None:
        if config.model.path is not None:
            raise ConfigError("--model needs --prompts FILE.jsonl: the default task is made for the default model")
        return echo_last_prompts(seed=config.run.seed)
    train = read_prompts_jsonl(rollout.prompts)
    evaluation = read_prompts_jsonl(rollout.eval_prompts) if rollout.eval_prompts else train[: min(64, len(train))]
    return train, evaluation


def load_reward(config: Any, registries: Registries) -> tuple[Callable[..., float], str]:
    name = config.rollout.reward
    if name is None:
        if config.rollout.prompts is not None:
            raise ConfigError(f"--prompts needs --reward NAME or module:function; registered: "
                              f"{', '.join(registries['reward_functions'])}")  # fmt: skip
        return echo_last_reward, "echo_last"
    entry = registries["reward_functions"].get(name) or Implementation(name=name, target=name, provider="--reward")
    reward = entry.load()
    if not callable(reward):
        raise ConfigError(f"--reward {name!r} is {reward!r}, not a function")
    return reward, name


def archive_previous_run(run_dir: Path) -> Path | None:
    """A new run in a directory that holds an earlier run moves the earlier one aside (nothing is deleted)."""
    if not ((run_dir / "metrics.jsonl").exists() or (run_dir / CHECKPOINTS).exists()):
        return None
    archive = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(archive)
    print(f"miles: the earlier run in {run_dir} was moved to {archive} (use --run-resume true to continue it)")
    return archive


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = sorted((run_dir / CHECKPOINTS).glob("step_*[0-9]"))
    return checkpoints[-1] if checkpoints else None
