"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, for every OpenAI-compatible route of
Miles (the local engine's, the session server's). A light module: the session server uses it without importing
the engine (torch)."""

from __future__ import annotations

from typing import Any

import pydantic
from starlette.responses import JSONResponse

from miles_core.http import safe_message

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "service_unavailable",
}
"""The ``type`` of an error answer per status (OpenAI's names where it has them)."""


class OpenAIError(Exception):
    """A refusal in OpenAI's error shape: status, message, and the field it is about (``param``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(safe_message(message))
        self.status, self.param, self.code = status, param, code


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    error = {
        "message": safe_message(message),
        "type": ERROR_TYPES.get(status, "internal_error"),
        "param": param,
        "code": code or str(status),
    }
    return JSONResponse({"error": error}, status_code=status)


def validated_body(model: type[pydantic.BaseModel], body: dict, *, server: str) -> Any:
    """``body`` as ``model``; the first problem is an OpenAI 400 naming its field (and, for an unknown one, the
    fields taken; ``server`` names who refuses it: "the local engine does not implement it")."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            known = ", ".join(sorted(model.model_fields)) if len(error["loc"]) == 1 else "see the OpenAI API"
            message = f"unknown field {param!r:.120}: {server} (fields taken: {known})"
            raise OpenAIError(400, message, param=param, code="unknown_field") from None
        raise OpenAIError(
            400, f"{param or 'body'}: {error['msg']} (got {error.get('input')!r:.100})", param=param
        ) from None
