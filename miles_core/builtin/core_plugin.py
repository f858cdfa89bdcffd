"""The core's built-in plugin: its config sections and flags, cross-section validation, and its registries."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core.config.flags import ConfigFlag
from miles_core.errors import ConfigError, PluginLoadError, RegistryError
from miles_core.fault_injection import check_faults_fit
from miles_core.hookspecs import hookimpl
from miles_core.models.selection import DSV4_FAMILY, check_model_implementation
from miles_core.registry import ANY_FAMILY, Implementation, Registries, model_implementation
from miles_core.rollout.reward_specs import check_reward_specs
from miles_core.weight_transfer import WeightTransferProtocol
from miles_core.weight_transfer.settings import validate_run_settings

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig


@hookimpl
def config_sections() -> dict[str, type]:
    # Deferred: pydantic costs ~0.3 s to import, and `miles plugins` never builds the config.
    from miles_core.config.sections import (
        EngineSection,
        ModelSection,
        RolloutSection,
        RunSection,
        TrainSection,
        WeightTransferSection,
    )

    return {
        "run": RunSection,
        "model": ModelSection,
        "rollout": RolloutSection,
        "train": TrainSection,
        "engine": EngineSection,
        "weight_transfer": WeightTransferSection,
    }


@hookimpl
def config_flags() -> list[ConfigFlag]:
    return [
        ConfigFlag(flag="--seed", path="run.seed", help="seed of the run", metavar="N"),
        ConfigFlag(flag="--model", path="model.path", help="HF checkpoint directory", metavar="PATH"),
        ConfigFlag(flag="--task", path="rollout.task", help="task (`miles plugins` lists them)", metavar="NAME"),
        ConfigFlag(
            flag="--prompts",
            path="rollout.prompts",
            help="prompt data: JSONL, JSON, Parquet or Arrow files (comma-separated) or a directory",
            metavar="FILES",
        ),
        ConfigFlag(
            flag="--reward",
            path="rollout.reward",
            help="reward: registry name, module:function, or NAME:WEIGHT,...",
            metavar="SPEC",
        ),
        ConfigFlag(flag="--reward-url", path="rollout.reward_url", help="reward server base URL", metavar="URL"),
        ConfigFlag(
            flag="--reward-url-token",
            path="rollout.reward_url_token",
            help="bearer token of the reward server (or MILES_REWARD_URL_TOKEN)",
            metavar="TOKEN",
        ),
        ConfigFlag(flag="--trainer", path="train.backend", help="training backend", metavar="NAME"),
        ConfigFlag(flag="--engine", path="engine.backend", help="engine backend", metavar="NAME"),
        ConfigFlag(flag="--num-steps", path="run.num_steps", help="RL steps", metavar="N"),
        ConfigFlag(
            flag="--fault-injection",
            path="run.fault_injection",
            help="faults to inject: kill_engine[:ENGINE]@step=N or @weight_update=N, comma-separated",
            metavar="FAULTS",
        ),
        ConfigFlag(flag="--output-dir", path="run.output_dir", help="run directory", metavar="DIR"),
        ConfigFlag(
            flag="--update-weight-transfer-mode",
            path="weight_transfer.mode",
            help="weight-transfer protocol (`miles plugins` lists them)",
            metavar="NAME",
        ),
        ConfigFlag(
            flag="--model-impl",
            path="model.implementations",
            help="implementation of a model family, repeatable (`miles plugins` lists them)",
            metavar="FAMILY=NAME",
            mapping=True,
        ),
        ConfigFlag(
            flag="--dsv4-impl",
            path=f"model.implementations.{DSV4_FAMILY}",
            help=f"implementation of the {DSV4_FAMILY} family (shorthand for --model-impl {DSV4_FAMILY}=NAME)",
            metavar="NAME",
        ),
    ]


@hookimpl
def validate_config(config: MilesConfig, registries: Registries) -> None:
    check_output_dir(config.run.output_dir)
    check_weight_transfer_settings(config, registries)
    check_local_sizes(config)
    for family, impl in config.model.implementations.items():
        check_model_implementation(registries, family, impl)
    named = [
        (registries.training_backends, config.train.backend, "train.backend (--trainer)"),
        (registries.engine_backends, config.engine.backend, "engine.backend (--engine)"),
        (registries.worker_providers, config.run.worker_provider, "run.worker_provider"),
        (registries.tasks, config.rollout.task, "rollout.task (--task)"),
    ]
    for registry, name, field in named:
        try:
            registry.get_or_raise(name)
        except RegistryError as exc:
            raise ConfigError(f"{field} = {name!r}: {exc}") from exc
    check_agent_settings(config, registries)
    from miles_core.training.algorithms import choose_algorithm  # deferred: the estimators import torch

    choose_algorithm(
        config.train, registries, group_size=config.rollout.group_size, max_new_tokens=config.rollout.max_new_tokens
    )
    check_protocol_reaches_engines(config, registries)
    problems = check_faults_fit(
        config.run.fault_injection, num_engines=config.engine.num_engines, num_steps=config.run.num_steps
    )
    if problems:
        raise ConfigError(f"run.fault_injection (--fault-injection): {'; '.join(problems)}")
    check_reward_specs(config, registries)


def check_protocol_reaches_engines(config: MilesConfig, registries: Registries) -> None:
    """Before any engine starts: the protocol uses a weight route the backend's engines serve, on the trainer's node
    (the local provider) or on some node (a provider that may place engines elsewhere; where each one lands is
    checked again when the protocol connects to it). The error names the engines, the protocol and what reaches them."""
    from miles_core.engines.backend import load_engine_backend  # deferred: the backends' modules
    from miles_core.weight_transfer.routes import CHECKSUM, WEIGHTS_BY_NAME, capabilities_of, route_for

    protocol = check_weight_transfer_protocol(registries, config.weight_transfer.mode)
    backend = load_engine_backend(registries, config.engine.backend)
    capabilities = capabilities_of(backend, config)
    engines = f"the engines of engine.backend (--engine) = {config.engine.backend!r}"  # as route_for's errors name them
    if config.weight_transfer.verify_checksum and not (
        capabilities.serves(CHECKSUM) or capabilities.serves(WEIGHTS_BY_NAME)
    ):
        raise ConfigError(
            f"weight_transfer.verify_checksum = true (--weight-transfer-verify-checksum) needs engines that report "
            f"their weights (/weights_checksum, or SGLang's /get_weights_by_name); {engines} serve "
            f"{', '.join(sorted(capabilities.routes))}: leave it false"
        )
    provider = registries.worker_providers.get_or_raise(config.run.worker_provider).load()
    if not getattr(provider, "hosts_in_ray", False):
        route_for(protocol, engines, capabilities, same_node=True)
        return
    try:
        route_for(protocol, engines, capabilities, same_node=True)
    except ConfigError:
        route_for(protocol, engines, capabilities, same_node=False)


def check_agent_settings(config: MilesConfig, registries: Registries) -> None:
    """``--rollout-agent`` (a registered agent or module:function) and ``--rollout-chat-format``, checked before any
    engine starts."""
    from miles_core.rollout.agents import agent_for_task, session_chat_format  # deferred: rollout code

    agent = agent_for_task(config.rollout.task, config.rollout.agent, registries.agents)
    if agent is None:
        if config.rollout.chat_format is not None:
            raise ConfigError("rollout.chat_format (--rollout-chat-format) is for agent runs: give --rollout-agent too")
        return
    name = session_chat_format(config)
    try:
        registries.chat_formats.get_or_raise(name)
    except RegistryError as exc:
        raise ConfigError(f"rollout.chat_format (--rollout-chat-format) = {name!r}: {exc}") from exc


def check_output_dir(output_dir: str, *, setting: str = "run.output_dir (--output-dir)") -> None:
    """Refuse a run directory (or another directory a run writes, named by ``setting`` in messages) that cannot be
    one: an existing non-directory (a file, ``/dev/null``), a path under one (``/dev/null/run``), or a name the
    operating system refuses."""
    shown = repr(output_dir) if len(output_dir) <= 200 else f"{output_dir[:197]!r}..."
    field = f"{setting} = {shown}"
    if "\0" in output_dir:
        raise ConfigError(f"{field} contains a NUL character; name a directory")
    path = Path(output_dir).absolute()
    for candidate in (path, *path.parents):
        try:
            info = os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet, or under a file: the parents say which
        except OSError as exc:
            raise ConfigError(f"{field}: {exc.strerror or exc}; name a directory (created if missing)") from None
        if not stat.S_ISDIR(info.st_mode):
            under = "" if candidate == path else f": {str(candidate)!r} is not a directory, so nothing can be under it"
            what = " exists and is not a directory" if candidate == path else under
            raise ConfigError(f"{field}{what}; name a directory (created if missing)")
        return


LOCAL_PER_CPU = 4
"""With the local worker provider every process runs on this machine: at most this many engines, or threads of one
process, per CPU."""


def check_local_sizes(config: MilesConfig) -> None:
    """With the local worker provider, the engines and the threads of each process run on this machine: refuse more
    than :data:`LOCAL_PER_CPU` per CPU of it (more only wait for a CPU, each holding its memory)."""
    if config.run.worker_provider != "local":
        return  # Ray places them on the cluster's nodes, whose CPUs the config cannot see
    cpus = os.cpu_count() or 1
    bound = LOCAL_PER_CPU * cpus
    sizes = [
        ("engine.num_engines (--engine-num-engines)", config.engine.num_engines, "engines"),
        ("engine.cpu_threads (--engine-cpu-threads)", config.engine.cpu_threads, "threads per engine"),
        ("train.cpu_threads (--train-cpu-threads)", config.train.cpu_threads, "trainer threads"),
    ]
    for field, value, what in sizes:
        if value is not None and value > bound:
            raise ConfigError(
                f"{field} = {value}: more than {LOCAL_PER_CPU} {what} per CPU of this machine ({cpus} CPUs: at most "
                f"{bound}) with the local worker provider, where every process runs here; give at most {bound}, or "
                "--run-worker-provider ray to place them on a cluster"
            )


def check_weight_transfer_settings(config: MilesConfig, registries: Registries) -> None:
    """The run's protocol exists and its settings fit the model it declares (and, for ``auto``, the settings it keeps
    for each protocol fit that protocol's), before any worker starts."""

    def protocol_named(name: str) -> type:
        return check_weight_transfer_protocol(
            registries,
            name,
            field=f"weight_transfer.settings.{name} (--weight-transfer-settings): settings of the protocol",
        )

    protocol = check_weight_transfer_protocol(registries, config.weight_transfer.mode)
    validate_run_settings(protocol, config.weight_transfer.settings, protocol_named=protocol_named)


def check_weight_transfer_protocol(
    registries: Registries, name: str, *, field: str = "weight_transfer.mode (--update-weight-transfer-mode) ="
) -> type:
    """Load the protocol class called ``name``; a :class:`ConfigError` names the flag (``field``) and lists what
    exists."""
    field = f"{field} {name!r}"
    try:
        protocol = registries.weight_transfer_protocols.get_or_raise(name).load()
    except (RegistryError, PluginLoadError) as exc:
        raise ConfigError(f"{field}: {exc}") from exc
    if not (isinstance(protocol, type) and issubclass(protocol, WeightTransferProtocol)):
        raise ConfigError(f"{field}: {protocol!r} is not a subclass of WeightTransferProtocol")
    return protocol


@hookimpl
def provide_model_implementations() -> list[Implementation]:
    return [
        model_implementation(
            ANY_FAMILY,
            "transformers",
            "miles_core.models.transformers_impl:TransformersCausalLM",
            "any family transformers can load",
        ),
        model_implementation(
            DSV4_FAMILY,
            "transformers",
            "miles_core.models.transformers_impl:TransformersCausalLM",
            "transformers' DeepseekV4ForCausalLM, the reference (torch trainer; one process, no parallelism)",
        ),
    ]


@hookimpl
def provide_worker_providers() -> list[Implementation]:
    return [
        Implementation("local", "miles_core.workers.local_provider:LocalWorkerProvider", "child processes"),
        Implementation("ray", "miles_core.builtin.ray_provider:RayWorkerProvider", "Ray placement groups"),
    ]


@hookimpl
def provide_weight_transfer_protocols() -> list[Implementation]:
    return [
        Implementation("auto", "miles_core.weight_transfer.auto:AutoProtocol", "per engine: tensor, rdt or broadcast"),
        Implementation("disk", "miles_core.weight_transfer.disk:DiskProtocol", "safetensors file per version"),
        Implementation("tensor", "miles_core.weight_transfer.tensor:TensorProtocol", "shared-memory staging"),
        Implementation("broadcast", "miles_core.weight_transfer.broadcast:BroadcastProtocol", "gloo/NCCL group"),
    ]


@hookimpl
def provide_training_backends() -> list[Implementation]:
    return [Implementation("torch", "miles_core.builtin.torch_trainer:TorchTrainer", "transformers model, AdamW/SGD")]


@hookimpl
def provide_engine_backends() -> list[Implementation]:
    target = "miles_core.builtin.local_engine.backend:LocalEngineBackend"
    return [Implementation("local", target, "transformers model, SGLang HTTP API")]


@hookimpl
def provide_reward_functions() -> list[Implementation]:
    return [
        Implementation("echo_last", "miles_core.default.task:echo_last_reward", "the default task's reward"),
        Implementation(
            "tool_lookup", "miles_core.default.tool_task:tool_lookup_reward", "the answer's score of tool_lookup"
        ),
        *(
            Implementation(name, f"miles_core.builtin.rewards:{name}_reward", description)
            for name, description in (
                ("math", "math-verify: the last \\boxed{} answer equals the label"),
                ("gsm8k", "the number after #### (else the last number) equals the label's"),
                ("exact", "the stripped response equals the label"),
                ("multiple_choice", "the chosen letter A-J equals the label"),
                ("f1", "SQuAD token F1 with the label (or the best of a list)"),
                ("format", "the final answer is given in \\boxed{...}"),
            )
        ),
    ]


@hookimpl
def provide_tasks() -> list[Implementation]:
    return [
        Implementation("echo_last", "miles_core.default.task:echo_last_prompts", "repeat the last digit"),
        Implementation(
            "tool_lookup",
            "miles_core.default.tool_task:tool_lookup_prompts",
            "multi-turn: call the lookup tool, answer with its secret digit (its agent: tool_lookup)",
        ),
    ]


@hookimpl
def provide_rollout_filters() -> list[Implementation]:
    return [
        Implementation(
            "nonzero_reward_std",
            "miles_core.rollout.filters:nonzero_reward_std",
            "drop a group whose rewards are all equal (zero advantage)",
        ),
        Implementation(
            "no_truncated",
            "miles_core.rollout.filters:no_truncated",
            "drop a group with a sample cut at max_new_tokens",
        ),
    ]


@hookimpl
def provide_agents() -> list[Implementation]:
    return [
        Implementation("single_turn", "miles_core.rollout.agents:single_turn", "one question, one answer"),
        Implementation(
            "tool_lookup",
            "miles_core.default.tool_task:tool_lookup_agent",
            "the tool_lookup task's agent: offers the lookup tool, answers its calls, scores the answer "
            "(openai Chat Completions, streamed)",
        ),
        Implementation(
            "tool_lookup_responses",
            "miles_core.default.tool_task:tool_lookup_responses_agent",
            "the tool_lookup agent through openai's Responses API (streamed)",
        ),
        Implementation(
            "tool_lookup_anthropic",
            "miles_core.default.tool_task:tool_lookup_anthropic_agent",
            "the tool_lookup agent through anthropic's Messages API (streamed)",
        ),
    ]


@hookimpl
def provide_advantage_estimators() -> list[Implementation]:
    module = "miles_core.builtin.algorithms"
    return [
        Implementation("grpo", f"{module}:Grpo", "group-normalised rewards (the default)"),
        Implementation("dr_grpo", f"{module}:DrGrpo", "group-centred rewards, constant-normaliser loss"),
        Implementation("rloo", f"{module}:Rloo", "leave-one-out baseline"),
        Implementation("reinforce_plus_plus", f"{module}:ReinforcePlusPlus", "discounted returns, batch-whitened"),
        Implementation(
            "reinforce_plus_plus_baseline", f"{module}:ReinforcePlusPlusBaseline", "group baseline, batch-whitened"
        ),
        Implementation("gspo", f"{module}:Gspo", "GRPO advantages, sequence-level ratio (gspo loss)"),
        Implementation("ppo", f"{module}:Ppo", "GAE with a critic (the torch trainer)"),
    ]


@hookimpl
def provide_policy_losses() -> list[Implementation]:
    module = "miles_core.builtin.algorithms"
    return [
        Implementation("ppo_clip", f"{module}:PpoClip", "PPO's clipped surrogate per token (the default)"),
        Implementation("gspo", f"{module}:GspoLoss", "clipped sequence-level ratio (GSPO)"),
    ]


@hookimpl
def provide_chat_formats() -> list[Implementation]:
    return [
        Implementation(
            "default",
            "miles_core.builtin.chat_formats:DigitChatFormat",
            "the embedded default's digit tokenizer: <bos>ROLE: content <eos>, tool calls as :TOOL:ARGUMENT",
        ),
        Implementation(
            "qwen3",
            "miles_core.builtin.chat_formats:Qwen3ChatFormat",
            "Qwen3: <|im_start|>role ... <|im_end|>, <tool_call> JSON tool calls",
        ),
        Implementation(
            "inkling",
            "miles_core.builtin.inkling_format:InklingChatFormat",
            "Inkling: special-token blocks per role and content kind, parsed on token ids",
        ),
        Implementation(
            "hf",
            "miles_core.builtin.hf_format:HfChatFormat",
            "the checkpoint's own chat template, checked every turn to extend the tokens sampled",
        ),
    ]
