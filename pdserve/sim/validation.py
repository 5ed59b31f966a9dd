"""How vLLM 0.32 refuses a bad generation request, reproduced for the simulator.

Why not the router's checks (pdserve.wire.openai): the simulator stands in for vLLM, so a test
of the router against it must see vLLM's answers, not the router's own, or a disagreement
between the two could never fail a test. The recorded answers are in
tests/fixtures/vllm-0.32.0/errors/ and tests/unit/test_vllm_fixtures.py holds this module to
them. Two kinds, as vLLM has:

* schema errors, from pydantic in lax mode (``"5"`` is a fine integer, ``"yes"`` a fine
  boolean): 400, type ``Bad Request``, ``param`` the first error's ``body.<field>``, and a
  message listing every error (``1 validation error:\\n  {'type': 'int_parsing', ...}``);
* vLLM's own checks after that: 400 ``BadRequestError`` naming the parameter (no prompt,
  ``max_tokens`` < 1, an empty conversation, a prompt longer than the context) and 404
  ``NotFoundError`` for another model's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pdserve.wire.openai import VALIDATION_ERROR_TYPE, RequestError

Endpoint = Literal["completions", "chat"]
Problem = dict[str, Any]

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _parsed(text: str, convert: Callable[[str], object], problem: tuple[str, str]) -> tuple[str, str] | None:
    """Lax mode takes a number in a string when it parses, white space around it allowed."""
    try:
        convert(text.strip())
    except ValueError:
        return problem
    return None


def _int(value: object) -> tuple[str, str] | None:
    if isinstance(value, int):  # bool too: pydantic takes True as 1
        return None
    if isinstance(value, float):
        return None if value.is_integer() else ("int_from_float", "got a number with a fractional part")
    if isinstance(value, str):
        return _parsed(value, int, ("int_parsing", "unable to parse string as an integer"))
    return "int_type", ""


def _float(value: object) -> tuple[str, str] | None:
    if isinstance(value, int | float):
        return None
    if isinstance(value, str):
        return _parsed(value, float, ("float_parsing", "unable to parse string as a number"))
    return "float_type", ""


def _bool(value: object) -> tuple[str, str] | None:
    if isinstance(value, bool) or value in (0, 1):
        return None
    if isinstance(value, str):
        return (
            None if value.strip().lower() in _TRUE | _FALSE else ("bool_parsing", "unable to interpret input")
        )
    return "bool_type", ""


def _str(value: object) -> tuple[str, str] | None:
    return None if isinstance(value, str) else ("string_type", "")


def _list(value: object) -> tuple[str, str] | None:
    return None if isinstance(value, list) else ("list_type", "")


def _dict(value: object) -> tuple[str, str] | None:
    return None if isinstance(value, Mapping) else ("dict_type", "")


_KINDS: dict[Callable[[object], tuple[str, str] | None], str] = {
    _int: "a valid integer",
    _float: "a valid number",
    _bool: "a valid boolean",
    _str: "a valid string",
    _list: "a valid list",
    _dict: "a valid dictionary",
}
_COMMON = {
    "model": _str,
    "max_tokens": _int,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "n": _int,
    "seed": _int,
    "stream": _bool,
    "stream_options": _dict,
    "ignore_eos": _bool,
    "min_tokens": _int,
    "presence_penalty": _float,
    "frequency_penalty": _float,
    "repetition_penalty": _float,
    "kv_transfer_params": _dict,
}
FIELDS: dict[Endpoint, dict[str, Callable[[object], tuple[str, str] | None]]] = {
    "completions": {**_COMMON, "echo": _bool, "logprobs": _int},
    "chat": {
        **_COMMON,
        "messages": _list,
        "max_completion_tokens": _int,
        "logprobs": _bool,
        "top_logprobs": _int,
    },
}
REQUIRED: dict[Endpoint, tuple[str, ...]] = {"completions": (), "chat": ("messages",)}


def _input(value: object) -> str:
    """How vLLM shows the offending input: containers summarised, the rest as text."""
    if isinstance(value, Mapping):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def _schema_error(problems: list[Problem]) -> RequestError:
    count = len(problems)
    lines = "".join(f"  {p}\n" for p in problems).rstrip()
    message = f"{count} validation error{'s' if count != 1 else ''}:\n{lines}"
    return RequestError(400, message, param=str(problems[0]["loc"]), type=VALIDATION_ERROR_TYPE)


def parse_body(raw: bytes) -> Any:
    """The JSON body, or vLLM's 400 for one that is not JSON (``loc`` ``body.<offset>``)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        problem = {
            "type": "json_invalid",
            "loc": f"body.{exc.pos}",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
            "ctx": {"error": exc.msg},
        }
        raise _schema_error([problem]) from None
    except UnicodeDecodeError:
        problem = {
            "type": "json_invalid",
            "loc": "body",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
        }
        raise _schema_error([problem]) from None


def check_schema(body: object, endpoint: Endpoint) -> Mapping[str, Any]:
    """pydantic's part: the body is an object, required fields are there, known fields have their type."""
    if not isinstance(body, Mapping):
        problem = {
            "type": "model_attributes_type",
            "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": _input(body),
        }
        raise _schema_error([problem])
    problems: list[Problem] = []
    for name in REQUIRED[endpoint]:
        if name not in body:
            problems.append(
                {"type": "missing", "loc": f"body.{name}", "msg": "Field required", "input": _input(body)}
            )
    for name, checker in FIELDS[endpoint].items():
        value = body.get(name)
        if value is None:
            continue
        found = checker(value)
        if found is not None:
            kind, detail = found
            msg = f"Input should be {_KINDS[checker]}" + (f", {detail}" if detail else "")
            problems.append({"type": kind, "loc": f"body.{name}", "msg": msg, "input": _input(value)})
    if problems:
        raise _schema_error(problems)
    return body


def check_request(
    body: Mapping[str, Any], endpoint: Endpoint, model: str, max_model_len: int, prompt_tokens: int
) -> None:
    """vLLM's own checks, after the schema's: model, prompt, max_tokens, context length."""
    asked = body.get("model")
    if asked is not None and asked != model:
        raise RequestError(404, f"The model `{asked}` does not exist. Valid aliases: {model}.", param="model")
    if endpoint == "completions":
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise RequestError(
                400,
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                param="prompt",
            )
    elif not body["messages"]:
        raise RequestError(
            400, "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and int(value) < 1:
            raise RequestError(
                400,
                f"{name} must be at least 1, got {int(value)}. (parameter={name}, value={int(value)})",
                param=name,
            )
    if prompt_tokens > max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains at least {prompt_tokens} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={prompt_tokens})",
            param="input_tokens",
        )
