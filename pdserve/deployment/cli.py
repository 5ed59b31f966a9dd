"""Print every Kubernetes manifest of a PDDeployment file, without a cluster.

The output is what the operator would create right after the PDDeployment is applied: the
engine and router Services, the router Deployment, the routing ConfigMap (no instances yet) and
one Pod per instance; a role larger than the file's gpusPerNode gets a group of Pods per instance
(their workers find the leader by its DNS name), or with spec.multiNode.backend lws one
LeaderWorkerSet per instance. Objects carry no ownerReference unless the file has metadata.uid,
and no namespace unless the file has metadata.namespace or --namespace NS is given, so
`pdserve render FILE | kubectl apply -n NS -f -` puts them where you say.
Exit status 2 when the file is not a valid PDDeployment; the message names the field.

`pdserve render sidecar FILE` prints instead what an application pod needs to run the router
next to itself against that PDDeployment (a client-side sidecar; docs/operations.md): a patch
for the application's Deployment (the `router` container on 127.0.0.1:--port, its token volume,
the ServiceAccount) and the RBAC (the ServiceAccount, a Role reading NAME-routing, a
RoleBinding). Apply the patch with `kubectl patch deployment APP --patch-file FILE` and the rest
with `kubectl apply -f` (`--part pod` / `--part rbac` print one of them).

Examples:
  pdserve render examples/sim/quickstart.yaml
  pdserve render examples/sim/quickstart.yaml --namespace serving
  pdserve render sidecar examples/sim/quickstart.yaml --service-account my-app --part rbac \\
    | kubectl apply -f -
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from pdserve.deployment.render.client_sidecar import client_pod_patch, client_rbac
from pdserve.deployment.render.decode_sidecar import SIDECAR_PORT
from pdserve.deployment.render.groups import render_all
from pdserve.deployment.spec.parse import SpecError, load_manifest_file
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
    parser.add_argument(
        "-n",
        "--namespace",
        default=None,
        metavar="NS",
        help="the PDDeployment's namespace, written into every object (default: the file's "
        "metadata.namespace, else none: `kubectl apply -n NS` chooses); with `sidecar`: the "
        "application's namespace (default: the PDDeployment's; the Role and RoleBinding are always "
        "in the PDDeployment's)",
    )
    sidecar = parser.add_argument_group("with `sidecar`")
    sidecar.add_argument(
        "--service-account",
        default=None,
        help="the application's ServiceAccount, granted read access to NAME-routing (default: NAME-client)",
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
    sidecar = getattr(args, "what", None) == "sidecar"  # callers may build the Namespace themselves
    namespace = getattr(args, "namespace", None)
    try:
        pdd = replace(pdd, namespace=_namespace(args.file, namespace, sidecar))
    except ValueError as exc:
        print(f"pdserve render: {exc}", file=sys.stderr)
        return 2
    if sidecar:
        if args.port == args.admin_port or (
            args.admin_port is None and args.port == pdd.spec.router.admin_port
        ):
            print("pdserve render: --port must differ from the admin port", file=sys.stderr)
            return 2
        patch = client_pod_patch(pdd, args.service_account, namespace, args.port, args.admin_port)
        objects = [patch] if args.part in ("all", "pod") else []
        objects += client_rbac(pdd, args.service_account, namespace) if args.part in ("all", "rbac") else []
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


#: A Kubernetes namespace name (DNS-1123 label).
_NAMESPACE = re.compile(r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _namespace(path: str, flag: str | None, sidecar: bool) -> str:
    """The PDDeployment's namespace for rendering: --namespace, else the file's, else "" (none:
    ``kubectl apply -n`` chooses). With ``sidecar`` the flag is the application's namespace and
    the PDDeployment's is the file's. ValueError says what to change."""
    given = _file_namespace(path)
    if flag is not None and not _NAMESPACE.match(flag):
        raise ValueError(f"--namespace: expected a namespace name, got {flag!r}")
    if sidecar:
        if flag and not given:
            raise ValueError(
                f"with `sidecar`, --namespace is the application's: set metadata.namespace in {path} "
                "to the PDDeployment's (its Role and RoleBinding go there)"
            )
        return given
    if flag and given and flag != given:
        raise ValueError(f"{path} is in namespace {given!r}, --namespace says {flag!r}: drop one of them")
    return flag or given


def _file_namespace(path: str) -> str:
    """The file's own ``metadata.namespace`` ("" when it has none); the file already parsed."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")) if d is not None]
    meta = docs[0].get("metadata") if docs and isinstance(docs[0], dict) else None
    namespace = meta.get("namespace") if isinstance(meta, dict) else None
    return namespace if isinstance(namespace, str) else ""


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """A ``---`` separated YAML stream, keys in the builders' order (apiVersion, kind, metadata, ...)."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True)
