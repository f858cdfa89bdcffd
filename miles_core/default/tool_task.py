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

The same task is written against each client API that a session serves, with the real client libraries, as any
third-party agent would be: :func:`tool_lookup_agent` with ``openai``'s Chat Completions,
:func:`tool_lookup_responses_agent` with ``openai``'s Responses API (``--rollout-agent tool_lookup_responses``) and
:func:`tool_lookup_anthropic_agent` with ``anthropic``'s Messages (``--rollout-agent tool_lookup_anthropic``); the
environment and the reward are one (:func:`lookup_reward`). Each takes its turns through its SDK's stream reader
(``chat.completions.stream``, ``responses.stream``, ``messages.stream``), the path that streaming agent frameworks
take; a turn asked without streaming records the same tokens (``tests/sessions/test_dialects.py``).
"""

from __future__ import annotations

import random
from typing import Any

from miles_core.default.task import distinct_digit_strings
from miles_core.rollout.agents import POLICY_MODEL, session_anthropic_client, session_client
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
"""The tool in Chat Completions' shape; the Responses API's and Anthropic's below carry the same fields."""
RESPONSES_LOOKUP_TOOL = {"type": "function", **LOOKUP_TOOL["function"]}
ANTHROPIC_LOOKUP_TOOL = {
    "name": LOOKUP_TOOL["function"]["name"],
    "description": LOOKUP_TOOL["function"]["description"],
    "input_schema": LOOKUP_TOOL["function"]["parameters"],
}
TERMINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete")
"""The Responses events that end a stream with the whole response: done, or cut at ``max_output_tokens``."""


def answer_score(answer: str, secret: str) -> float:
    """The fraction of the answer's first four characters equal to the secret digit."""
    return sum(char == secret for char in answer[:ANSWER_LENGTH]) / ANSWER_LENGTH


def lookup_reward(*, called: bool, answer: str, secret: str) -> float:
    """The agents' reward: 0 without a call (an answer without the tool is a guess: rewarding it taught a policy to
    guess one digit), else half for calling and half the answer's score."""
    return 0.5 + 0.5 * answer_score(answer, secret) if called else 0.0


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
    """Ask the question with the ``lookup`` tool through Chat Completions; answer its calls with the secret (every
    call is taken as lookup's: see the module docstring); score the answer after them."""
    secret = str(metadata["secret"])
    client = session_client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    reply = await _chat_turn(client, messages, max_tokens=CALL_TOKENS)
    calls = reply.tool_calls or []
    if calls:
        assistant_calls = [
            {"id": c.id, "type": "function", "function": c.function.model_dump(include={"name", "arguments"})}
            for c in calls
        ]
        messages.append({"role": "assistant", "content": reply.content, "tool_calls": assistant_calls})
        messages += [{"role": "tool", "tool_call_id": call.id, "content": secret} for call in calls]
        reply = await _chat_turn(client, messages, max_tokens=ANSWER_LENGTH)
    return lookup_reward(called=bool(calls), answer=reply.content or "", secret=secret)


async def _chat_turn(client: Any, messages: list[dict[str, Any]], *, max_tokens: int) -> Any:
    asked = {"model": POLICY_MODEL, "messages": messages, "tools": [LOOKUP_TOOL], "max_tokens": max_tokens}
    async with client.chat.completions.stream(**asked) as events:
        await events.until_done()
        # the stream's accumulated completion: get_final_completion() parses it and raises LengthFinishReasonError
        # for a turn cut at max_tokens, which most of this task's turns are
        return events.current_completion_snapshot.choices[0].message


async def tool_lookup_responses_agent(*, base_url: str, prompt: str, metadata: dict[str, Any]) -> float:
    """:func:`tool_lookup_agent` through the Responses API: the tool's outputs continue the first answer by its id
    (``previous_response_id``), so the second request holds only the new items."""
    secret = str(metadata["secret"])
    client = session_client(base_url)
    reply = await _responses_turn(client, prompt, max_tokens=CALL_TOKENS)
    calls = [item for item in reply.output if item.type == "function_call"]
    if calls:
        outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": secret} for call in calls]
        reply = await _responses_turn(client, outputs, max_tokens=ANSWER_LENGTH, previous_response_id=reply.id)
    return lookup_reward(called=bool(calls), answer=reply.output_text, secret=secret)


async def _responses_turn(client: Any, items: str | list[dict[str, Any]], *, max_tokens: int, **more: Any) -> Any:
    asked = {"model": POLICY_MODEL, "input": items, "tools": [RESPONSES_LOOKUP_TOOL], "max_output_tokens": max_tokens}
    async with client.responses.stream(**asked, **more) as events:
        # the terminal event's response: get_final_response() takes only response.completed, and a turn cut at
        # max_output_tokens ends with response.incomplete (as OpenAI's does; openai/openai-python#3538)
        final = [event.response async for event in events if event.type in TERMINAL_RESPONSE_EVENTS]
    return final[-1]


async def tool_lookup_anthropic_agent(*, base_url: str, prompt: str, metadata: dict[str, Any]) -> float:
    """:func:`tool_lookup_agent` through Anthropic's Messages: the calls are ``tool_use`` blocks, answered by
    ``tool_result`` blocks in the next user message."""
    secret = str(metadata["secret"])
    client = session_anthropic_client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    reply = await _messages_turn(client, messages, max_tokens=CALL_TOKENS)
    uses = [block for block in reply.content if block.type == "tool_use"]
    if uses:
        results = [{"type": "tool_result", "tool_use_id": use.id, "content": secret} for use in uses]
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": results}]
        reply = await _messages_turn(client, messages, max_tokens=ANSWER_LENGTH)
    answer = "".join(block.text for block in reply.content if block.type == "text")
    return lookup_reward(called=bool(uses), answer=answer, secret=secret)


async def _messages_turn(client: Any, messages: list[dict[str, Any]], *, max_tokens: int) -> Any:
    asked = {"model": POLICY_MODEL, "messages": messages, "tools": [ANTHROPIC_LOOKUP_TOOL], "max_tokens": max_tokens}
    async with client.messages.stream(**asked) as events:
        return await events.get_final_message()
