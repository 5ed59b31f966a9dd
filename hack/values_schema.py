"""Generate the PDDeployment part of charts/pdserve/values.schema.json from the CRD.

PDDeployments given in the chart's values (``deployments[].spec``) are checked by Helm at
``helm install``/``template``/``lint`` against ``$defs.PDDeploymentSpec``: the CRD's own
``openAPIV3Schema.properties.spec`` turned into JSON Schema, so a typo such as ``spec.prefil``
fails before anything reaches the API server. The rest of values.schema.json is written by
hand; this rewrites the file with that one definition replaced, in a stable layout (objects and
lists that fit on one line stay on one line). tests/unit/test_chart.py fails when the file is
not what this prints.

OpenAPI to JSON Schema, as the API server reads a structural schema:
- ``x-kubernetes-preserve-unknown-fields`` keeps unknown fields; any other object with
  ``properties`` refuses them (the API server would prune them silently: here they are typos);
- ``x-kubernetes-int-or-string`` is an integer or a string; ``nullable`` adds null;
- CEL rules (``x-kubernetes-validations``) and ``format`` are left to the API server, which
  still refuses the object at install time with the rule's message.

Usage: hack/gen-values-schema [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "pddeployments.pdserve.io.yaml"
SCHEMA = REPO / "charts" / "pdserve" / "values.schema.json"
DEFINITION = "PDDeploymentSpec"
WIDTH = 110
#: Keys the JSON Schema validators of Helm do not need (the API server checks what they mean).
DROPPED = {"format", "nullable"}


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    """The served version's ``spec`` schema as JSON Schema."""
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    converted = convert(version["schema"]["openAPIV3Schema"]["properties"]["spec"])
    return {
        "$comment": f"Generated from {CRD.relative_to(REPO)} by hack/gen-values-schema: do not edit.",
        **converted,
    }


def convert(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in DROPPED:
            continue
        if key == "properties":
            out[key] = {name: convert(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = convert(value)
        elif key in ("anyOf", "oneOf", "allOf"):
            out[key] = [convert(child) for child in value]
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.setdefault("type", ["integer", "string"])
    if node.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    open_ended = node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in node
    if "properties" in node and not open_ended:
        out["additionalProperties"] = False
    return out


def generate(schema: dict[str, Any], crd: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (the values schema) with its PDDeployment spec definition from ``crd``."""
    out = dict(schema)
    out["$defs"] = {**schema.get("$defs", {}), DEFINITION: spec_schema(crd)}
    items = out["properties"]["deployments"]["items"]
    items["properties"]["spec"] = {"$ref": f"#/$defs/{DEFINITION}"}
    return out


def dump(value: Any, indent: int = 0, prefix: int = 0) -> str:
    """JSON with 2-space indents; a value that fits in the line after its key stays on one line."""
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, dict | list) or not value or indent + prefix + len(flat) <= WIDTH:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        lines = []
        for key, child in value.items():
            head = f"{json.dumps(key, ensure_ascii=False)}: "
            lines.append(f"{pad}{head}{dump(child, indent + 2, len(head) + 1)}")
        return "{\n" + ",\n".join(lines) + "\n" + " " * indent + "}"
    lines = [f"{pad}{dump(child, indent + 2, 1)}" for child in value]
    return "[\n" + ",\n".join(lines) + "\n" + " " * indent + "]"


def render(schema_path: Path = SCHEMA, crd_path: Path = CRD) -> str:
    crd = yaml.safe_load(crd_path.read_text(encoding="utf-8"))
    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    return dump(generate(schema, crd)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/gen-values-schema", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if SCHEMA.read_text(encoding="utf-8") != text:
            print(f"{SCHEMA.relative_to(REPO)} is stale: run hack/gen-values-schema", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
