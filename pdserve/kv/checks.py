"""What every connector module shares: the two legs' names and flags, and the checks of a field's value."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

#: The two legs of a P/D request, as the routing table's roles name them.
PREFILL = "prefill"
DECODE = "decode"


def remote_flags(leg: str) -> dict[str, bool]:
    """vLLM's two ``kv_transfer_params`` flags that say which side of the transfer ``leg`` is: the
    prefill's KV goes to a remote decode, the decode's comes from a remote prefill."""
    return {"do_remote_decode": leg == PREFILL, "do_remote_prefill": leg == DECODE}


# --- shared checks -------------------------------------------------------------------------------


#: A field of ``kv_transfer_params`` and the test its value must pass.
FieldCheck = tuple[str, Callable[[object], bool]]


def field_problems(params: object, checks: Sequence[FieldCheck]) -> list[str]:
    """The fields of ``params`` whose value fails its check (``["kv_transfer_params"]`` when
    ``params`` is no object at all), in the order of ``checks``."""
    if not isinstance(params, Mapping):
        return ["kv_transfer_params"]
    return [key for key, ok in checks if not ok(params.get(key))]


def is_true(value: object) -> bool:
    return value is True


def nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def is_port(value: object) -> bool:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def block_ids(value: object) -> bool:
    """vLLM sends one list of block ids per KV-cache group; a flat list is accepted too."""
    if not isinstance(value, list):
        return False
    if all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        return True
    return all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in value)


def int_value(value: object) -> int | None:
    """An ``extraConfig`` value as an integer (YAML may give ``"6301"``); None when it is not one."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def last_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` (``--flag v`` or ``--flag=v``), as vLLM's parser keeps the last."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
