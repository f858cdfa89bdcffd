"""An example reward server (the ``--reward-url`` protocol): a transformers sequence-classification model, built
from a tiny config with seeded weights (no hub, no download), scores each item's prompt and response; the reward is
the sigmoid of its one logit. The tests run it; it shows what a real reward-model server answers.

    python -m miles_core.testkit.reward_server --port 8000 [--token-env NAME]

It binds 127.0.0.1 only. ``GET /health`` answers ``{"ok": true}``; ``POST /score`` takes ``{"items": [{"prompt",
"response", "label", "metadata"}, ...]}`` and answers ``{"rewards": [...]}``; a refusal is ``{"error": ...}`` with a
4xx status. With a token, a request without ``Authorization: Bearer TOKEN`` is a 401.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import torch
import transformers
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from miles_core.http import BackgroundServer, HttpError, bearer_token_matches, json_error, parse_json_object, read_body
from miles_core.workers.node import LOOPBACK
from miles_core.workers.process import listening_socket

MAX_BODY_BYTES = 16 << 20
MAX_ITEMS = 4096
MAX_TOKENS = 256
VOCAB = 258  # the 256 byte values, a separator and padding


def tiny_reward_model(seed: int = 0) -> transformers.PreTrainedModel:
    """A 2-layer Llama sequence classifier with one label, its weights seeded (the same model in every process)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_TOKENS,
        num_labels=1,
        pad_token_id=VOCAB - 1,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForSequenceClassification(config).eval()


def encode(prompt: str, response: str) -> list[int]:
    """Bytes of the prompt, a separator, bytes of the response: the last :data:`MAX_TOKENS` of them."""
    ids = [*prompt.encode(), 256, *response.encode()]
    return ids[-MAX_TOKENS:]


class RewardModelScorer:
    """Scores items with the model, one padded batch per request."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        self.model = model
        self.lock = asyncio.Lock()  # one forward at a time: torch's CPU threads are shared

    @torch.no_grad()
    def rewards(self, items: list[dict[str, Any]]) -> list[float]:
        rows = [encode(item["prompt"], item["response"]) for item in items]
        width = max(len(row) for row in rows)
        pad = self.model.config.pad_token_id
        ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, 0]
        return torch.sigmoid(logits).tolist()


def checked_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's items, checked against the protocol (a 400 says what is wrong)."""
    items = body.get("items")
    if not isinstance(items, list) or not items:
        raise HttpError(400, 'the body must be {"items": [{"prompt", "response", "label", "metadata"}, ...]}')
    if len(items) > MAX_ITEMS:
        raise HttpError(413, f"{len(items)} items: at most {MAX_ITEMS} per request")
    for index, item in enumerate(items):
        if not (
            isinstance(item, dict) and isinstance(item.get("prompt"), str) and isinstance(item.get("response"), str)
        ):
            raise HttpError(400, f"item {index} must be an object with string prompt and response")
    return items


def make_app(scorer: RewardModelScorer, *, token: str | None) -> Starlette:
    """The server's routes: ``GET /health`` and ``POST /score``."""

    def check_token(request: Request) -> None:
        if token and not bearer_token_matches(request.headers.get("authorization"), token):
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)")

    async def health(request: Request) -> JSONResponse:
        check_token(request)
        return JSONResponse({"ok": True})

    async def score(request: Request) -> JSONResponse:
        check_token(request)
        items = checked_items(parse_json_object(await read_body(request, limit=MAX_BODY_BYTES)))
        async with scorer.lock:
            rewards = await asyncio.to_thread(scorer.rewards, items)
        return JSONResponse({"rewards": rewards})

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HttpError)
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    return Starlette(
        routes=[Route("/health", health, methods=["GET"]), Route("/score", score, methods=["POST"])],
        exception_handlers={HttpError: refused, 404: json_error, 405: json_error},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="An example reward server on 127.0.0.1 (the --reward-url protocol).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-env", help="environment variable holding the bearer token to require")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        print(f"reward server: the environment variable {args.token_env} is not set", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    app = make_app(RewardModelScorer(tiny_reward_model(args.seed)), token=token)
    sock = listening_socket(LOOPBACK, args.port)
    print(f"reward server on http://{LOOPBACK}:{sock.getsockname()[1]}", flush=True)
    BackgroundServer(app, sock, what="the example reward server", thread_name="reward-server").run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
