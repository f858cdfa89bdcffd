"""The embedded multi-turn task, *tool_lookup* (``--task tool_lookup``): a question only a tool can answer.

A prompt is five digits, such as ``"73915"``; each prompt has a secret digit, drawn at random and kept in its
metadata, that nothing in the prompt tells. The agent (:func:`tool_lookup_agent`, registered under the task's name,
so ``--task tool_lookup`` plays it) offers the policy one tool, ``lookup``; in the embedded default's chat format a
call is written ``:0:ARGUMENT`` (tool number 0). When the policy's first turn calls it, the agent answers with the
secret as the tool message and asks for a second turn; the answer is the turn after the tool's message. The
environment is lenient about the tool's number: a call to another number (the format names tools by position, and
only ``0`` is offered) is answered as lookup's, so that a policy that has found the call syntax is rewarded for it.
The reward is 0 without a call; with one, half for calling and half the fraction of the answer's first four
characters equal to the secret: 1.0 for a policy that calls the tool and repeats what it returned. On the embedded
default model the policy learns to call the tool (a well-formed call in a 5-token turn) in a few dozen steps; copying
the tool's digit comes later.

The agent talks to its session with the real ``openai`` client, as any third-party agent would.
"""

from __future__ import annotations

import random
from typing import Any

from miles_core.default.task import distinct_digit_strings
from miles_core.rollout.agents import POLICY_MODEL, session_client
from miles_core.rollout.prompts import Prompt

ANSWER_LENGTH = 4
CALL_TOKENS = 5
"""The first turn's limit: room for a call such as ``:0:5`` and little for stray colons, which make a call
malformed (a tiny policy sampling 8 tokens at temperature 1 wrote them far more often than it learned to stop)."""
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The secret digit of the question.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def answer_score(answer: str, secret: str) -> float:
    """The fraction of the answer's first four characters equal to the secret digit."""
    return sum(char == secret for char in answer[:ANSWER_LENGTH]) / ANSWER_LENGTH


def tool_lookup_reward(*, prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """The answer's score alone, for runs that play the prompts with another agent (``--rollout-agent``)."""
    return answer_score(response, str(label))


def tool_lookup_prompts(
    *, seed: int = 0, train_size: int = 512, eval_size: int = 64
) -> tuple[list[Prompt], list[Prompt]]:
    """Disjoint train and eval prompts, each with its secret digit (the label, and ``metadata["secret"]``)."""
    rng = random.Random(f"tool_lookup/{seed}")
    prompts = []
    for question in distinct_digit_strings(rng, train_size + eval_size):
        secret = rng.choice("0123456789")
        prompts.append(Prompt(text=question, label=secret, metadata={"secret": secret}))
    return prompts[:train_size], prompts[train_size:]


async def tool_lookup_agent(*, base_url: str, prompt: str, metadata: dict[str, Any]) -> float:
    """Ask the question with the ``lookup`` tool; answer its calls with the secret; score the answer after it."""
    secret = str(metadata["secret"])
    client = session_client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(
        model=POLICY_MODEL, messages=messages, tools=[LOOKUP_TOOL], max_tokens=CALL_TOKENS
    )
    reply = first.choices[0].message
    calls = reply.tool_calls or []
    if not calls:
        return 0.0  # an answer without the tool is a guess: rewarding it taught a policy to guess one digit
    messages.append(
        {"role": "assistant", "content": reply.content, "tool_calls": [call.model_dump() for call in calls]}
    )
    for call in calls:  # the environment: every call is taken as lookup's (see the module docstring)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": secret})
    second = await client.chat.completions.create(
        model=POLICY_MODEL, messages=messages, tools=[LOOKUP_TOOL], max_tokens=ANSWER_LENGTH
    )
    return 0.5 + 0.5 * answer_score(second.choices[0].message.content or "", secret)
