"""The built-in verifiable rewards, each on a table of answers and labels."""

from __future__ import annotations

import math_verify
import pytest

from miles_core.builtin import rewards

# (label, response, verdict): the verdict a reader gives the response's final answer; math-verify's own verdict
# and the math reward must both give it.
MATH_CASES = [
    ("\\frac{1}{2}", "The answer is \\boxed{\\frac{1}{2}}.", True),
    ("\\frac{1}{2}", "So we get \\boxed{0.5}", True),
    ("\\frac{1}{2}", "\\boxed{\\frac12}", True),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}", True),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
    ("0.5", "\\boxed{1/2}", True),
    ("3", "\\boxed{3}", True),
    ("3", "\\boxed{4}", False),
    ("3", "We have $x = 3$, so the answer is $\\boxed{3}$", True),
    ("-7", "\\boxed{-7}", True),
    ("-7", "\\boxed{7}", False),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", True),
    ("2\\sqrt{2}", "\\boxed{2.828}", False),
    ("x^2+1", "\\boxed{1 + x^2}", True),
    ("x^2+1", "\\boxed{x^2 - 1}", False),
    ("\\pi", "\\boxed{\\pi}", True),
    ("\\pi", "\\boxed{3.14}", False),
    ("10\\%", "\\boxed{10\\%}", True),
    ("10", "\\boxed{10\\text{ cm}}", True),
    ("5", "\\boxed{5 \\text{ meters}}", True),
    ("(1, 2)", "\\boxed{(1,2)}", True),
    ("(1, 2)", "\\boxed{(2,1)}", False),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", True),
    ("[0, 1)", "\\boxed{[0,1)}", True),
    ("[0, 1)", "\\boxed{(0,1]}", False),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt3}{2}}", True),
    ("1000", "\\boxed{1,000}", True),
    ("1000", "\\boxed{1000.0}", True),
    ("12", "First \\boxed{10}, corrected: \\boxed{12}", True),
    ("12", "First \\boxed{12}, corrected: \\boxed{10}", False),
    ("4", "\\boxed{\\boxed{4}}", True),
    ("4", "\\boxed{2+\\boxed{2}}", False),
    ("e", "\\boxed{e}", True),
    ("\\infty", "\\boxed{\\infty}", True),
    ("3", "I think it is 3", True),
    ("3", "no answer here", False),
    ("", "\\boxed{3}", False),
]


def math_verify_verdict(label: str, response: str) -> bool:
    """math-verify's own verdict on the last boxed answer (or the whole response), its timeouts off."""
    boxed = rewards.last_boxed(response)
    target = f"\\boxed{{{boxed}}}" if boxed is not None else response
    gold = math_verify.parse(f"${label}$", parsing_timeout=None)
    answer = math_verify.parse(target, parsing_timeout=None)
    return bool(gold and answer and math_verify.verify(gold, answer, timeout_seconds=None))


@pytest.mark.parametrize(("label", "response", "verdict"), MATH_CASES)
def test_math_agrees_with_math_verify(label: str, response: str, verdict: bool) -> None:
    assert math_verify_verdict(label, response) is verdict  # math-verify itself, on the final answer
    assert rewards.math_reward(prompt="", response=response, label=label, metadata={}) == float(verdict)


def test_math_table_has_both_verdicts() -> None:
    verdicts = [verdict for _, _, verdict in MATH_CASES]
    assert len(MATH_CASES) >= 30 and sum(verdicts) >= 12 and len(verdicts) - sum(verdicts) >= 8


@pytest.mark.parametrize(
    ("label", "response", "expected"),
    [
        ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
        ("\\frac{1}{2}", "\\boxed{0.6}", 0.0),
        ("12", "First \\boxed{12}, corrected: \\boxed{10}", 0.0),  # the last boxed answer counts
        ("4", "\\boxed{\\boxed{4}}", 1.0),
        (3, "\\boxed{3}", 1.0),  # a number label
    ],
)
def test_math_known_verdicts(label: object, response: str, expected: float) -> None:
    assert rewards.math_reward(prompt="", response=response, label=label, metadata={}) == expected


@pytest.mark.parametrize(
    ("label", "response", "expected"),
    [
        ("72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
        ("72", "#### 72.0", 1.0),
        (72, "The answer is 72.", 1.0),
        ("1000", "#### 1,000", 1.0),
        ("1,000", "so $1,000.", 1.0),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "#### 72", 1.0),
        ("72", "#### 71", 0.0),
        ("72", "72 is wrong, it is 73", 0.0),
        ("72", "#### 72 then 5", 1.0),  # the number right after the mark
        ("-3", "#### -3", 1.0),
        ("0.5", "it is .5", 1.0),
        ("72", "no number", 0.0),
        ("seventy", "#### 70", 0.0),
    ],
)
def test_gsm8k(label: object, response: str, expected: float) -> None:
    assert rewards.gsm8k_reward(prompt="", response=response, label=label, metadata={}) == expected


@pytest.mark.parametrize(
    ("label", "response", "expected"),
    [
        ("Paris", "Paris", 1.0),
        ("Paris", "  Paris\n", 1.0),
        ("Paris", "paris", 0.0),
        ("New York", "New  York", 0.0),
        (3, "3", 1.0),
        (None, "", 0.0),
        ("Paris", "Paris.", 0.0),
    ],
)
def test_exact(label: object, response: str, expected: float) -> None:
    assert rewards.exact_reward(prompt="", response=response, label=label, metadata={}) == expected


@pytest.mark.parametrize(
    ("label", "response", "expected"),
    [
        ("B", "(B)", 1.0),
        ("B", "The answer is (B).", 1.0),
        ("B", "Answer: B", 1.0),
        ("b", "answer: b", 1.0),
        ("(C)", "\\boxed{C}", 1.0),
        ("B", "\\boxed{(B)}", 1.0),
        ("B", "B", 1.0),
        ("B", "B.", 1.0),
        (1, "Answer: B", 1.0),
        ("J", "Answer: J", 1.0),
        ("B", "(A) looks wrong, (B) too, so (C)", 0.0),
        ("C", "(A) looks wrong, (B) too, so (C)", 1.0),
        ("B", "Answer: A", 0.0),
        ("B", "I cannot tell", 0.0),
        ("K", "Answer: K", 0.0),  # beyond A-J
        ("B", "Answer: B, final: \\boxed{D}", 0.0),  # the boxed choice wins
    ],
)
def test_multiple_choice(label: object, response: str, expected: float) -> None:
    assert rewards.multiple_choice_reward(prompt="", response=response, label=label, metadata={}) == expected


@pytest.mark.parametrize(
    ("label", "response", "expected"),
    [
        ("Denver Broncos", "The Denver Broncos!", 1.0),
        ("Denver Broncos", "Broncos", 2 * (1.0 * 0.5) / 1.5),
        (["Broncos", "Denver Broncos"], "Broncos", 1.0),
        (["Carolina", "Denver Broncos"], "the Denver team", 2 * (0.5 * 0.5) / 1.0),
        ("Denver Broncos", "Carolina Panthers", 0.0),
        ("", "", 1.0),
        ("the", "", 1.0),  # both empty once articles are dropped
        ("Paris", "", 0.0),
        ([], "Paris", 0.0),
    ],
)
def test_f1(label: object, response: str, expected: float) -> None:
    assert rewards.f1_reward(prompt="", response=response, label=label, metadata={}) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so \\boxed{42}", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),
        ("\\boxed{\\boxed{2}}", 1.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{\\frac{1}{2}", 0.0),  # unbalanced
        ("the answer is 42", 0.0),
        ("\\boxed 42", 0.0),
    ],
)
def test_format(response: str, expected: float) -> None:
    assert rewards.format_reward(prompt="", response=response, label=None, metadata={}) == expected
