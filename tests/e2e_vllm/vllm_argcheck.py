"""Parse engine command lines with vLLM's own `vllm serve` parser (run with vLLM's interpreter).

Why: a flag pdserve renders that vLLM does not know, or two flags that set the same option to
different values, would only show when a pod starts on a GPU node. Here the installed vLLM
judges every rendered command, the way `vllm serve` does: the CLI's top-level parser with the
``serve`` subcommand added by ``vllm.entrypoints.cli.serve`` (``make_arg_parser``), then the
subcommand's own ``validate`` (``validate_parsed_serve_args``), then ``EngineArgs.from_cli_args``.
Conflicts are found with vLLM's parser too: its option table maps every spelling of a flag
(``-tp``, ``--tensor-parallel-size``, ``--tensor_parallel_size``) to one destination.

    python vllm_argcheck.py < commands.json > results.json

stdin: ``[{"name": ..., "argv": ["vllm", "serve", ...]}, ...]``; stdout: one
``{"name", "ok", "error"}`` per command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import Any


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, Any]:
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(required=False, dest="subparser")
    (serve,) = cmd_init()
    serve_parser = serve.subparser_init(subparsers)
    return top, serve_parser, serve


def _conflicts(serve_parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """Options given more than once with different values (argparse would keep the last silently)."""
    seen: dict[str, tuple[str, str | None]] = {}
    problems = []
    actions = serve_parser._option_string_actions
    for i, token in enumerate(args):
        if not token.startswith("-") or token == "-":
            continue
        flag, _, inline = token.partition("=")
        action = actions.get(flag) or actions.get(flag.replace("_", "-"))
        if action is None:
            continue
        value: str | None = inline if "=" in token else None
        if value is None and action.nargs != 0 and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        before = seen.get(action.dest)
        if before is not None and before[1] != value:
            problems.append(f"{before[0]} {before[1]!r} and {flag} {value!r} set the same option differently")
        seen[action.dest] = (flag, value)
    return problems


def check(
    argv: list[str], parsers: tuple[argparse.ArgumentParser, argparse.ArgumentParser, Any]
) -> str | None:
    """None when vLLM accepts ``argv`` (``vllm serve ...``), else what it said."""
    from vllm.engine.arg_utils import EngineArgs

    top, serve_parser, serve = parsers
    if argv[:2] != ["vllm", "serve"]:
        return f"not a `vllm serve` command: {argv[:2]}"
    conflicts = _conflicts(serve_parser, argv[2:])
    if conflicts:
        return "; ".join(conflicts)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = top.parse_args(argv[1:])
            serve.validate(args)
            if getattr(args, "model_tag", None) is not None:
                args.model = args.model_tag
            EngineArgs.from_cli_args(args)
    except SystemExit:
        lines = [line.strip() for line in err.getvalue().splitlines() if line.strip()]
        said = [line for line in lines if not line.startswith(("usage:", "For further information"))]
        return " | ".join(said[-4:]) if said else "vllm serve's parser exited"
    except Exception as exc:  # vLLM's own validation (pydantic, ValueError, ...)
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    commands = json.load(sys.stdin)
    parsers = _parser()
    results = []
    for command in commands:
        error = check([str(a) for a in command["argv"]], parsers)
        results.append({"name": command["name"], "ok": error is None, "error": error})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
