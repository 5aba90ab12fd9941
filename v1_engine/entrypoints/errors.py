"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through `error_response`, so the shape is the same whether
the request failed in pydantic validation, in SamplingParams.verify(), or in the engine. The
exception handlers are installed by `install_error_handlers`; FastAPI's default 422 body never
reaches a client.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
}


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in a handler and rendered by the server."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(
    message: str, status: HTTPStatus, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    err_type = _TYPE_BY_STATUS.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.message, error.status, error.param, error.code)
    return JSONResponse(body, status_code=int(error.status))


def sse_error(error: APIError) -> str:
    """The same body as one server-sent event, for failures after a stream has started."""
    body = error_body(error.message, error.status, error.param, error.code)
    return f"data: {json.dumps(body)}\n\n"


_LEADING_FIELD = re.compile(r"^([a-z_]+)((?:\.[a-z_0-9]+)*) ")


def from_value_error(error: ValueError, known_fields: set[str]) -> APIError:
    """A ValueError from SamplingParams.verify() or the engine names its field first (a field
    of the request, or a path into one: `response_format.json_schema.schema`); keep it."""
    message = str(error)
    match = _LEADING_FIELD.match(message)
    param = match.group(1) + match.group(2) if match and match.group(1) in known_fields else None
    return APIError(message, HTTPStatus.BAD_REQUEST, param=param)


def validation_error(exc: RequestValidationError) -> APIError:
    """Map pydantic's error list to one message naming every bad field."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (detail.get("ctx") or {}).get("error", "invalid JSON")
        return APIError(f"malformed JSON body: {reason}", code="invalid_json")
    parts, first_param = [], None
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        # Union members appear as extra loc entries (e.g. "str", "list[int]"); keep field paths.
        field = ".".join(p for p in loc if not _is_type_tag(p)) or "body"
        first_param = first_param or field
        if e.get("type") == "extra_forbidden":
            parts.append(f"{field}: unknown field")
        else:
            parts.append(f"{field}: {e.get('msg', 'invalid value')}")
    unique = list(dict.fromkeys(parts))
    return APIError("; ".join(unique), param=first_param, code="invalid_value")


def _is_type_tag(part: str) -> bool:
    return any(c in part for c in "[]()") or part in {"str", "int", "float", "bool", "list"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else status.phrase
        return error_response(APIError(message, status))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler")
        return error_response(
            APIError(f"internal error: {type(exc).__name__}", HTTPStatus.INTERNAL_SERVER_ERROR)
        )
