"""Multi-turn rollouts through the session server against direct engine calls, in one run.

Usage: ``python benchmarks/session_server.py [--sessions 16] [--turns 3] [--instances 2] [--repeats 3]``. Starts a
local engine on the embedded default model and ``--instances`` session servers in front of it (from
``session_server_spec``, through the local worker provider), then runs ``--sessions`` conversations at once, each
``--turns`` turns of 8 new tokens (3 fit the default model's context of 64 tokens; a user message is appended
before every turn after the first), three ways: direct ``/generate`` calls from ids built by the same chat format
in the client (what the rollout would do without a server), through one session server, and through all instances
(sessions spread round-robin). Prints turns/s and the median latency of a turn (medians of the repeats), then the
ratios: the session path's latency over the direct one's, and N instances' turns/s over one's.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from miles_core.builtin.chat_formats import DigitChatFormat
from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import SamplingParams
from miles_core.rollout.sessions.formats import ChatMessage
from miles_core.rollout.sessions.server import session_server_spec
from miles_core.run_setup import default_model
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.specs import CommandWorkerSpec

TOKEN = "bench"
NEW_TOKENS = 8
STARTUP_TIMEOUT_S = 300.0


def engine_spec(model: Path) -> CommandWorkerSpec:
    argv = [sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", str(model)]
    argv += ["--host", "{host}", "--port", "{port}", "--admin-api-key", "{token}"]
    return CommandWorkerSpec(
        name="engine-0", argv=argv, ports=["port"], health_url="http://{host}:{port}/health_generate"
    )


async def direct(engine: EngineClient, turns: int, seed: int, latencies: list[float]) -> None:
    """One conversation by direct ``/generate`` calls, the ids kept token-in-token-out in the client."""
    fmt = DigitChatFormat()
    history = [ChatMessage("user", "1:")]
    ids = fmt.render(history)
    for turn in range(turns):
        started = time.perf_counter()
        if turn:
            new = [ChatMessage("user", "2")]
            ids = fmt.append(ids, new, history=history)
            history += new
        params = SamplingParams(max_new_tokens=NEW_TOKENS, sampling_seed=seed + turn)
        output = await engine.generate_outputs(ids, params)
        ids = [*ids, *output.output_ids]
        history.append(ChatMessage("assistant", fmt.parse_tool_calls(output.output_ids)[0]))
        latencies.append(time.perf_counter() - started)


async def through_session(http: httpx.AsyncClient, url: str, turns: int, seed: int, latencies: list[float]) -> None:
    """One conversation through a session of the server at ``url``, as an agent talks to it."""
    sampling = {"max_tokens": NEW_TOKENS, "seed": seed}
    created = await http.post(
        f"{url}/sessions", json={"sampling": sampling}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    base = created.json()["base_url"]
    messages: list[dict] = [{"role": "user", "content": "1:"}]
    for turn in range(turns):
        started = time.perf_counter()
        if turn:
            messages.append({"role": "user", "content": "2"})
        answer = await http.post(f"{base}/chat/completions", json={"model": "policy", "messages": messages})
        answer.raise_for_status()
        messages.append(answer.json()["choices"][0]["message"])
        latencies.append(time.perf_counter() - started)
    sid = created.json()["session_id"]
    await http.delete(f"{url}/sessions/{sid}", headers={"Authorization": f"Bearer {TOKEN}"})


async def measure(run, sessions: int, turns: int, repeats: int) -> tuple[float, float]:
    """(turns/s, median turn latency in s), medians over ``repeats`` after a warm-up."""
    rates, medians = [], []
    for repeat in range(repeats + 1):
        latencies: list[float] = []
        started = time.perf_counter()
        await asyncio.gather(*(run(index, latencies) for index in range(sessions)))
        if repeat:  # the first is the warm-up
            rates.append(sessions * turns / (time.perf_counter() - started))
            medians.append(statistics.median(latencies))
    return statistics.median(rates), statistics.median(medians)


async def main(sessions: int, turns: int, instances: int, repeats: int) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="miles-session-bench-"))
    model = default_model(run_dir, seed=0)
    provider = LocalWorkerProvider(token=TOKEN, run_dir=run_dir)
    try:
        engine_info = await provider.start(engine_spec(model))
        servers = await asyncio.gather(
            *(
                provider.start(
                    session_server_spec(
                        startup_timeout_s=STARTUP_TIMEOUT_S,
                        name=f"sessions-{i}",
                        engine_url=engine_info.url,
                        model_path=str(model),
                        chat_format="miles_core.builtin.chat_formats:DigitChatFormat",
                    )
                )
                for i in range(instances)
            )
        )
        urls = [info.url for info in servers]
        engine = EngineClient(engine_info.url)
        limits = httpx.Limits(max_connections=4 * sessions, max_keepalive_connections=4 * sessions)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            results = {
                "direct /generate": await measure(
                    lambda i, lat: direct(engine, turns, i * 1000, lat), sessions, turns, repeats
                ),
                "session server x1": await measure(
                    lambda i, lat: through_session(http, urls[0], turns, i * 1000, lat), sessions, turns, repeats
                ),
            }
            if instances > 1:
                results[f"session server x{instances}"] = await measure(
                    lambda i, lat: through_session(http, urls[i % instances], turns, i * 1000, lat),
                    sessions,
                    turns,
                    repeats,
                )
        await engine.aclose()
        for name, (rate, latency) in results.items():
            print(f"{name:24s} {rate:8.1f} turns/s   median turn latency {latency * 1000:7.1f} ms")
        base_rate, base_latency = results["direct /generate"]
        one_rate, one_latency = results["session server x1"]
        line = f"session/direct latency = {one_latency / base_latency:.2f}x, turns/s = {one_rate / base_rate:.2f}x"
        if instances > 1:
            line += f"; x{instances}/x1 turns/s = {results[f'session server x{instances}'][0] / one_rate:.2f}x"
        print(line)
    finally:
        await provider.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3, help="3 turns of 8 tokens fit the default model's 64")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.sessions, args.turns, args.instances, args.repeats))
