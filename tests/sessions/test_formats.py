"""Token-in-token-out chat formats: the Qwen3 format on a tokenizer built offline with Qwen3's special tokens, the
embedded default's digit format, the append-only check, tool-call parsing on token ids, and the registry."""

from __future__ import annotations

import json
import re

import pytest

from miles_core.builtin.chat_formats import DigitChatFormat, Qwen3ChatFormat
from miles_core.default.tokenizer import DigitTokenizer
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.sessions import ChatFormatError, ChatMessage, ToolCall, check_append_only
from miles_core.rollout.sessions.server import load_chat_format, model_context_length
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import qwen3_like_tokenizer, save_char_tokenizer

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CALCULATOR = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {}}}},
}


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_like_tokenizer()


@pytest.fixture(scope="module")
def qwen3(tokenizer) -> Qwen3ChatFormat:
    return Qwen3ChatFormat(tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def chars(tokenizer, text: str) -> list[int]:
    """``text`` one token per character (as a model may generate it, unmerged)."""
    return [tokenizer.convert_tokens_to_ids(char) for char in text]


def test_qwen3_renders_qwen3s_template(qwen3: Qwen3ChatFormat) -> None:
    """System with tools, user, an assistant tool call, two consecutive tool results: Qwen3's layout."""
    messages = [
        ChatMessage("system", "be brief"),
        ChatMessage("user", "add"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("add", '{"a": 1, "b": 2}'),)),
        ChatMessage("tool", "3"),
        ChatMessage("tool", "ok"),
    ]
    text = qwen3.render_text(messages, tools=[ADD_TOOL], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nbe brief\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(ADD_TOOL)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nadd<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_thinking = Qwen3ChatFormat(qwen3.tokenizer, enable_thinking=False)
    assert no_thinking.render_text([ChatMessage("user", "x")], add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_tito_keeps_the_generated_ids_where_retokenizing_drifts(tokenizer, qwen3: Qwen3ChatFormat) -> None:
    """The model wrote ``1`` and ``2`` as two tokens; decoding and encoding again merges them into ``12``. The TITO
    ids are exactly the prompt, the generated ids and the appended message tokens; a re-rendering is not."""
    history = [ChatMessage("user", "add 1 and 2")]
    prompt = qwen3.render(history, tools=[ADD_TOOL])
    call = encode(tokenizer, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>')
    generated = chars(tokenizer, "sum 12\n") + call
    assert encode(tokenizer, tokenizer.decode(generated, skip_special_tokens=False)) != generated  # drift exists

    content, calls = qwen3.parse_tool_calls(generated, tools=[ADD_TOOL])
    assert (content, calls) == ("sum 12", [ToolCall("add", '{"a": 1, "b": 2}')])
    assistant = ChatMessage("assistant", content, tool_calls=tuple(calls))
    tool = ChatMessage("tool", "3")
    ids = qwen3.append([*prompt, *generated], [tool], history=[*history, assistant], tools=[ADD_TOOL])
    appended = encode(tokenizer, "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n")
    assert ids == prompt + generated + appended + encode(tokenizer, "<|im_start|>assistant\n")
    retokenized = qwen3.render([*history, assistant, tool], tools=[ADD_TOOL])
    assert retokenized != ids  # what a text round trip would have trained on
    assert ids[len(prompt) : len(prompt) + len(generated)] == generated


def test_a_turn_cut_at_the_length_limit_is_closed(tokenizer, qwen3: Qwen3ChatFormat) -> None:
    history = [ChatMessage("user", "hi")]
    prompt = qwen3.render(history)
    generated = chars(tokenizer, "hel")  # no <|im_end|>: cut by max_new_tokens
    ids = qwen3.append(
        [*prompt, *generated], [ChatMessage("user", "go on")], history=[*history, ChatMessage("assistant", "hel")]
    )
    closing = encode(tokenizer, "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")
    assert ids == prompt + generated + closing


def test_tool_calls_are_found_as_token_ids_not_in_the_text(tokenizer, qwen3: Qwen3ChatFormat) -> None:
    """The characters ``<tool_call>`` written one by one are content, not a call; a call's JSON that does not
    parse stays in the content; several calls are parsed in order."""
    spelled = chars(tokenizer, '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')
    assert qwen3.parse_tool_calls(spelled) == ('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>', [])
    broken = encode(tokenizer, "x<tool_call>\n{not json}\n</tool_call><|im_end|>")
    assert qwen3.parse_tool_calls(broken) == ("x<tool_call>\n{not json}\n</tool_call>", [])
    two = encode(
        tokenizer,
        'a\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": {"b": "x"}}\n</tool_call><|im_end|>',
    )
    assert qwen3.parse_tool_calls(two) == ("a", [ToolCall("add", '{"a": 1}'), ToolCall("mul", '{"b": "x"}')])
    plain = encode(tokenizer, "just text<|im_end|>")
    assert qwen3.parse_tool_calls(plain) == ("just text", [])


class OfficialQwen3Thinking(Qwen3ChatFormat):
    """Qwen3's official template's behaviour that is not append-only: the ``<think>`` block of an assistant turn
    before the last user message is dropped."""

    name = "qwen3-official-thinking"

    def render_text(self, messages, *, tools=(), add_generation_prompt):  # type: ignore[override]
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        stripped = [
            ChatMessage(m.role, re.sub(r"<think>.*?</think>\n*", "", m.content, flags=re.S), m.tool_calls)
            if m.role == "assistant" and i < last_user
            else m
            for i, m in enumerate(messages)
        ]
        return super().render_text(stripped, tools=tools, add_generation_prompt=add_generation_prompt)


def test_the_append_only_check_refuses_a_format_that_rewrites_earlier_turns(tokenizer) -> None:
    official = OfficialQwen3Thinking(tokenizer)
    history = [ChatMessage("user", "2+2?"), ChatMessage("assistant", "<think>\nsum\n</think>\n\n4")]
    ids = [*official.render(history[:1]), *encode(tokenizer, "<think>\nsum\n</think>\n\n4<|im_end|>")]
    with pytest.raises(ChatFormatError, match=r"'qwen3-official-thinking' is not append-only.*at token \d+"):
        official.append(ids, [ChatMessage("user", "and 3+3?")], history=history)
    conversation = [*history, ChatMessage("user", "and 3+3?")]
    with pytest.raises(ChatFormatError, match=r"adding messages 2 to 2 \(user last\) changes the first 2 at token"):
        check_append_only(official, conversation)
    qwen3 = Qwen3ChatFormat(tokenizer)
    check_append_only(qwen3, conversation)  # the built-in keeps the think block: append-only
    calls = (ToolCall("add", "{}"), ToolCall("add", "{}"))
    tools_joined = [ChatMessage("user", "x"), ChatMessage("assistant", "", calls), *[ChatMessage("tool", "1")] * 2]
    check_append_only(qwen3, [*tools_joined, ChatMessage("assistant", "2")], tools=[ADD_TOOL])  # appended together


class GenerationPromptMismatch(Qwen3ChatFormat):
    """A generation prompt that the assistant's rendering does not continue (a think block in one, not the other)."""

    name = "qwen3-prompt-mismatch"

    def render_text(self, messages, *, tools=(), add_generation_prompt):  # type: ignore[override]
        text = super().render_text(messages, tools=tools, add_generation_prompt=False)
        return text + ("<|im_start|>assistant\n<think>\n" if add_generation_prompt else "")


def test_the_append_only_check_refuses_a_generation_prompt_the_turn_does_not_continue(tokenizer) -> None:
    conversation = [ChatMessage("user", "hi"), ChatMessage("assistant", "yo")]
    with pytest.raises(ChatFormatError, match="assistant message 1 does not begin after its generation prompt"):
        check_append_only(GenerationPromptMismatch(tokenizer), conversation)


def test_qwen3_needs_its_special_tokens() -> None:
    with pytest.raises(ChatFormatError, match=r"needs '<\|im_start\|>' as one token"):
        Qwen3ChatFormat(letters_tokenizer())


def letters_tokenizer():
    """An HF character tokenizer of letters: neither Qwen3's nor the default's."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        return save_char_tokenizer(directory, "abc")


# -- the embedded default's digit format -------------------------------------------------------------------------

BOS, EOS, COLON = 2, 1, 3
ROLE = {"system": 3, "user": 5, "assistant": 6, "tool": 7}  # the ids of the digits 0, 1, 2, 3


def digits(text: str) -> list[int]:
    return DigitTokenizer().encode(text, add_bos=False)


def test_digit_format_renders_and_appends_exact_ids() -> None:
    fmt = DigitChatFormat(DigitTokenizer())
    prompt = fmt.render([ChatMessage("user", "73915:")])
    assert prompt == [BOS, ROLE["user"], COLON, *digits("73915:"), EOS, BOS, ROLE["assistant"], COLON]
    generated = [*digits("55"), COLON, *digits("0"), COLON, *digits("42"), EOS]
    content, calls = fmt.parse_tool_calls(generated, tools=[CALCULATOR])
    assert (content, calls) == ("55", [ToolCall("calculator", '{"expression": "42"}')])
    assistant = ChatMessage("assistant", content, tool_calls=tuple(calls))
    history = [ChatMessage("user", "73915:"), assistant]
    ids = fmt.append([*prompt, *generated], [ChatMessage("tool", "42")], history=history, tools=[CALCULATOR])
    assert ids == prompt + generated + [BOS, ROLE["tool"], COLON, *digits("42"), EOS, BOS, ROLE["assistant"], COLON]
    cut = digits("555")  # cut at the length limit: closed with <eos>
    assert fmt.append(
        [*prompt, *cut],
        [ChatMessage("user", "1")],
        history=[ChatMessage("user", "73915:"), ChatMessage("assistant", "555")],
    )[len(prompt) + 3 :] == [EOS, BOS, ROLE["user"], COLON, *digits("1"), EOS, BOS, ROLE["assistant"], COLON]
    check_append_only(
        fmt,
        [ChatMessage("user", "1:"), assistant, ChatMessage("tool", "42"), ChatMessage("user", "2")],
        tools=[CALCULATOR],
    )


def test_digit_format_tool_calls_and_refusals() -> None:
    fmt = DigitChatFormat()
    assert fmt.parse_tool_calls([*digits("7:1"), EOS]) == ("7:1", [])  # :K without :A is not a call
    assert fmt.parse_tool_calls(digits(":1:2:0:9")) == (
        "",
        [ToolCall("1", '{"input": "2"}'), ToolCall("0", '{"input": "9"}')],
    )
    assert fmt.parse_tool_calls([BOS, *digits("12"), 0, EOS, *digits("9")]) == (
        "12",
        [],
    )  # specials skipped, <eos> ends
    with pytest.raises(ChatFormatError, match=r"can only write ':0123456789'.*\['a'"):
        fmt.render([ChatMessage("user", "abc")])
    with pytest.raises(ChatFormatError, match="is for the embedded default's digit tokenizer"):
        DigitChatFormat(letters_tokenizer())
    with pytest.raises(ChatFormatError, match="role 'robot'"):
        ChatMessage("robot", "1")


def test_digit_format_reads_the_default_models_hf_tokenizer(tmp_path) -> None:
    import transformers

    DigitTokenizer().save_pretrained(tmp_path)
    fmt = DigitChatFormat(transformers.AutoTokenizer.from_pretrained(tmp_path))
    assert fmt.render([ChatMessage("user", "1")]) == [
        BOS,
        ROLE["user"],
        COLON,
        *digits("1"),
        EOS,
        BOS,
        ROLE["assistant"],
        COLON,
    ]


def test_the_core_registers_its_formats_through_the_hook() -> None:
    manager = MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})
    registry = manager.registries.chat_formats
    assert {"default", "qwen3", "inkling", "hf"} <= set(registry)
    assert manager.registries.provided_by("core")["chat_formats"] == ["default", "hf", "inkling", "qwen3"]
    assert registry["qwen3"].load() is Qwen3ChatFormat
    assert isinstance(registry["default"].load()(DigitTokenizer()), DigitChatFormat)
    assert "provide_chat_formats" in manager.hooks_of("core")


def test_formats_load_from_a_model_directory_and_refuse_another_models_tokenizer(tmp_path, tokenizer) -> None:
    """What the session server's ``--chat-format MODULE:CLASS --model-path DIR`` does: the format, made for the
    tokenizer saved in the model directory (Qwen3's added tokens survive the save); the default format refuses it."""
    save_tiny_llama(tmp_path, vocab_size=len(tokenizer), max_position_embeddings=128)
    tokenizer.save_pretrained(tmp_path)
    fmt = load_chat_format("miles_core.builtin.chat_formats:Qwen3ChatFormat", str(tmp_path))
    conversation = [ChatMessage("user", "add 12"), ChatMessage("assistant", "", (ToolCall("add", '{"a": 12}'),))]
    assert fmt.render(conversation, tools=[ADD_TOOL]) == Qwen3ChatFormat(tokenizer).render(
        conversation, tools=[ADD_TOOL]
    )
    assert model_context_length(str(tmp_path)) == 128
    with pytest.raises(ChatFormatError, match="is for the embedded default's digit tokenizer"):
        load_chat_format("miles_core.builtin.chat_formats:DigitChatFormat", str(tmp_path))
