"""The ``hf`` chat format: a checkpoint's own chat template, token in, token out. A ChatML template in Qwen's style
renders append-only (no warning, the template's text exactly); a template in DeepSeek-R1's style (it opens the
reasoning in the generation prompt and drops it from earlier turns) re-renders earlier turns: the format names the
turn, keeps the sampled tokens and appends exactly the new messages. Then two short ``miles train`` runs of a tiny
model through session servers, one per template."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from miles_core.builtin.hf_format import HfChatFormat
from miles_core.rollout.sessions import ChatMessage, ToolCall
from miles_core.rollout.sessions.formats import ChatFormatError, ChatFormatWarning
from miles_core.rollout.sessions.session import Session
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import qwen3_like_tokenizer
from tests.test_train import metrics, train

CHATML_MESSAGE = """\
{%- if message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
{{ '\\n' if loop.first and message.content else '' }}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
"""
TOOLS_HEADER = """\
{%- if tools -%}
<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif -%}
"""
QWEN_STYLE_TEMPLATE = (
    TOOLS_HEADER
    + "{%- for message in messages -%}"
    + CHATML_MESSAGE
    + "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{% endif -%}"
)
"""ChatML as Qwen2.5 writes it (our own text): each message as it is, tool calls as Hermes ``<tool_call>`` blocks."""
R1_STYLE_TEMPLATE = (
    TOOLS_HEADER
    + "{%- set last_user = namespace(index=-1) -%}"
    + "{%- for message in messages %}{% if message.role == 'user' %}{% set last_user.index = loop.index0 %}"
    + "{% endif %}{% endfor -%}"
    + "{%- for message in messages -%}"
    + "{%- if message.role == 'assistant' and loop.index0 < last_user.index and '</think>' in message.content -%}"
    + "{%- set message = {'role': 'assistant', 'content': message.content.split('</think>')[-1].lstrip('\\n'),"
    + " 'tool_calls': message.tool_calls} -%}"
    + "{%- endif -%}"
    + CHATML_MESSAGE
    + "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n{% endif -%}"
)
"""DeepSeek-R1's habits (our own text): the generation prompt opens ``<think>``, and an assistant turn before the
last user message loses its reasoning (everything up to ``</think>``)."""
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def tokenizer_with(template: str):
    tokenizer = qwen3_like_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def chars(tokenizer, text: str) -> list[int]:
    """One id per character: what a model samples when it does not take the tokenizer's merges."""
    return [tokenizer.convert_tokens_to_ids(char) for char in text]


def as_dicts(messages: list[ChatMessage]) -> list[dict]:
    from miles_core.builtin.hf_format import template_message

    return [template_message(message) for message in messages]


def test_an_append_only_template_renders_as_itself_and_grows_without_a_warning() -> None:
    tokenizer = tokenizer_with(QWEN_STYLE_TEMPLATE)
    fmt = HfChatFormat(tokenizer)
    history = [ChatMessage("system", "be brief"), ChatMessage("user", "sum 12")]
    prompt = fmt.render(history, tools=[LOOKUP])
    expected = tokenizer.apply_chat_template(
        as_dicts(history), tools=[LOOKUP], add_generation_prompt=True, tokenize=False
    )
    assert prompt == encode(tokenizer, expected)
    call = encode(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"k": 1}}\n</tool_call><|im_end|>')
    generated = chars(tokenizer, "12\n") + call  # "1" "2": the tokenizer would merge them on re-encoding
    content, calls = fmt.parse_tool_calls(generated, tools=[LOOKUP])
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == ("12", [("lookup", {"k": 1})])
    assistant = ChatMessage("assistant", content, tool_calls=(ToolCall("lookup", calls[0].arguments, "c1"),))
    tool = ChatMessage("tool", "7", tool_call_id="c1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChatFormatWarning)
        ids = fmt.append([*prompt, *generated], [tool], history=[*history, assistant], tools=[LOOKUP])
    appended = "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ids == [*prompt, *generated, *encode(tokenizer, appended)]  # the sampled ids kept, the rest the template's
    whole = [*history, assistant, tool]
    assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.apply_chat_template(
        as_dicts(whole), tools=[LOOKUP], add_generation_prompt=True, tokenize=False
    )


def test_a_turn_cut_at_the_length_limit_is_closed_as_the_template_ends_a_turn() -> None:
    tokenizer = tokenizer_with(QWEN_STYLE_TEMPLATE)
    fmt = HfChatFormat(tokenizer)
    assert fmt.close_turn(chars(tokenizer, "ab")) == encode(tokenizer, "<|im_end|>\n")
    assert fmt.close_turn(encode(tokenizer, "ab<|im_end|>")) == encode(tokenizer, "\n")


def test_a_template_that_drops_earlier_reasoning_is_named_and_the_sampled_tokens_kept() -> None:
    tokenizer = tokenizer_with(R1_STYLE_TEMPLATE)
    fmt = HfChatFormat(tokenizer)
    history = [ChatMessage("user", "hi")]
    prompt = fmt.render(history)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    turn1 = encode(tokenizer, "plan\n</think>\n\nok<|im_end|>")
    content, _ = fmt.parse_tool_calls(turn1)
    assert content == "plan\n</think>\n\nok"
    history += [ChatMessage("assistant", content)]
    with pytest.warns(ChatFormatWarning, match=r"renders turn 1 differently") as caught:
        ids = fmt.append([*prompt, *turn1], [ChatMessage("user", "more")], history=history)
    assert "'ok<|im_end|>" in str(caught[0].message) and "'<think>\\nplan" in str(caught[0].message)
    next_turn = "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert ids == [*prompt, *turn1, *encode(tokenizer, next_turn)]  # held as sampled, then exactly the new message
    # a second turn: the first stays the turn named, and the new messages are placed after the held ones again
    turn2 = encode(tokenizer, "again\n</think>\n\nfine<|im_end|>")
    history += [ChatMessage("user", "more"), ChatMessage("assistant", fmt.parse_tool_calls(turn2)[0])]
    with pytest.warns(ChatFormatWarning, match=r"renders turn 1 differently"):
        grown = fmt.append([*ids, *turn2], [ChatMessage("user", "end")], history=history)
    tail = "\n<|im_start|>user\nend<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert grown == [*ids, *turn2, *encode(tokenizer, tail)]


def test_a_session_records_the_formats_warning_once_in_its_trajectory() -> None:
    tokenizer = tokenizer_with(R1_STYLE_TEMPLATE)
    fmt = HfChatFormat(tokenizer)
    session = Session("s", messages=[ChatMessage("user", "hi")], sampling={"seed": 1}, metadata={})
    for turn, new in enumerate(([], [ChatMessage("user", "a")], [ChatMessage("user", "b")])):
        input_ids = session.input_ids(fmt, new, tools=[])
        output = encode(tokenizer, f"r{turn}</think>x{turn}<|im_end|>")
        assistant = ChatMessage("assistant", fmt.parse_tool_calls(output)[0])
        session.record_turn(
            input_ids=input_ids,
            tools=[],
            new_messages=new,
            output_ids=output,
            logprobs=[-1.0] * len(output),
            assistant=assistant,
            finish_reason="stop",
            weight_version=0,
        )
    trajectory = session.trajectory()
    assert [note["summary"] for note in trajectory.notes] == [
        "chat format 'hf': the checkpoint's chat template renders turn 1 differently once later messages follow"
    ]
    text = tokenizer.decode([*trajectory.prompt_ids, *trajectory.response_ids], skip_special_tokens=False)
    assert text.count("<think>\nr") == 3  # every turn as sampled, its reasoning kept
    assert sum(trajectory.loss_mask) == sum(turn.end - turn.start for turn in trajectory.turns)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (None, "has none"),
        ("{{ raise_exception('no system messages') }}", "refused the conversation: no system messages"),
        ("{% for m in messages %}{{ m.role }}{% endfor %}", "does not write an assistant message's content"),
    ],
)
def test_a_tokenizer_without_a_usable_template_is_refused(template: str | None, message: str) -> None:
    with pytest.raises(ChatFormatError, match=message):
        HfChatFormat(tokenizer_with(template) if template else qwen3_like_tokenizer())


def test_tools_with_a_template_whose_calls_the_format_cannot_read_are_refused() -> None:
    plain = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    fmt = HfChatFormat(tokenizer_with(plain))
    assert fmt.parse_tool_calls(encode(qwen3_like_tokenizer(), "a<tool_call>{}</tool_call><|im_end|>"))[1] == []
    with pytest.raises(ChatFormatError, match="cannot read tool calls of this model"):
        fmt.render([ChatMessage("user", "x")], tools=[LOOKUP])


AGENT = """\
from miles_core import hookimpl
from miles_core.rollout.agents import session_client


async def two_turns(*, base_url, prompt, metadata):
    client = session_client(base_url)
    messages = [{"role": "user", "content": prompt}]
    for follow_up in ("go on", None):
        reply = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)).choices[0]
        messages.append({"role": "assistant", "content": reply.message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return len(reply.message.content or "") / 4


def unused_reward(**_):
    return 0.0  # the agent scores every sample itself


@hookimpl
def on_samples(rollout_id, step, samples):
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(__import__("os").environ["CHECK_MODEL"])
    for sample in samples:
        text = tokenizer.decode(sample.prompt_ids + sample.response_ids, skip_special_tokens=False)
        header = __import__("os").environ["CHECK_HEADER"]
        policy = sum(turn.end - turn.start for turn in sample.turns)
        print("SAMPLE", text.count(header), len(sample.turns), sum(sample.loss_mask) == policy, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("template", "header", "warns"),
    [
        (QWEN_STYLE_TEMPLATE, "<|im_start|>assistant\n", False),
        (R1_STYLE_TEMPLATE, "<|im_start|>assistant\n<think>\n", True),
    ],
    ids=["qwen_style", "r1_style"],
)
def test_a_run_with_the_checkpoints_template(tmp_path: Path, template: str, header: str, warns: bool) -> None:
    """``miles train --rollout-chat-format hf``: two-turn sessions of a tiny model; the append-only template says
    nothing, the other names the turn once; every sample holds each turn as sampled (its generation prompt's header
    once per turn, the loss mask on exactly the sampled tokens)."""
    tokenizer = tokenizer_with(template)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = save_tiny_llama(tmp_path / "model", vocab_size=len(tokenizer), eos_token_id=im_end, pad_token_id=0)
    tokenizer.save_pretrained(model)
    (tmp_path / "agent_checks.py").write_text(AGENT)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {n}"}) + "\n" for n in range(8)))
    result = train(
        tmp_path / "run",
        "--no-progress",
        "--model",
        str(model),
        "--rollout-agent",
        "agent_checks:two_turns",
        "--rollout-chat-format",
        "hf",
        "--prompts",
        str(prompts),
        "--reward",
        "agent_checks:unused_reward",
        "--plugin",
        str(tmp_path / "agent_checks.py"),
        "--num-steps",
        "2",
        "--rollout-batch-size",
        "2",
        "--rollout-group-size",
        "2",
        "--run-eval-every",
        "0",
        env={"CHECK_MODEL": str(model), "CHECK_HEADER": header, "PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
    )
    assert [row["step"] for row in metrics(tmp_path / "run") if "train/loss" in row] == [1, 2]
    samples = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("SAMPLE")]
    assert samples == [["2", "2", "True"]] * 8, samples
    warning = "miles: warning: chat format 'hf': the checkpoint's chat template renders turn 1 differently"
    assert result.stderr.count(warning) == (1 if warns else 0), result.stderr[-2000:]
    assert ("miles: warning:" in result.stderr) == warns


@pytest.mark.slow
@pytest.mark.parametrize(
    ("chat_format", "says"),
    [
        ("hf", "'hf': chat format 'hf' renders with the checkpoint's chat template, and this tokenizer has none"),
        ("inkling", "'inkling': chat format 'inkling' needs '<|message_system|>' as one token"),
    ],
)
def test_a_chat_format_that_cannot_serve_the_tokenizer_is_refused_before_any_worker(
    tmp_path: Path, chat_format: str, says: str
) -> None:
    tokenizer = qwen3_like_tokenizer()  # Qwen3's special tokens, no chat template
    model = save_tiny_llama(tmp_path / "model", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(model)
    (tmp_path / "agent_checks.py").write_text(AGENT)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "say 1"}) + "\n")
    result = train(
        tmp_path / "run",
        "--no-progress",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--reward",
        "agent_checks:unused_reward",
        "--rollout-agent",
        "agent_checks:two_turns",
        "--rollout-chat-format",
        chat_format,
        env={"PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
        ok=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"miles: error: rollout.chat_format (--rollout-chat-format) = {says}" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no worker was started
