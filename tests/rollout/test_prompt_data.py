"""Prompt data: the file formats, several files and directories, key mapping, chat prompts rendered with the
tokenizer's template, bad rows named by file, row and key, and lazy conversion of large files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import transformers

from miles_core.errors import ConfigError, MilesError
from miles_core.rollout.chat_prompts import ChatRenderer
from miles_core.rollout.prompt_data import PromptKeys, open_prompt_source
from miles_core.rollout.prompt_encoding import PromptEncoder, encode_prompt
from miles_core.rollout.prompt_order import PromptOrder
from miles_core.rollout.prompts import Prompt
from miles_core.run_setup import check_prompts_encode
from miles_core.testkit.tokenizers import ROLE_TAG_CHAT_TEMPLATE, save_char_tokenizer

ROWS = [
    {"prompt": "1:", "label": "1", "metadata": {"i": 0}},
    {"prompt": "22:", "label": "2", "metadata": {"i": 1}},
    {"prompt": "3:", "label": "3", "metadata": {"i": 2}},
]
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789:<>/ ."
BOS_TEMPLATE = "{{ bos_token }}" + ROLE_TAG_CHAT_TEMPLATE
KWARG_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<n>{% endif %}<a>"
)


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` in the format of ``path``'s suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    return path


def source(spec: Any, tmp_path: Path, *, tokenizer: Any = None, keys: PromptKeys | None = None, **chat: Any):
    renderer = ChatRenderer(tokenizer, **chat)
    return open_prompt_source(spec, keys=keys, renderer=renderer, cache_dir=str(tmp_path / "cache"))


def chat_tokenizer(tmp_path: Path, template: str = BOS_TEMPLATE) -> transformers.PreTrainedTokenizerFast:
    """A character tokenizer whose encode adds BOS and whose template writes BOS too: encoding a rendered prompt
    with the special tokens would give two."""
    tokenizer = save_char_tokenizer(tmp_path / "tok", ALPHABET, chat_template=template)
    tokenizer._tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 2)]
    )
    return tokenizer


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".arrow"])
def test_every_format_gives_the_same_prompts(tmp_path: Path, suffix: str) -> None:
    prompts = source(str(write(tmp_path / f"p{suffix}", ROWS)), tmp_path)
    assert list(prompts) == [Prompt(r["prompt"], label=r["label"], metadata=r["metadata"]) for r in ROWS]


def test_an_arrow_ipc_file_is_read_too(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(ROWS)
    with pa.ipc.new_file(tmp_path / "p.arrow", table.schema) as writer:
        writer.write_table(table)
    assert [p.text for p in source(str(tmp_path / "p.arrow"), tmp_path)] == ["1:", "22:", "3:"]


def test_several_files_and_a_directory_are_read_in_order_and_errors_name_the_file_and_its_row(tmp_path: Path) -> None:
    first, second = write(tmp_path / "a.parquet", ROWS[:2]), write(tmp_path / "b.parquet", ROWS[2:])
    assert [p.text for p in source(f"{first},{second}", tmp_path)] == ["1:", "22:", "3:"]
    assert [p.text for p in source([str(second), str(first)], tmp_path)] == ["3:", "1:", "22:"]
    directory = tmp_path / "data"
    directory.mkdir()
    write(directory / "1.jsonl", ROWS[:1])
    write(directory / "2.jsonl", [ROWS[1], {"prompt": ""}])
    (directory / "README.md").write_text("not prompt data")  # not of a supported format: not read
    with pytest.raises(ConfigError) as error:
        source(str(directory), tmp_path)
    assert str(error.value) == f"{directory / '2.jsonl'}:2: key 'prompt' is empty; give it some text"
    write(directory / "2.jsonl", ROWS[1:])
    assert [p.text for p in source(str(directory), tmp_path)] == ["1:", "22:", "3:"]
    write(directory / "3.parquet", ROWS)
    with pytest.raises(ConfigError, match="mixes the formats jsonl, parquet; keep one format per directory"):
        source(str(directory), tmp_path)
    bad = write(tmp_path / "c.parquet", [{"prompt": "4:"}, {"prompt": ""}])
    with pytest.raises(ConfigError) as error:
        source(f"{first},{bad}", tmp_path)
    assert str(error.value) == f"{bad} row 1: key 'prompt' is empty; give it some text"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("p.csv", "is not of a supported format: give a file ending in .jsonl, .json, .parquet, .arrow"),
        ("missing.parquet", "cannot read prompt file"),
        ("", "names no file"),
    ],
)
def test_a_file_that_is_not_prompt_data_is_refused(tmp_path: Path, name: str, expected: str) -> None:
    (tmp_path / "p.csv").write_text("prompt\n1:\n")
    with pytest.raises(ConfigError, match=expected):
        source(str(tmp_path / name) if name else "", tmp_path)


def test_a_corrupt_parquet_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ConfigError) as error:
        source(str(path), tmp_path)
    assert f"prompt file {str(path)!r} cannot be read as Parquet" in str(error.value)
    assert "\n" not in str(error.value)


def test_key_flags_map_columns_and_ignore_the_others(tmp_path: Path) -> None:
    rows = [{"question": "1:", "answer": 1, "source": "gsm", "extra": [1, 2], "metadata": {"k": "v"}}]
    path = write(tmp_path / "p.parquet", rows)
    with pytest.raises(ConfigError) as error:  # the default keys: no prompt column, said first, with the flag
        source(str(path), tmp_path)
    assert str(error.value) == (
        f"{path} row 0: no key 'prompt' (the columns are question, answer, source, extra, metadata); name the prompt "
        "column with --rollout-prompt-key"
    )
    with_prompt = write(tmp_path / "q.parquet", [{"prompt": "1:", **rows[0]}])
    with pytest.raises(ConfigError) as error:  # a prompt column, and one no key names: refused, naming it
        source(str(with_prompt), tmp_path)
    assert str(error.value).startswith(f"{with_prompt} row 0: unknown key 'question'; a prompt has the keys prompt, ")
    keys = PromptKeys.from_config(_Rollout(prompt_key="question", label_key="answer", metadata_keys=["source"]))
    (prompt,) = source(str(path), tmp_path, keys=keys)
    assert prompt == Prompt("1:", label=1, metadata={"k": "v", "source": "gsm"})
    jsonl = write(tmp_path / "p.jsonl", rows)
    assert list(source(str(jsonl), tmp_path, keys=keys)) == [prompt]
    missing = PromptKeys.from_config(_Rollout(prompt_key="question", label_key="solution"))
    for data in (path, jsonl):
        with pytest.raises(ConfigError) as error:
            source(str(data), tmp_path, keys=missing)
        assert str(error.value).startswith(
            f"{data}{' row 0' if data.suffix == '.parquet' else ':1'}: no key 'solution'"
        )


class _Rollout:
    """The key fields of a RolloutSection."""

    def __init__(self, **fields: Any) -> None:
        self.prompt_key = self.label_key = self.tools_key = None
        self.metadata_keys: list[str] = []
        self.__dict__.update(fields)


USER = {"role": "user", "content": "1:"}
BAD_ROWS = {  # rows of one file; the row the error names; what it says
    "empty": ([{"prompt": "1:"}, {"prompt": ""}], 1, "key 'prompt' is empty"),
    "null": ([{"prompt": "1:"}, {"prompt": None}], 1, "key 'prompt' is missing (null)"),
    "a_number": ([{"prompt": 7}], 0, "key 'prompt' is of type int64; a prompt is a string or a list of chat messages"),
    "no_role": ([{"prompt": [{"content": "hi"}]}], 0, "key 'prompt' holds a message without 'role'"),
    "null_role": ([{"prompt": [USER]}, {"prompt": [USER, {"role": None, "content": "x"}]}], 1, "without 'role'"),
    "null_content": ([{"prompt": [USER]}, {"prompt": [{"role": "user", "content": None}]}], 1, "without 'content'"),
    "no_messages": ([{"prompt": [USER]}, {"prompt": []}], 1, "key 'prompt' is an empty list of messages"),
    "metadata_a_string": ([{"prompt": "1:", "metadata": "x"}], 0, "'metadata' must be an object, got string"),
    "unknown_key": (
        [{"prompt": "1:", "lable": None}, {"prompt": "2:", "lable": "1"}],
        1,
        "unknown key 'lable'; a prompt has the",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_ROWS))
def test_a_bad_parquet_row_is_one_line_naming_file_row_and_key(tmp_path: Path, name: str) -> None:
    rows, row, expected = BAD_ROWS[name]
    path = write(tmp_path / "p.parquet", rows)
    with pytest.raises(ConfigError) as error:
        source(str(path), tmp_path, tokenizer=chat_tokenizer(tmp_path))
    message = str(error.value)
    assert message.startswith(f"{path} row {row}: ") and expected in message and "\n" not in message, message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": [{"role": "user"}]}', ":2: key 'prompt' message 0 has no 'content'"),
        ('{"prompt": [{"content": "x"}]}', ":2: key 'prompt' message 0 has no 'role'"),
        ('{"prompt": ["x"]}', ":2: key 'prompt' message 0 is str, not an object"),
        ('{"prompt": {"role": "user"}}', ":2: key 'prompt' is dict; a prompt is a string or a list of chat messages"),
        ('{"prompt": "1:", "tools": {"name": "f"}}', ":2: key 'tools' must be a list of tool definitions, got dict"),
        ('{"prompt": "1:"', ":2 is not valid JSON"),
        ('{"prompt": "1:", "label": NaN}', ":2 is not valid JSON: NaN is not a JSON number"),
    ],
)
def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1:"}\n' + line + "\n")
    with pytest.raises(ConfigError) as error:
        source(str(path), tmp_path)
    assert str(error.value).startswith(f"{path}{expected}") and "\n" not in str(error.value)


# -- chat prompts ---------------------------------------------------------------------------------------------------


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 1 2"}]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_chat_prompt_encodes_to_the_ids_of_apply_chat_template(tmp_path: Path, suffix: str) -> None:
    tokenizer = chat_tokenizer(tmp_path)
    path = write(tmp_path / f"p{suffix}", [{"prompt": MESSAGES, "label": "3"}])
    (prompt,) = source(str(path), tmp_path, tokenizer=tokenizer)
    assert prompt.messages == tuple(MESSAGES) and prompt.label == "3"
    assert prompt.text == "<s><s>be brief<u>add 1 2<a>"  # BOS, then the system message (tagged <s> too)
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict | transformers.BatchEncoding) else expected
    assert encode_prompt(tokenizer, prompt) == list(expected)
    assert expected[0] == tokenizer.bos_token_id  # the template's BOS
    assert tokenizer.encode(prompt.text) == [tokenizer.bos_token_id, *expected]  # what add_special_tokens would do


def test_template_kwargs_and_a_template_file_reach_the_rendering(tmp_path: Path) -> None:
    tokenizer = chat_tokenizer(tmp_path, template=KWARG_TEMPLATE)
    path = write(tmp_path / "p.parquet", [{"prompt": MESSAGES}])
    assert source(str(path), tmp_path, tokenizer=tokenizer)[0].text == "<s>be brief<u>add 1 2<a>"
    quiet = source(str(path), tmp_path, tokenizer=tokenizer, kwargs={"enable_thinking": False})
    assert quiet[0].text == "<s>be brief<u>add 1 2<n><a>"
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}.")
    assert (
        source(str(path), tmp_path, tokenizer=tokenizer, template_file=str(template))[0].text == "[be brief][add 1 2]."
    )


def test_tools_reach_the_template(tmp_path: Path) -> None:
    tokenizer = chat_tokenizer(tmp_path, template="{% for t in tools %}<t>{{ t['name'] }}{% endfor %}<a>")
    path = write(tmp_path / "p.jsonl", [{"prompt": MESSAGES, "tools": [{"name": "add"}]}])
    (prompt,) = source(str(path), tmp_path, tokenizer=tokenizer)
    assert prompt.text == "<t>add<a>" and prompt.tools == ({"name": "add"},)


def test_strings_are_wrapped_as_a_user_message_when_the_template_is_applied(tmp_path: Path) -> None:
    tokenizer = chat_tokenizer(tmp_path)
    path = write(tmp_path / "p.parquet", [{"prompt": "add 1 2"}])
    assert source(str(path), tmp_path, tokenizer=tokenizer)[0] == Prompt("add 1 2")  # auto: strings as they are
    (wrapped,) = source(str(path), tmp_path, tokenizer=tokenizer, apply=True)
    assert wrapped.text == "<s><u>add 1 2<a>" and wrapped.messages == ({"role": "user", "content": "add 1 2"},)
    chat = write(tmp_path / "chat.parquet", [{"prompt": MESSAGES}])
    with pytest.raises(ConfigError, match=rf"^{chat} row 0: key 'prompt' holds chat messages and --rollout-apply-chat"):
        source(str(chat), tmp_path, tokenizer=tokenizer, apply=False)


def test_chat_prompts_without_a_template_are_refused_at_start(tmp_path: Path) -> None:
    plain = save_char_tokenizer(tmp_path / "plain", ALPHABET)
    chat = write(tmp_path / "chat.parquet", [{"prompt": MESSAGES}])
    with pytest.raises(ConfigError, match="holds chat-message prompts, but the tokenizer has no chat template"):
        source(str(chat), tmp_path, tokenizer=plain)
    strings = write(tmp_path / "s.parquet", [{"prompt": "1:"}])
    with pytest.raises(ConfigError, match=r"is to be rendered \(--rollout-apply-chat-template true\), but the token"):
        source(str(strings), tmp_path, tokenizer=plain, apply=True)
    assert source(str(strings), tmp_path, tokenizer=plain)[0] == Prompt("1:")


def test_a_template_that_fails_names_the_row(tmp_path: Path) -> None:
    tokenizer = chat_tokenizer(tmp_path, template="{{ raise_exception('no system messages') }}")
    path = write(tmp_path / "p.parquet", [{"prompt": MESSAGES}])
    prompts = source(str(path), tmp_path, tokenizer=tokenizer)  # rendered when a row is converted
    with pytest.raises(ConfigError, match=rf"^{path} row 0: the chat template cannot render the prompt: .*no system"):
        prompts[0]


# -- scale ----------------------------------------------------------------------------------------------------------


def test_a_large_file_opens_without_converting_its_rows(tmp_path: Path) -> None:
    count = 100_000
    table = pa.table({"prompt": [f"{i}:" for i in range(count)], "label": [str(i % 10) for i in range(count)]})
    pq.write_table(table, tmp_path / "big.parquet")
    prompts = source(str(tmp_path / "big.parquet"), tmp_path)
    assert len(prompts) == count and prompts.conversions == 0
    assert prompts[77_777] == Prompt("77777:", label="7") and prompts[-1].text == f"{count - 1}:"
    order = PromptOrder(len(prompts), seed=3, batch_size=64)
    drawn = [prompts[i] for step in range(5) for i in order.indices(step)]
    assert len(drawn) == 320 and prompts.conversions == 2 + 320


def test_the_prompt_order_is_a_permutation_per_epoch_fixed_by_seed_and_epoch() -> None:
    order = PromptOrder(10, seed=1, batch_size=4)  # 2 steps an epoch
    epoch0 = order.indices(0) + order.indices(1)
    assert sorted(epoch0) == sorted(set(epoch0)) and len(epoch0) == 8
    assert order.indices(2) + order.indices(3) != epoch0  # another epoch, another order
    again = PromptOrder(10, seed=1, batch_size=4)
    assert [again.indices(s) for s in (3, 0, 1)] == [order.indices(s) for s in (3, 0, 1)]
    assert PromptOrder(10, seed=2, batch_size=4).indices(0) != order.indices(0)
    assert PromptOrder(3, seed=1, batch_size=4).indices(0)[3] == PromptOrder(3, seed=1, batch_size=4).indices(0)[0]


def test_prompts_beyond_the_checked_prefix_are_checked_when_encoded(tmp_path: Path) -> None:
    rows = [{"prompt": "1:"}] * 2000 + [{"prompt": "1" * 100}]
    path = write(tmp_path / "p.parquet", rows)
    prompts = source(str(path), tmp_path)
    tokenizer = save_char_tokenizer(tmp_path / "tok", ALPHABET)
    encoder = PromptEncoder(tokenizer, context=32, max_new_tokens=8)
    checked = check_prompts_encode(tokenizer, {"train": prompts}, model_path=None, max_new_tokens=8)
    assert prompts.conversions == 1024 and isinstance(checked, PromptEncoder)
    with pytest.raises(MilesError, match=rf"train prompt 2000 \('1111.*', {path} row 2000\) to 100 token ids"):
        encoder.ids(prompts[2000], where="train prompt 2000")
