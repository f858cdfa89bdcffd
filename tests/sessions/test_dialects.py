"""The session server's dialects through the real client libraries: OpenAI's Chat Completions and Responses
(``openai``) and Anthropic's Messages (``anthropic``), streamed and not. Each plays the same three-turn
conversation with a tool on the tool-calling model (greedy), and the session's trajectory equals the one Chat
Completions gives, id for id and mask for mask (Chat Completions' own is checked token by token in
test_server.py); bad input is a 4xx in the dialect's own error shape and leaves the session as it was."""

from __future__ import annotations

import json
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from tests.sessions.test_server import (
    AUTH,
    CALCULATOR,
    GREEDY,
    TOOL_CALLER_TOKENS,
    Servers,
    create,
    servers,
    trajectory,
)

__all__ = ["servers"]  # the module's engines and session servers (a fixture of test_server.py)

pytestmark = pytest.mark.slow

PROMPT = "73915:"
SAMPLING = {**GREEDY, "max_tokens": TOOL_CALLER_TOKENS}
ANTHROPIC_TOOL = {
    "name": "calculator",
    "input_schema": CALCULATOR["function"]["parameters"],
}
RESPONSES_TOOL = {"type": "function", "name": "calculator", "parameters": CALCULATOR["function"]["parameters"]}


def chat_completions(base_url: str, stream: bool) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages: list[dict] = [{"role": "user", "content": PROMPT}]
    calls_seen = []
    for new in ([], "tool", [{"role": "user", "content": "5:"}]):
        if new == "tool":
            new = [{"role": "tool", "tool_call_id": calls_seen[-1], "content": "42"}]
        messages += new
        if stream:
            with client.chat.completions.stream(model="policy", messages=messages, tools=[CALCULATOR]) as events:
                message = events.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = message.choices[0].message
        calls = [call.model_dump() for call in message.tool_calls or []]
        calls_seen += [call["id"] for call in calls]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
    return calls_seen


def responses(base_url: str, stream: bool) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    items: list = [{"role": "user", "content": PROMPT}]
    calls_seen: list[str] = []
    for turn in range(3):
        if turn == 1:
            items.append({"type": "function_call_output", "call_id": calls_seen[-1], "output": "42"})
        elif turn == 2:
            items.append({"role": "user", "content": "5:"})
        if stream:
            with client.responses.stream(model="policy", input=items, tools=[RESPONSES_TOOL]) as events:
                answer = events.get_final_response()
        else:
            answer = client.responses.create(model="policy", input=items, tools=[RESPONSES_TOOL])
        calls_seen += [item.call_id for item in answer.output if item.type == "function_call"]
        items += answer.output  # the client's items, resent as it serializes them
    return calls_seen


def messages(base_url: str, stream: bool) -> list[str]:
    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=120)
    conversation: list[dict] = [{"role": "user", "content": PROMPT}]
    calls_seen: list[str] = []
    for turn in range(3):
        if turn == 1:
            result = {"type": "tool_result", "tool_use_id": calls_seen[-1], "content": "42"}
            conversation.append({"role": "user", "content": [result]})
        elif turn == 2:
            conversation.append({"role": "user", "content": "5:"})
        asked = {
            "model": "policy",
            "max_tokens": TOOL_CALLER_TOKENS,
            "messages": conversation,
            "tools": [ANTHROPIC_TOOL],
        }
        if stream:
            with client.messages.stream(**asked) as events:
                answer = events.get_final_message()
        else:
            answer = client.messages.create(**asked)
        assert answer.stop_reason == "tool_use"
        calls_seen += [block.id for block in answer.content if block.type == "tool_use"]
        conversation.append({"role": "assistant", "content": answer.content})  # the client's blocks, resent
    return calls_seen


DIALECTS: dict[str, Callable[[str, bool], list[str]]] = {
    "chat_completions": chat_completions,
    "responses": responses,
    "messages": messages,
}


def played(servers: Servers, dialect: str, stream: bool) -> tuple[dict, list[str]]:
    session = create(servers.tool_url, [], sampling=SAMPLING)
    try:
        calls = DIALECTS[dialect](session["base_url"], stream)
        return trajectory(servers.tool_url, session["session_id"]), calls
    finally:
        end(servers.tool_url, session["session_id"])


def end(url: str, sid: str) -> None:
    assert httpx.delete(f"{url}/sessions/{sid}", headers=AUTH, timeout=60).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("dialect", ["responses", "messages", "chat_completions"])
def test_each_dialect_records_the_tokens_chat_completions_records(servers: Servers, dialect: str, stream: bool) -> None:
    expected, _ = played(servers, "chat_completions", False)
    got, calls = played(servers, dialect, stream)
    assert len(calls) == 3  # the tool caller calls its tool every turn; each call answered by its id
    for key in ("prompt_ids", "response_ids", "loss_mask", "logprobs"):
        assert got[key] == expected[key], key
    assert sum(got["loss_mask"]) == 3 * TOOL_CALLER_TOKENS  # exactly the sampled tokens are trained
    prefix = {"responses": "call_", "messages": "toolu_", "chat_completions": "call_"}[dialect]
    assert all(call.startswith(prefix) for call in calls)


def post(base_url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/{route}", json=body, timeout=120)


def anthropic_error(response: httpx.Response, status: int, says: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == "invalid_request_error" and says in body["error"]["message"], body


def openai_error(response: httpx.Response, status: int, says: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and says in error["message"], error


def test_bad_input_is_a_4xx_in_each_dialects_shape_and_the_session_goes_on(servers: Servers) -> None:
    url = servers.tool_url
    first = create(url, [], sampling=SAMPLING)
    other = create(url, [], sampling=SAMPLING)
    base, other_base = first["base_url"], other["base_url"]
    user = {"role": "user", "content": PROMPT}
    tools = [ANTHROPIC_TOOL]
    # Anthropic: an unknown block type, a tool_result for a call nobody made, tool_use input not an object
    image = {"role": "user", "content": [{"type": "image", "source": {}}]}
    asked = {"model": "m", "max_tokens": TOOL_CALLER_TOKENS, "tools": tools}
    anthropic_error(post(base, "messages", {**asked, "messages": [image]}), 400, "unknown content block type 'image'")
    stranger = {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "1"}
    anthropic_error(
        post(base, "messages", {**asked, "messages": [user, {"role": "user", "content": [stranger]}]}),
        400,
        "which no assistant turn of this session made",
    )
    bad_use = {"type": "tool_use", "id": "toolu_x", "name": "calculator", "input": "1+1"}
    anthropic_error(
        post(base, "messages", {**asked, "messages": [user, {"role": "assistant", "content": [bad_use]}]}),
        400,
        "input",
    )
    # Responses: an unknown item type, a call output for an unknown call, arguments that are not an object,
    # another session's response id
    responses_body = {"model": "m", "tools": [RESPONSES_TOOL]}
    openai_error(
        post(base, "responses", {**responses_body, "input": [{"type": "web_search_call", "id": "x"}]}),
        400,
        "has type 'web_search_call'",
    )
    orphan = {"type": "function_call_output", "call_id": "call_nobody", "output": "1"}
    openai_error(
        post(base, "responses", {**responses_body, "input": [user, orphan]}), 400, "no assistant turn of this session"
    )
    not_object = {"type": "function_call", "call_id": "call_x", "name": "calculator", "arguments": "[1]"}
    openai_error(post(base, "responses", {**responses_body, "input": [user, not_object]}), 400, "a JSON object")
    theirs = post(other_base, "responses", {**responses_body, "input": PROMPT})
    assert theirs.status_code == 200, theirs.text
    cross = {**responses_body, "input": "5:", "previous_response_id": theirs.json()["id"]}
    openai_error(post(base, "responses", cross), 400, "is no answer of this session")
    # Chat Completions: a tool result naming another session's call
    their_call = next(item["call_id"] for item in theirs.json()["output"] if item["type"] == "function_call")
    chat = {"model": "m", "messages": [user, {"role": "tool", "tool_call_id": their_call, "content": "1"}]}
    openai_error(post(base, "chat/completions", chat), 400, "no assistant turn of this session")
    # the session is as it was: nothing recorded, and a good request takes its first turn
    assert trajectory(url, first["session_id"])["response_ids"] == []
    good = post(base, "messages", {**asked, "messages": [user]})
    assert good.status_code == 200 and good.json()["stop_reason"] == "tool_use", good.text
    # continuing a Responses session from its latest answer: input holds only the new items
    latest = theirs.json()
    outputs = [{"type": "function_call_output", "call_id": their_call, "output": "42"}]
    follow = post(other_base, "responses", {**responses_body, "input": outputs, "previous_response_id": latest["id"]})
    assert follow.status_code == 200, follow.text
    stale = post(other_base, "responses", {**responses_body, "input": "5:", "previous_response_id": latest["id"]})
    openai_error(stale, 400, "not its latest")
    assert json.loads(follow.text)["previous_response_id"] == latest["id"]
    end(url, first["session_id"])
    end(url, other["session_id"])
