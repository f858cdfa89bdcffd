"""``miles train`` on a Parquet file of chat prompts with key names of its own: the engine is given exactly the
ids of the tokenizer's chat template."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_core.builtin.dashboard.store import db_path
from miles_core.default.task import distinct_digit_strings
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import ROLE_TAG_CHAT_TEMPLATE, save_char_tokenizer
from tests.conftest import run_miles

pytestmark = pytest.mark.slow

REWARD = """\
import json


def first_char(*, prompt, response, label, metadata):
    with open("seen.jsonl", "a") as out:  # what the reward was given, for the test
        out.write(json.dumps({"prompt": prompt, "label": label, "metadata": metadata}) + "\\n")
    return float(response[:1] == label)
"""


def test_train_on_chat_prompts_with_mapped_keys_gives_the_engine_the_template_s_ids(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model", vocab_size=16)
    tokenizer = save_char_tokenizer(model, "abcsu<>:0123", chat_template=ROLE_TAG_CHAT_TEMPLATE)
    conversations = [
        [{"role": "system", "content": "b"}, {"role": "user", "content": f"{c}{d}:"}] for c in "abc" for d in "0123"
    ]
    table = pa.table(
        {
            "conversation": conversations,
            "answer": [m[1]["content"][0] for m in conversations],
            "topic": [f"t{i % 3}" for i in range(len(conversations))],
            "unused": list(range(len(conversations))),  # a column no key names: ignored
        }
    )
    work = tmp_path / "work"
    work.mkdir()
    pq.write_table(table, work / "chats.parquet")
    (work / "chat_reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    result = run_miles(
        "train",
        "--output-dir",
        str(run_dir),
        "--no-progress",
        "--rollout-batch-size",
        "4",
        "--rollout-group-size",
        "2",
        "--run-eval-every",
        "0",
        "--num-steps",
        "2",
        "--model",
        str(model),
        "--prompts",
        "chats.parquet",
        "--rollout-prompt-key",
        "conversation",
        "--rollout-label-key",
        "answer",
        "--rollout-metadata-keys",
        "topic",
        "--reward",
        "chat_reward:first_char",
        cwd=work,
        env={"HF_DATASETS_CACHE": str(tmp_path / "datasets-cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {}
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected[text] = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    with sqlite3.connect(db_path(run_dir)) as db:
        rows = db.execute("SELECT step, prompt, data FROM samples").fetchall()
    train_rows = [(prompt, json.loads(data)) for step, prompt, data in rows if step >= 1]
    assert len(train_rows) >= 2 * 4 * 2  # every training sample of both steps
    for prompt, data in train_rows:
        assert prompt.startswith("<s>b<u>") and prompt.endswith(":<a>"), prompt
        assert data["prompt_ids"] == expected[prompt], prompt
    seen = [json.loads(line) for line in (work / "seen.jsonl").read_text().splitlines()]
    assert seen and all(s["label"] == s["prompt"][len("<s>b<u>")] for s in seen)
    assert all(set(s["metadata"]) == {"topic"} and s["metadata"]["topic"] in ("t0", "t1", "t2") for s in seen)


MATH_STEPS = 120
MATH_MARGIN = 0.5
"""The held-out reward's rise the chat math run must show: a random policy answers one token of 18 right (greedy: 0.06
measured); 120 steps at the default learning rate on 8 groups of 8 reached 0.91 on the AMX machine (0.06 to 0.16 in
40 steps at lr 0.02, which collapsed onto one digit). Half the rise measured leaves room for other CPUs' rounding."""


def chat_math_rows(digit_strings: list[str]) -> dict[str, list]:
    """The echo-last question as chat prompts of a math data set: the answer is the last digit, checked by
    math-verify; non-default key names (question, final_answer, data_source)."""
    return {
        "question": [[{"role": "user", "content": f"{digits}:"}] for digits in digit_strings],
        "final_answer": [digits[-1] for digits in digit_strings],
        "data_source": ["echo_math"] * len(digit_strings),
    }


def test_a_tiny_chat_model_learns_a_parquet_math_set_of_chat_prompts_with_the_math_reward(tmp_path: Path) -> None:
    """The issue's example: a tiny chat model (its chat template in its tokenizer), a Parquet data set of chat-message
    prompts under non-default keys, ``--reward math`` (math-verify): the held-out reward rises by
    :data:`MATH_MARGIN`, and the prompt ids the engine received are the template's rendering."""
    alphabet = "0123456789:<>ua"
    model = save_tiny_llama(tmp_path / "model", vocab_size=3 + len(alphabet))
    tokenizer = save_char_tokenizer(model, alphabet, chat_template=ROLE_TAG_CHAT_TEMPLATE)
    strings = distinct_digit_strings(random.Random(0), 576)
    work = tmp_path / "work"
    work.mkdir()
    pq.write_table(pa.table(chat_math_rows(strings[:512])), work / "train.parquet")
    pq.write_table(pa.table(chat_math_rows(strings[512:])), work / "eval.parquet")
    run_dir = tmp_path / "run"
    result = run_miles(
        "train", "--output-dir", str(run_dir), "--no-progress", "--model", str(model),
        "--prompts", "train.parquet", "--rollout-eval-prompts", "eval.parquet",
        "--rollout-prompt-key", "question", "--rollout-label-key", "final_answer", "--rollout-metadata-keys",
        "data_source", "--reward", "math", "--rollout-max-new-tokens", "1", "--rollout-batch-size", "8",
        "--rollout-group-size", "8", "--num-steps", str(MATH_STEPS), "--run-eval-every", "0",
        "--run-checkpoint-every", "0",
        cwd=work, env={"HF_DATASETS_CACHE": str(tmp_path / "datasets-cache")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row]
    assert len(evals) == 2 and evals[-1] >= evals[0] + MATH_MARGIN, evals
    with sqlite3.connect(db_path(run_dir)) as db:
        rows = db.execute("SELECT step, prompt, data FROM samples WHERE step >= 1").fetchall()
    assert rows
    for _, prompt, data in rows[:64]:
        digits = prompt.removeprefix("<u>").removesuffix(":<a>")
        messages = chat_math_rows([digits])["question"][0]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert json.loads(data)["prompt_ids"] == list(ids["input_ids"] if not isinstance(ids, list) else ids), prompt
