"""Hook implementations of the example plugin: a reward function, a model implementation, a training backend and an
engine backend. Targets are import strings, so listing plugins imports no torch."""

from __future__ import annotations

from typing import Any

from miles_core import Implementation, hookimpl, model_implementation


def keyword_reward(*, prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 when the label (a keyword) occurs in the response, else 0.0."""
    return 1.0 if str(label) in response else 0.0


@hookimpl
def provide_reward_functions() -> list[Implementation]:
    return [Implementation(name="example.keyword", target=keyword_reward, description="label occurs in the response")]


@hookimpl
def provide_model_implementations() -> list[Implementation]:
    return [
        model_implementation(
            "llama", "minimal", "miles_example_hooks.minimal_llama:MinimalLlama", "plain-PyTorch Llama, eager"
        )
    ]


@hookimpl
def provide_training_backends() -> list[Implementation]:
    target = "miles_example_hooks.reinforce:ReinforceTrainer"
    return [Implementation("example-reinforce", target, "plain REINFORCE on the minimal Llama (an example)")]


@hookimpl
def provide_engine_backends() -> list[Implementation]:
    target = "miles_example_hooks.reinforce:ExampleLocalEngines"
    return [Implementation("example-local", target, "Miles' local engine as a command (an example)")]
