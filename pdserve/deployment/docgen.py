"""Generate docs/reference.md, the configuration reference, from the CRD's own schema.

The CRD (``crds/pddeployments.pdserve.io.yaml``) is the one place where every field, default,
bound and validation rule is written down; this turns it into a page a person reads, so the
two cannot disagree; every command listed in :data:`COMMANDS` gets its options table from
its own argparse parser the same way. ``--check`` exits 1 when the committed page is stale
(the test suite runs it). Regenerate with ``hack/gen-reference`` or ``python -m pdserve.deployment.docgen``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "pddeployments.pdserve.io.yaml"
REFERENCE_FILE = REPO / "docs" / "reference.md"

_CONSTRAINTS = (
    ("minimum", "≥ {}"),
    ("maximum", "≤ {}"),
    ("minLength", "length ≥ {}"),
    ("maxLength", "length ≤ {}"),
    ("minItems", "items ≥ {}"),
    ("maxItems", "items ≤ {}"),
    ("pattern", "matches `{}`"),
)


@dataclass(frozen=True)
class Field:
    path: str
    schema: Mapping[str, Any]
    required: bool


def walk(schema: Mapping[str, Any], path: str) -> Iterator[Field]:
    """Every field under ``schema`` (depth first, in schema order); list items appear as ``name[]``."""
    required = set(schema.get("required", ()))
    for name, sub in (schema.get("properties") or {}).items():
        here = f"{path}.{name}" if path else name
        yield Field(here, sub, name in required)
        yield from _children(sub, here)


def _children(schema: Mapping[str, Any], path: str) -> Iterator[Field]:
    if schema.get("type") == "array" and isinstance(schema.get("items"), Mapping):
        yield from walk(schema["items"], f"{path}[]")
    elif schema.get("properties"):
        yield from walk(schema, path)


def type_name(schema: Mapping[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items") or {}
        return f"list of {type_name(items)}" if items else "list"
    if kind == "object" or kind is None:
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            return f"map of string to {type_name(extra)}"
        if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
            return "object (free-form)"
        return "object"
    fmt = schema.get("format")
    return f"{kind} ({fmt})" if fmt else str(kind)


def constraints(schema: Mapping[str, Any], required: bool) -> str:
    parts = ["required"] if required else []
    if "enum" in schema:
        parts.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    parts += [template.format(schema[key]) for key, template in _CONSTRAINTS if key in schema]
    return "; ".join(parts)


def default(schema: Mapping[str, Any]) -> str:
    if "default" not in schema:
        return ""
    return f"`{json.dumps(schema['default'])}`"


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, and <name> kept visible outside `code` spans."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _code(text: str) -> str:
    """A code span in a table cell (GFM still needs its pipes escaped)."""
    return "`" + " ".join(str(text).split()).replace("|", "\\|") + "`"


def _table(fields: Sequence[Field]) -> list[str]:
    lines = ["| Field | Type | Default | Constraints | Description |", "|---|---|---|---|---|"]
    for f in fields:
        lines.append(
            f"| `{f.path}` | {_cell(type_name(f.schema))} | {_cell(default(f.schema))} | "
            f"{_cell(constraints(f.schema, f.required))} | {_cell(f.schema.get('description', ''))} |"
        )
    return lines


def _rules(schema: Mapping[str, Any], path: str) -> Iterator[tuple[str, str, str]]:
    for rule in schema.get("x-kubernetes-validations") or ():
        yield path or "(root)", str(rule.get("rule", "")), str(rule.get("message", ""))
    for name, sub in (schema.get("properties") or {}).items():
        here = f"{path}.{name}" if path else name
        yield from _rules(sub, here)
        if sub.get("type") == "array" and isinstance(sub.get("items"), Mapping):
            yield from _rules(sub["items"], f"{here}[]")


def render_reference(crd: Mapping[str, Any], source: str) -> str:
    spec = crd["spec"]
    names = spec["names"]
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from {source} by `python -m pdserve.deployment.docgen`"
        " (hack/gen-reference). Do not edit by hand: tests/unit/test_docs.py fails when it is stale. -->",
        "",
    ]
    for version in spec["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        out += [
            f"## {names['kind']} `{spec['group']}/{version['name']}`",
            "",
            _cell(schema.get("description", "")),
            "",
            f"- Scope: {spec['scope']}; plural `{names['plural']}`"
            + (
                f"; short names {', '.join(f'`{s}`' for s in names.get('shortNames', []))}"
                if names.get("shortNames")
                else ""
            ),
        ]
        scale = (version.get("subresources") or {}).get("scale")
        if scale:
            out.append(
                "- Scale subresource: `kubectl scale pdd NAME --replicas N` sets "
                f"`{scale['specReplicasPath']}`"
                f" (status `{scale['statusReplicasPath']}`, selector `{scale.get('labelSelectorPath', '')}`)"
            )
        if "status" in (version.get("subresources") or {}):
            out.append("- Status subresource: `status` is written by the operator only")
        out.append("")
        columns = version.get("additionalPrinterColumns") or []
        if columns:
            out += [
                "### `kubectl get pdd` columns",
                "",
                "| Column | Shown | Source | Description |",
                "|---|---|---|---|",
            ]
            for col in columns:
                shown = "with `-o wide`" if col.get("priority", 0) > 0 else "always"
                description = _cell(col.get("description", ""))
                out.append(f"| {col['name']} | {shown} | {_code(col['jsonPath'])} | {description} |")
            out.append("")
        props = schema.get("properties", {})
        for section, title in (("spec", "Spec"), ("status", "Status")):
            if section not in props:
                continue
            out += [f"### {title}", "", _cell(props[section].get("description", "")), ""]
            out += _table(list(walk(props[section], section)))
            out.append("")
        rules = list(_rules(schema, ""))
        if rules:
            out += [
                "### Validation rules",
                "",
                "Checked by the API server on create and update (CEL, `x-kubernetes-validations`); "
                "`pdserve up` and `pdserve render` apply the same rules before anything starts.",
                "",
                "| Where | Rule | Message |",
                "|---|---|---|",
            ]
            out += [f"| {_code(where)} | {_code(rule)} | {_cell(msg)} |" for where, rule, msg in rules]
            out.append("")
    out += _vllm_rules()
    out += _shape_rules()
    out += _commands()
    return "\n".join(out).rstrip() + "\n"


#: Commands whose options the page lists, read from their own parsers: (command, module, the
#: function that adds its arguments). Imported by name when the page is generated, as pdserve/cli.py
#: does, so this module depends on no command at import time.
COMMANDS = (
    ("pdserve proxy", "pdserve.proxy.cli", "configure"),
    ("pdserve sim", "pdserve.sim.cli", "configure"),
    ("pdserve up", "pdserve.local.cli", "configure"),
    ("pdserve operator", "pdserve.operator.cli", "configure"),
    ("pdserve render", "pdserve.deployment.cli", "configure"),
    ("pdserve bench replay", "pdserve.loadgen.cli", "configure_replay"),
)


@contextlib.contextmanager
def _environment_unset() -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.update(saved)


def _commands() -> list[str]:
    out = [
        "## Commands",
        "",
        "Options as each command's own parser defines them (`--help` prints the same).",
        "",
    ]
    for command, module_name, function in COMMANDS:
        parser = argparse.ArgumentParser(prog=command, add_help=False)
        configure = getattr(importlib.import_module(module_name), function)
        with _environment_unset():  # the defaults as written, not as this shell's variables set them
            configure(parser)
        out += [f"### `{command}`", ""]
        # argparse's own groups (positionals, options) make one table; a titled group its own
        tables: dict[str, list[argparse.Action]] = {}
        for group in parser._action_groups:
            title = "" if group.title in ("positional arguments", "options") else str(group.title)
            tables.setdefault(title, []).extend(
                a for a in group._group_actions if a.help != argparse.SUPPRESS
            )
        for title, actions in tables.items():
            if not actions:
                continue
            if title:
                out += [f"{title[0].upper()}{title[1:]}:", ""]
            out += ["| Argument | Default | Description |", "|---|---|---|"]
            for action in actions:
                out.append(
                    f"| {_code(_argument(action))} | {_default(action)} | {_cell(_help(action, command))} |"
                )
            out.append("")
    return out


def _help(action: argparse.Action, prog: str) -> str:
    """The help as ``--help`` prints it: argparse expands ``%(default)s`` and the like."""
    return (action.help or "") % {**vars(action), "prog": prog}


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = action.metavar or (
        action.dest.upper() if not action.choices else "{" + ",".join(action.choices) + "}"
    )
    return ", ".join(f"{flag} {metavar}" for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return _code(str(action.default))


def _shape_rules() -> list[str]:
    """How an instance larger than a node is split, and the shapes refused (spec/multinode.py)."""
    from pdserve.deployment.spec.multinode import SHAPE_RULES

    out = [
        "## Multi-node shapes",
        "",
        "With `gpusPerNode` (the spec's, the role's, or the operator's from uniform nodes) an instance of "
        "dataParallel x tensorParallel x pipelineParallel GPUs larger than a node becomes a group of pods: "
        "`gpusPerNode // (tensorParallel x pipelineParallel)` ranks per pod when a rank fits a node, else "
        "`tensorParallel x pipelineParallel / gpusPerNode` pods for its one rank. Refused, by the parser "
        "(`pdserve render`, `pdserve up`), by CEL when gpusPerNode is in the spec, and by the operator "
        "with the nodes' count:",
        "",
        "| Rule | Constraint | Why |",
        "|---|---|---|",
    ]
    out += [f"| `{rule_id}` | {_cell(rule)} | {_cell(why)} |" for rule_id, rule, why in SHAPE_RULES]
    out.append("")
    return out


def _vllm_rules() -> list[str]:
    """The prefill/decode constraints read from vLLM, with where each comes from (spec/vllm_compat.py)."""
    from pdserve import kv
    from pdserve.deployment.spec.vllm_compat import RULES

    out = [
        "## What vLLM accepts between prefill and decode",
        "",
        "Read from the vLLM version pdserve targets (0.32), for engine `vllm`; earlier releases were "
        "stricter. CEL rules are refused by `kubectl apply`; the others make the operator report "
        "`Degraded=True, reason InvalidSpec` (with a Warning Event) and `pdserve render` exit 2.",
        "",
        "| Rule | Fields | Constraint | Enforced by | vLLM source |",
        "|---|---|---|---|---|",
    ]
    for r in RULES:
        out.append(
            f"| `{r.id}` | {_cell(r.where)} | {_cell(r.rule)} | {_cell(r.enforced_by)} | {_cell(r.source)} |"
        )
    unchecked = "; ".join(c.render.unchecked for c in kv.CONNECTORS if c.render.unchecked)
    out += ["", f"Not checked (the model decides, not the spec): {unchecked}.", ""]
    return out


def generate(crd_file: Path = CRD_FILE) -> str:
    crd = yaml.safe_load(crd_file.read_text(encoding="utf-8"))
    try:
        source = str(crd_file.resolve().relative_to(REPO))
    except ValueError:
        source = crd_file.name
    return render_reference(crd, source)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.deployment.docgen", description=__doc__)
    parser.add_argument("--crd", type=Path, default=CRD_FILE, help="CRD file (default: crds/...)")
    parser.add_argument(
        "--output", type=Path, default=REFERENCE_FILE, help="page to write (default: docs/reference.md)"
    )
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if --output is stale")
    args = parser.parse_args(argv)
    text = generate(args.crd)
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale; regenerate it with hack/gen-reference", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
