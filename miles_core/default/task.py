"""The embedded default task, *echo-last*: a prompt is a string of digits and a colon, such as ``"73915:"``; the
answer repeats the prompt's last digit, ``"5555"``. The reward is the fraction of the first four answer characters
that equal it, so it is dense (a random policy scores about 0.1) and a tiny transformer learns it by RL in a few
dozen steps: it has to look back past the colon once, then keep repeating what it just wrote.

Training prompts and held-out evaluation prompts are disjoint sets of digit strings drawn with a fixed seed.
"""

from __future__ import annotations

import random
from typing import Any

from miles_core.rollout.prompts import Prompt

ANSWER_LENGTH = 4
PROMPT_DIGITS = 5


def echo_last_reward(*, prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Fraction of the first four response characters equal to the label (the prompt's last digit)."""
    target = str(label)
    return sum(char == target for char in response[:ANSWER_LENGTH]) / ANSWER_LENGTH


def echo_last_prompts(
    *, seed: int = 0, train_size: int = 512, eval_size: int = 64
) -> tuple[list[Prompt], list[Prompt]]:
    """Disjoint train and eval prompt sets."""
    strings = distinct_digit_strings(random.Random(seed), train_size + eval_size)
    prompts = [Prompt(text=f"{digits}:", label=digits[-1], metadata={}) for digits in strings]
    return prompts[:train_size], prompts[train_size:]


def distinct_digit_strings(rng: random.Random, count: int, length: int = PROMPT_DIGITS) -> list[str]:
    """``count`` different strings of ``length`` random digits, in the order ``rng`` draws them."""
    strings: list[str] = []
    seen: set[str] = set()
    while len(strings) < count:
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        if digits not in seen:
            seen.add(digits)
            strings.append(digits)
    return strings
