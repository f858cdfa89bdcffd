"""``--run-schedule fully_async --rollout-partial true`` on real SGLang behind the real sglang-router: generation runs
through every weight update (the engines paused with ``abort`` for the swap alone), each cut request comes back
through the router with its tokens and continues under the new weights, and every sample's tokens are accounted for
with the version each was generated under. Where real SGLang cannot run, the test skips saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_miles
from tests.sglang.real_sglang import requires_real_sglang, sglang_python

pytestmark = [pytest.mark.slow, requires_real_sglang]

RECORDER = """\
import json

from miles_core import hookimpl


@hookimpl
def on_samples(rollout_id, step, samples):
    rows = [
        [[0 if v is None else v for v, _ in s.segments], [n for _, n in s.segments], len(s.response_ids),
         len(s.logprobs), s.finish_reason]
        for s in samples
    ]
    print("SAMPLES", step, json.dumps(rows), flush=True)
"""


def test_fully_async_partial_rollouts_through_the_router(tmp_path: Path) -> None:
    plugin = tmp_path / "recorder.py"
    plugin.write_text(RECORDER)
    run_dir = tmp_path / "run"
    result = run_miles(
        "train",
        "--engine",
        "sglang",
        "--sglang-python",
        sglang_python(),
        "--sglang-router",
        "true",
        "--update-weight-transfer-mode",
        "broadcast",
        "--run-schedule",
        "fully_async",
        "--rollout-partial",
        "true",
        "--rollout-max-new-tokens",
        "24",
        "--rollout-batch-size",
        "4",
        "--rollout-group-size",
        "4",
        "--num-steps",
        "8",
        "--run-eval-every",
        "0",
        "--run-checkpoint-every",
        "0",
        "--no-progress",
        "--output-dir",
        str(run_dir),
        "--plugin",
        str(plugin),
        timeout_s=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split(" ", 2) for line in result.stdout.splitlines() if line.startswith("SAMPLES ")]
    assert [int(step) for _, step, _ in rows] == list(range(1, 9))
    continued = 0
    for _, step, data in rows:
        samples = json.loads(data)
        assert len(samples) == 16
        for versions, counts, tokens, logprobs, finish in samples:
            assert sum(counts) == tokens == logprobs, (versions, counts, tokens, logprobs)
            assert versions == sorted(set(versions)) and versions[-1] <= int(step) - 1
            assert finish in ("stop", "length")
            continued += len(versions) > 1
    assert continued > 0  # SGLang's abort answers carry their tokens and logprobs, and those requests continued
