"""Bad prompt data and bad reward input through ``miles train`` as a user types it: each one line on stderr that
names the file, the row or the key (or the flag), a failing exit status, and no worker started."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_core.workers.node import LOOPBACK
from miles_core.workers.process import free_ports
from tests.conftest import run_miles

QUICK = ["--no-progress", "--rollout-batch-size", "2", "--rollout-group-size", "2", "--run-eval-every", "0"]


def parquet(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def no_prompt_key(work: Path) -> tuple[list[str], str]:
    path = parquet(work / "math.parquet", {"question": ["1+1"], "answer": ["2"]})
    return ["--prompts", str(path)], (
        f"{path} row 0: no key 'prompt' (the columns are question, answer); name the prompt column with "
        "--rollout-prompt-key"
    )


def a_number_as_prompt(work: Path) -> tuple[list[str], str]:
    path = parquet(work / "numbers.parquet", {"question": [7, 8]})
    flags = ["--prompts", str(path), "--rollout-prompt-key", "question"]
    return flags, f"{path} row 0: key 'question' is of type int64; a prompt is a string or a list of chat messages"


def a_message_without_role(work: Path) -> tuple[list[str], str]:
    path = jsonl(work / "chats.jsonl", [{"prompt": "1:"}, {"prompt": [{"content": "hi"}]}])
    return ["--prompts", str(path)], f"{path}:2: key 'prompt' message 0 has no 'role'"


def a_chat_template_the_tokenizer_lacks(work: Path) -> tuple[list[str], str]:
    path = jsonl(work / "strings.jsonl", [{"prompt": "1:"}])
    flags = ["--prompts", str(path), "--rollout-apply-chat-template", "true"]
    return flags, "but the tokenizer has no chat template"


def an_unknown_reward(work: Path) -> tuple[list[str], str]:
    return ["--reward", "math:1.0,fromat:0.1"], "unknown reward function 'fromat'; available: "


def a_bad_weight(work: Path) -> tuple[list[str], str]:
    return ["--reward", "math:1.0x"], "the weight '1.0x' of 'math' is not a number"


def an_unreachable_reward_url(work: Path) -> tuple[list[str], str]:
    (port,) = free_ports(1, LOOPBACK)  # nothing listens on it: connecting is refused
    url = f"http://{LOOPBACK}:{port}"
    flags = ["--reward-url", url, "--reward", "remote", "--rollout-reward-url-timeout-s", "2"]
    return flags, f"the reward server --reward-url {url} cannot be reached ("


BAD_INPUT: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    case.__name__: case
    for case in (
        no_prompt_key,
        a_number_as_prompt,
        a_message_without_role,
        a_chat_template_the_tokenizer_lacks,
        an_unknown_reward,
        a_bad_weight,
        an_unreachable_reward_url,
    )
}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_data_or_reward_input_is_one_line_before_any_worker_starts(tmp_path: Path, name: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    flags, expected = BAD_INPUT[name](work)
    run_dir = tmp_path / "run"
    result = run_miles("train", "--output-dir", str(run_dir), *QUICK, *flags, cwd=work, timeout_s=120)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
    assert not (run_dir / "logs").exists()  # no worker was started (each writes its log there)
