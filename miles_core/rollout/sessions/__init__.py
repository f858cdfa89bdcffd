"""Agentic multi-turn rollouts: the token-in-token-out chat format contract and the session server (an
OpenAI-compatible chat endpoint per rollout sample, recording the exact ids, loss mask and logprobs of every turn);
the built-in formats are in :mod:`miles_core.builtin.chat_formats`."""

from miles_core.rollout.sessions.formats import (
    ChatFormat,
    ChatFormatError,
    ChatMessage,
    ToolCall,
    check_append_only,
)
from miles_core.rollout.sessions.session import Session, Trajectory, Turn

__all__ = [
    "ChatFormat",
    "ChatFormatError",
    "ChatMessage",
    "Session",
    "ToolCall",
    "Trajectory",
    "Turn",
    "check_append_only",
]
