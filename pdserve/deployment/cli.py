"""Print every Kubernetes manifest of a PDDeployment file, without a cluster.

The output is what the operator would create right after the PDDeployment is applied: the
engine and router Services, the router Deployment, the routing ConfigMap (no instances yet) and
one Pod per instance. Objects carry no ownerReference unless the file has metadata.uid.
Exit status 2 when the file is not a valid PDDeployment; the message names the field.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from pdserve.deployment.objects import render_all
from pdserve.deployment.spec import SpecError, load_manifest_file
from pdserve.deployment.validate import problems


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="YAML file holding one PDDeployment")
    parser.add_argument(
        "-o",
        "--output",
        choices=("yaml", "json"),
        default="yaml",
        help="yaml: a '---' separated stream (default); json: a v1 List",
    )


def run(args: argparse.Namespace) -> int:
    try:
        pdd = load_manifest_file(args.file)
    except SpecError as exc:
        print(f"pdserve render: {exc}", file=sys.stderr)
        return 2
    found = problems(pdd, None)
    if found:
        for problem in found:
            print(f"pdserve render: {problem}", file=sys.stderr)
        return 2
    objects = render_all(pdd)
    if args.output == "json":
        doc = {"apiVersion": "v1", "kind": "List", "items": objects}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(to_yaml(objects))
    return 0


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the routing table's JSON) as readable ``|`` blocks."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """A ``---`` separated YAML stream, keys in the builders' order (apiVersion, kind, metadata, ...)."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)
