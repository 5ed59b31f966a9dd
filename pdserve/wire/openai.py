"""OpenAI-style request checks and error bodies.

A client's mistake must get a 4xx with ``{"error": {"message", "type", "code"}}``, never a 500,
from the proxy and from the simulator alike. vLLM's own shape has an integer ``code`` (the HTTP
status) and ``type`` names such as ``BadRequestError``; an error made without a specific code
gets the status as its code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code or self.status, self.param)


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    code: str | int | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def check_generation_request(body: object, endpoint: Endpoint) -> Mapping[str, Any]:
    """Return the body as a mapping, or raise RequestError(400) naming the offending field."""
    if not isinstance(body, Mapping):
        raise RequestError(400, "request body must be a JSON object")
    if endpoint == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestError(400, "'prompt' is required for /v1/completions", param="prompt")
        if not _valid_prompt(prompt):
            raise RequestError(
                400, "'prompt' must be a string, a list of strings or a list of token ids", param="prompt"
            )
    else:
        messages = body.get("messages")
        if messages is None:
            raise RequestError(400, "'messages' is required for /v1/chat/completions", param="messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, Mapping) for m in messages)
        ):
            raise RequestError(400, "'messages' must be a non-empty list of objects", param="messages")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(400, f"'{key}' must be an integer >= 1", param=key)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", param="stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", param="model")
    return body


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
