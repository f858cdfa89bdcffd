"""The built-in verifiable rewards (``--reward math``, ``gsm8k``, ``exact``, ``multiple_choice``, ``f1``,
``format``), registered by the core plugin.

Each is a plain ``fn(*, prompt, response, label, metadata) -> float`` (the contract of
:func:`miles_core.hookspecs.provide_reward_functions`) returning 1.0 or 0.0 (``f1`` a fraction). They run in the
scoring pool's worker threads, which give every call its timeout (``--rollout-reward-timeout-s``): none of them
sets a timeout of its own.
"""

from __future__ import annotations

import collections
import logging
import re
import string
from typing import Any

import math_verify

_MATH_VERIFY_TIMEOUT_WARNING = "Timeout is disabled"


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns on every call made with its timeouts off; ours are off on purpose (its timeouts use
    ``signal.alarm``, which works in the main thread only, and the scoring pool times every call)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_MATH_VERIFY_TIMEOUT_WARNING)


for _name in ("math_verify", "math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text`` whose braces balance, else
    ``None``; a nested ``\\boxed{\\boxed{2}}`` gives ``\\boxed{2}``."""
    found = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for position in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                found = text[start:position]
                break
    return found


def math_reward(*, prompt: str, response: str, label: Any, metadata: dict) -> float:
    """1.0 when the response's answer equals the label mathematically, by ``math_verify.verify``, else 0.0.

    Accepts a label in LaTeX or plain text (``"\\frac{1}{2}"``, ``"$0.5$"``, ``"3"``, ``"x^2+1"``; a number is
    used as its text) and a response whose answer is its last ``\\boxed{...}`` (nested ones included), else
    whatever math-verify extracts as its final answer (``"The answer is $\\frac12$"``). Equal forms count as equal
    (``0.5`` and ``\\frac{1}{2}``, ``10\\%`` and ``0.1``, units such as ``\\text{ cm}`` dropped); an empty or
    unparsable label or answer scores 0.0.
    """
    gold = parse_label(str(label))
    boxed = last_boxed(response)
    answer = math_verify.parse(f"\\boxed{{{boxed}}}" if boxed is not None else response, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return float(math_verify.verify(gold, answer, timeout_seconds=None))


def parse_label(text: str) -> list[Any]:
    """math-verify's parse of ``text`` with its signal-based timeout off (the scoring pool times the call). A bare
    expression (no ``$`` delimiters, no ``\\boxed``) is read inside ``$...$``, as a whole: unanchored, math-verify
    would take ``2\\sqrt{2}`` for ``2``."""
    bare = "$" not in text and "\\boxed" not in text
    parsed = math_verify.parse(f"${text}$", parsing_timeout=None) if bare else []
    return parsed or math_verify.parse(text, parsing_timeout=None)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def gsm8k_reward(*, prompt: str, response: str, label: Any, metadata: dict) -> float:
    """1.0 when the response's final number equals the label's numerically, else 0.0.

    The response's number is the one after its last ``####`` (GSM8K's answer mark), else its last number; the
    label is a number or a string, itself possibly a whole GSM8K solution ending in ``#### 42``. Thousands
    separators are dropped (``1,000`` is 1000), a trailing ``.`` or ``$`` around it does not matter, and
    ``72.0`` equals ``72``.
    """
    expected, answer = final_number(str(label)), final_number(response)
    return float(expected is not None and answer is not None and expected == answer)


def final_number(text: str) -> float | None:
    """The number after the last ``####`` of ``text``, else its last number; commas stripped."""
    _, mark, after = text.rpartition("####")
    for part in (after, text) if mark else (text,):
        numbers = _NUMBER.findall(part)
        if numbers:
            try:
                return float(numbers[-1 if part is text else 0].replace(",", ""))
            except ValueError:
                return None
    return None


def exact_reward(*, prompt: str, response: str, label: Any, metadata: dict) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label (as text, stripped), else 0.0.
    Case and inner whitespace count."""
    return float(label is not None and response.strip() == str(label).strip())


_CHOICE_PATTERNS = (
    re.compile(r"\\boxed\s*\{\s*\(?([A-J])\)?\s*\}"),
    re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\(?\**([A-J])\b", re.IGNORECASE),
    re.compile(r"\(([A-J])\)"),
    re.compile(r"^\s*([A-J])\s*[.):]?\s*$"),
)


def multiple_choice_reward(*, prompt: str, response: str, label: Any, metadata: dict) -> float:
    """1.0 when the letter the response chooses (A to J) is the label's, else 0.0.

    The choice is read from, in this order: the last ``\\boxed{B}``, the last ``Answer: B`` / ``the answer is
    (B)``, the last ``(B)``, or a response that is a letter alone (``"B"``, ``"B."``). The label is a letter
    (``"B"``, ``"(b)"``: case does not matter) or an index 0-9 (0 is A).
    """
    expected = choice_label(label)
    chosen = chosen_letter(response)
    return float(expected is not None and chosen == expected)


def chosen_letter(response: str) -> str | None:
    """The letter A-J a response chooses (see :func:`multiple_choice_reward`), else ``None``."""
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(response)
        if found:
            return found[-1].upper()
    return None


def choice_label(label: Any) -> str | None:
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < 10:
        return "ABCDEFGHIJ"[label]
    text = str(label).strip().strip("()").strip().upper()
    return text if len(text) == 1 and text in "ABCDEFGHIJ" else None


def f1_reward(*, prompt: str, response: str, label: Any, metadata: dict) -> float:
    """SQuAD's token F1 between the response and the label, in [0, 1]; the label is a string or a list of
    acceptable answers (the best F1 counts). Both are normalised as SQuAD does: lower case, punctuation and the
    articles a/an/the dropped, whitespace collapsed. Two empty answers score 1.0, one empty one 0.0."""
    answers = label if isinstance(label, list | tuple) else [label]
    scores = [token_f1(response, str(answer)) for answer in answers if answer is not None]
    return max(scores, default=0.0)


def normalize_answer(text: str) -> list[str]:
    """SQuAD's normalisation, as tokens."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(prediction: str, truth: str) -> float:
    predicted, expected = normalize_answer(prediction), normalize_answer(truth)
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def format_reward(*, prompt: str, response: str, label: Any, metadata: dict) -> float:
    """1.0 when the response gives a final answer in ``\\boxed{...}`` with balanced braces and some content, else
    0.0 (the label is not read). Compose it with a correctness reward: ``--reward math:1.0,format:0.1``."""
    boxed = last_boxed(response)
    return float(boxed is not None and boxed.strip() != "")
