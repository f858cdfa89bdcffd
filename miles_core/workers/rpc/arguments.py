"""The strict check of RPC arguments against a method's signature and type hints, shared by server and handle,
and the rebuilding of results from the return hint (:meth:`ArgumentCheck.result`).

Arguments travel as JSON, so each is validated *as the JSON it is*, in pydantic's strict mode: no coercion between
types (``true`` is not an ``int``, ``"5"`` is not an ``int`` and ``1.5`` is not one either), no NaN or infinity,
containers and pydantic models checked element by element, while JSON's own encodings of richer types still count
(an array for a tuple, an object for a pydantic model, a string for an enum or a datetime). The worker's server
runs the check before it accepts a call (a refusal is a 400); a :class:`~miles_core.workers.handle.WorkerHandle`
runs the same check before it sends one (a refusal is an :class:`ArgumentError` there).
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

import pydantic
import pydantic_core

SHOWN_VALUE_CHARS = 200  # how much of a refused value an error message repeats


class ArgumentError(TypeError):
    """Arguments that do not fit a method: the message names the parameter, the expected type and the value."""


class ArgumentCheck:
    """Binds arguments to ``fn``'s signature and checks each against its type hint (unannotated: anything).

    ``skip_self`` drops the first parameter, for a class's function checked on behalf of its instances.
    """

    def __init__(self, name: str, fn: Callable, *, skip_self: bool = False) -> None:
        signature = inspect.signature(fn, eval_str=True)  # resolved hints, so messages show `value: int`
        if skip_self:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        hints = typing.get_type_hints(fn)
        self.name = name
        self.signature = signature
        self._adapters: dict[str, pydantic.TypeAdapter] = {}
        self._expected: dict[str, str] = {}
        for param in signature.parameters.values():
            annotation = hints.get(param.name, Any)
            self._expected[param.name] = type_name(annotation)
            if param.kind is param.VAR_POSITIONAL:
                annotation = tuple[annotation, ...]
            elif param.kind is param.VAR_KEYWORD:
                annotation = dict[str, annotation]
            self._adapters[param.name] = pydantic.TypeAdapter(annotation)
        self._returns = hints.get("return", Any)
        self._result = pydantic.TypeAdapter(self._returns)

    def bind(self, args: typing.Sequence[Any], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        """Bind and check; the bound values are the validated ones (a pydantic model for a model's object)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ArgumentError(f"bad arguments for {self.name}{self.signature}: {exc}") from None
        for name, value in bound.arguments.items():
            bound.arguments[name] = self._check(name, value)
        return bound

    def result(self, value: Any) -> Any:
        """A call's JSON result rebuilt as the method's return type (a dataclass or pydantic model from its object,
        a tuple from its array); a result that does not fit is an :class:`ArgumentError` naming the method."""
        if self._returns is Any:
            return value
        try:
            return self._result.validate_python(value)
        except pydantic.ValidationError as exc:
            problems = "; ".join(_problem("result", error) for error in exc.errors(include_url=False))
            refused = f"{self.name} returned what its hint {type_name(self._returns)} refuses: {problems}"
            raise ArgumentError(refused) from None

    def _check(self, name: str, value: Any) -> Any:
        refused = f"bad argument {name}={short_repr(value)} for {self.name}{self.signature}: "
        refused += f"expected {self._expected[name]}"
        try:
            text = json.dumps(pydantic_core.to_jsonable_python(value), allow_nan=False)  # as RpcClient sends it
        except (TypeError, ValueError) as exc:  # NaN or infinity; from a Python caller, a non-JSON object
            raise ArgumentError(f"{refused}; not strict JSON ({exc}): NaN and infinity are not allowed") from None
        try:
            return self._adapters[name].validate_json(text, strict=True)
        except pydantic.ValidationError as exc:
            problems = "; ".join(_problem(name, error) for error in exc.errors(include_url=False))
            raise ArgumentError(f"{refused}; {problems}") from None


def type_name(annotation: Any) -> str:
    """A type hint as a reader writes it: ``int``, ``list[int]``, ``Optional[int]``, ``Settings``."""
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__qualname__
    return repr(annotation).replace("typing.", "")


def short_repr(value: Any) -> str:
    """``repr(value)``, cut short: an error message never repeats a whole request body."""
    text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else f"{text[:SHOWN_VALUE_CHARS]}... ({len(text)} characters)"


def _problem(name: str, error: Any) -> str:
    where = name + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    return f"{where}: {error['msg']} (got {short_repr(error['input'])})"
