"""OpenAI-style request checks and error bodies, in vLLM's shape.

A client's mistake must get a 4xx with an error body, never a 500, from the proxy and from the
simulator alike. The body is vLLM's ``ErrorResponse``
(``vllm/entrypoints/serve/engine/protocol.py``), so a client sees one shape whether vLLM or
the router refused it::

    {"error": {"message": "...", "type": "BadRequestError", "param": "prompt", "code": 400}}

``code`` is the HTTP status as an integer, ``type`` vLLM's name for it (:func:`error_type`):
one name per status, whatever found the mistake. vLLM itself answers a request that fails its
pydantic schema with the HTTP phrase (``Bad Request``) and a malformed body with
``param: "body.<offset>"``; the simulator reproduces that (pdserve.sim.validation), while the
router answers ``BadRequestError`` for both, names line and column of malformed JSON
(:func:`invalid_json`), and renames the phrase in vLLM's refusals it passes back
(:func:`normalize_error_body`), so its clients see one vocabulary. What the router adds, its
own reason (``no_decode_slot``, ``bad_kv_handoff``, ...), travels in the ``X-PDServe-Error``
header, the log line and the metrics, never as a sixth key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]

#: vLLM's ``error.type`` for the statuses it has an exception class for
#: (``vllm/entrypoints/serve/exception_handling/error_response.py``).
VLLM_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
#: vLLM's ``error.type`` of a request that fails its pydantic schema (the HTTP phrase of 400):
#: what the simulator answers, as vLLM does; never the router.
VALIDATION_ERROR_TYPE = "Bad Request"


def error_type(status: int) -> str:
    """vLLM's name for an error of ``status``: its class name, else the HTTP phrase (as its
    HTTPException handler answers, e.g. ``Method Not Allowed``)."""
    known = VLLM_ERROR_TYPES.get(status)
    if known is not None:
        return known
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


@dataclass(frozen=True)
class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP status to answer with.

    ``reason`` is pdserve's machine-readable cause (header ``X-PDServe-Error`` and logs);
    ``type`` overrides :func:`error_type` (the simulator's ``Bad Request``, as vLLM's).
    """

    status: int
    message: str
    param: str | None = None
    reason: str = "invalid_request"
    type: str | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.type)


def error_body(
    status: int, message: str, param: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    """vLLM's error body: ``message``, ``type``, ``param``, and ``code`` = the status (an integer)."""
    return {
        "error": {"message": message, "type": type_ or error_type(status), "param": param, "code": status}
    }


def invalid_json(exc: ValueError) -> RequestError:
    """The 400 for a body that is not JSON, naming where it breaks (``json`` and ``orjson``
    decode errors carry the line and column; an undecodable byte sequence does not)."""
    line, column = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    where = f" at line {line}, column {column}" if line is not None and column is not None else ""
    problem = getattr(exc, "msg", None) or str(exc)
    return RequestError(400, f"request body is not valid JSON{where}: {problem}", "body", "invalid_json")


def normalize_error_body(body: bytes) -> bytes:
    """A backend's error body with vLLM's class name as ``type`` where vLLM wrote the HTTP
    phrase (``Bad Request`` for a schema error: :data:`VALIDATION_ERROR_TYPE`); anything else,
    or a body that is not vLLM's error, unchanged."""
    try:
        doc = json.loads(body)
        error = doc["error"]
        code = error["code"]
        if error.get("type") != HTTPStatus(code).phrase or code not in VLLM_ERROR_TYPES:
            return body
    except (ValueError, TypeError, KeyError):
        return body
    error["type"] = VLLM_ERROR_TYPES[code]
    return json.dumps(doc, ensure_ascii=False).encode()


def check_generation_request(body: object, endpoint: Endpoint) -> Mapping[str, Any]:
    """Return the body as a mapping, or raise RequestError(400) naming the offending field.

    Status and ``param`` are vLLM's for the same mistake (tests/fixtures/vllm-*/errors/): a
    wrong type or a missing field has ``param`` ``body.<field>``, what vLLM checks itself (no
    prompt, ``max_tokens`` < 1, no message) the parameter's name; ``type`` is always
    ``BadRequestError``.
    """
    if not isinstance(body, Mapping):
        raise _schema("request body must be a JSON object", "body")
    if endpoint == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestError(400, "'prompt' is required for /v1/completions", param="prompt")
        if not _valid_prompt(prompt):
            raise _schema(
                "'prompt' must be a string, a list of strings or a list of token ids", "body.prompt"
            )
    else:
        messages = body.get("messages")
        if messages is None:
            raise _schema("'messages' is required for /v1/chat/completions", "body.messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise _schema("'messages' must be a list of objects", "body.messages")
        if not messages:
            raise RequestError(400, "'messages' must not be empty: at least one message is needed")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _schema(f"'{key}' must be an integer", f"body.{key}")
        if value < 1:
            raise RequestError(400, f"'{key}' must be at least 1, got {value}", param=key)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _schema("'stream' must be true or false", "body.stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _schema("'model' must be a string", "body.model")
    return body


def _schema(message: str, param: str) -> RequestError:
    return RequestError(400, message, param=param)


def _valid_prompt(prompt: object) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return True
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return True
        return all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt)
    return False
