"""Agentic multi-turn rollouts: token-in-token-out chat formats and the session server (an OpenAI-compatible chat
endpoint per rollout sample, recording the exact ids, loss mask and logprobs of every turn)."""

from miles_core.rollout.sessions.formats import (
    ChatFormat,
    ChatFormatError,
    ChatMessage,
    DigitChatFormat,
    Qwen3ChatFormat,
    ToolCall,
    check_append_only,
)
from miles_core.rollout.sessions.session import Session, Trajectory, Turn

__all__ = [
    "ChatFormat",
    "ChatFormatError",
    "ChatMessage",
    "DigitChatFormat",
    "Qwen3ChatFormat",
    "Session",
    "ToolCall",
    "Trajectory",
    "Turn",
    "check_append_only",
]
