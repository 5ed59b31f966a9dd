"""Print every Kubernetes manifest of a PDDeployment file, without a cluster.

The output is what the operator would create right after the PDDeployment is applied: the
engine and router Services, the router Deployment, the routing ConfigMap (no instances yet) and
one Pod per instance; a role larger than the file's gpusPerNode gets a group of Pods per instance
(their workers find the leader by its DNS name), or with spec.multiNode.backend lws one
LeaderWorkerSet per instance. Objects carry no ownerReference unless the file has metadata.uid.
Exit status 2 when the file is not a valid PDDeployment; the message names the field.

`pdserve render sidecar FILE` prints instead what an application pod needs to run the router
next to itself against that PDDeployment (a client-side sidecar; docs/operations.md): a patch
for the application's Deployment (the `router` container on 127.0.0.1:--port, its token volume,
the ServiceAccount) and the RBAC (the ServiceAccount, a Role reading NAME-routing, a
RoleBinding). Apply the patch with `kubectl patch deployment APP --patch-file FILE` and the rest
with `kubectl apply -f` (`--part pod` / `--part rbac` print one of them).

Examples:
  pdserve render examples/sim/quickstart.yaml
  pdserve render sidecar examples/sim/quickstart.yaml --service-account my-app --part rbac \\
    | kubectl apply -f -
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from pdserve.deployment.render.client_sidecar import client_pod_patch, client_rbac
from pdserve.deployment.render.decode_sidecar import SIDECAR_PORT
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.spec.pddeployment import SpecError, load_manifest_file
from pdserve.deployment.validate import problems


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "what",
        metavar="sidecar",
        nargs="?",
        choices=("sidecar",),
        help="print what a client application's pod needs to run the router next to itself",
    )
    parser.add_argument("file", metavar="FILE", help="YAML file holding one PDDeployment")
    sidecar = parser.add_argument_group("with `sidecar`")
    sidecar.add_argument(
        "--service-account",
        default=None,
        help="the application's ServiceAccount, granted read access to NAME-routing (default: NAME-client)",
    )
    sidecar.add_argument(
        "--namespace",
        default=None,
        help="the application's namespace (default: the PDDeployment's; the Role and RoleBinding are "
        "always in the PDDeployment's)",
    )
    sidecar.add_argument(
        "--port", type=int, default=SIDECAR_PORT, help="the router's port on 127.0.0.1 (default: %(default)s)"
    )
    sidecar.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="the router's admin port on the pod's address: probes, /metrics "
        "(default: spec.router.adminPort)",
    )
    sidecar.add_argument(
        "--part",
        choices=("all", "pod", "rbac"),
        default="all",
        help="pod: only the Deployment patch; rbac: only the objects to apply (default: both)",
    )
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
    if getattr(args, "what", None) == "sidecar":  # callers may build the Namespace themselves
        if args.port == args.admin_port or (
            args.admin_port is None and args.port == pdd.spec.router.admin_port
        ):
            print("pdserve render: --port must differ from the admin port", file=sys.stderr)
            return 2
        patch = client_pod_patch(pdd, args.service_account, args.namespace, args.port, args.admin_port)
        objects = [patch] if args.part in ("all", "pod") else []
        objects += (
            client_rbac(pdd, args.service_account, args.namespace) if args.part in ("all", "rbac") else []
        )
    else:
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
