"""Fault injection for users and CI: kill an engine at a chosen moment of a run and watch the recovery.

    miles train --fault-injection kill_engine@step=3                       # engine-0, as step 3's rollout starts
    miles train --engine-num-engines 2 --fault-injection kill_engine:engine-1@weight_update=4

A fault is ``kill_engine[:CELL]@MOMENT=N`` (``CELL`` defaults to ``engine-0``): ``step=N`` kills the engine as the
rollout of step N starts (its requests fail mid-rollout), ``weight_update=N`` as step N's weight update (to weight
version N) starts. Several are given comma-separated, or as a YAML list (``run.fault_injection``). The engine is
killed with SIGKILL through the run's worker provider, so the health monitor, the retried transfer and the
dashboard see exactly what a crashed engine gives them; the terminal says when each fault fires. The built-in
plugin :class:`~miles_core.builtin.fault_injection.FaultInjectionPlugin` fires them; the recovery tests use the same
option. This module holds the plan (its syntax and checks), which the config reads.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

ACTIONS = ("kill_engine",)
MOMENTS = {"step": "as step {n}'s rollout starts", "weight_update": "as step {n}'s weight update starts"}
_FAULT = re.compile(r"(?P<action>[a-z_]+)(?::(?P<target>[A-Za-z0-9_.-]+))?@(?P<moment>[a-z_]+)=(?P<n>[0-9]{1,9})")
SYNTAX = "ACTION[:ENGINE]@MOMENT=N, like kill_engine@step=3 or kill_engine:engine-1@weight_update=4"


@dataclasses.dataclass(frozen=True)
class PlannedFault:
    """One fault of ``--fault-injection``: ``action`` on ``target`` at ``moment`` ``number``."""

    action: str
    target: str
    moment: str
    number: int

    @classmethod
    def parse(cls, text: str) -> PlannedFault:
        """``kill_engine[:CELL]@step=N`` or ``...@weight_update=N``; anything else is a ``ValueError`` saying the
        form and what is allowed."""
        match = _FAULT.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"fault {text!r:.80} is not of the form {SYNTAX}")
        action, moment, number = match["action"], match["moment"], int(match["n"])
        if action not in ACTIONS:
            raise ValueError(f"fault {text!r}: unknown action {action!r}; actions: {', '.join(ACTIONS)}")
        if moment not in MOMENTS:
            raise ValueError(f"fault {text!r}: unknown moment {moment!r}; moments: {', '.join(MOMENTS)}")
        if number < 1:
            raise ValueError(f"fault {text!r}: steps count from 1")
        return cls(action=action, target=match["target"] or "engine-0", moment=moment, number=number)

    def __str__(self) -> str:
        return f"{self.action}:{self.target}@{self.moment}={self.number}"

    def when(self) -> str:
        return MOMENTS[self.moment].format(n=self.number)


def parse_faults(value: Any) -> Any:
    """``run.fault_injection`` as given: a comma-separated string (the flag) or a list, each entry checked."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, str):
                PlannedFault.parse(entry)
    return value


def check_faults_fit(faults: list[str], *, num_engines: int, num_steps: int) -> list[str]:
    """What in ``faults`` the run cannot do (an engine it does not have, a step it never reaches), one problem each."""
    cells = [f"engine-{index}" for index in range(num_engines)]
    problems = []
    for fault in map(PlannedFault.parse, faults):
        if fault.target not in cells:
            problems.append(f"{fault}: the run has no {fault.target} (its engines: {', '.join(cells)})")
        if fault.number > num_steps:
            problems.append(f"{fault}: the run ends at step {num_steps} (run.num_steps)")
    return problems
