"""Every engine command pdserve renders, for every example and role, judged by vLLM's own parser.

Pod commands (what the operator would run on a cluster) and local-mode commands (what
`pdserve up --engine vllm` runs, on GPUs and on CPU) alike; examples with ``engine: sim`` are
rendered as if they named vLLM, and the first example once more with ``spec.tracing`` (each
endpoint protocol, detailed traces) for the tracing flags. The judging runs in the vLLM
virtualenv (vllm_argcheck.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from pdserve.deployment.render.engine_pod import engine_argv
from pdserve.deployment.render.groups import instance_objects
from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.deployment.spec.tracing import TracingSpec
from pdserve.local.plan import engine_process_count, plan_local_run
from pdserve.routing import Role
from tests.e2e_vllm.common import HERE, REPO, check, python_of_venv, say

EXAMPLES = REPO / "examples"
#: spec.tracing as the traced commands render it: either protocol, vLLM's detailed traces.
TRACINGS = {
    "traced over HTTP": TracingSpec("http://otel-collector:4318/v1/traces", 0.1, ("all",)),
    "traced over gRPC": TracingSpec("grpc://otel-collector:4317", 1.0, ("model", "worker")),
}


def rendered_commands() -> list[dict[str, Any]]:
    """Every engine command of every example: each pod of instance 0's group (leader and
    workers, or a LeaderWorkerSet's two templates) as the operator renders it, and each
    process of `pdserve up --engine vllm` on GPUs and on CPU, planned with as many ports as it
    runs processes. Needs no vLLM: `make test` runs it (tests/unit/test_e2e_vllm_plan.py)."""
    commands: list[dict[str, Any]] = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        pdd = _as_vllm(load_manifest_file(path))
        where = str(path.relative_to(REPO))
        for role in (Role.PREFILL, Role.DECODE):
            pods = _pod_templates(pdd, role)
            for node, pod in enumerate(pods):
                container = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
                argv = [*container["command"][:2], *(_expand(a) for a in engine_argv(pod))]
                member = f", node {node} of {len(pods)}" if len(pods) > 1 else ""
                commands.append({"name": f"{where} {role.value} (pod{member})", "argv": argv})
        if pdd.spec.kv_transfer.kv.render.local.refused:
            continue  # local mode refuses this connector with vLLM (MoRIIO: fixed ports)
        if any(pdd.spec.group_shape(r).multi_node for r in (Role.PREFILL, Role.DECODE)):
            continue  # local mode runs multi-node instances with --engine sim only (it says so)
        ports = list(range(20000, 20000 + engine_process_count(pdd)))
        for device in ("gpu", "cpu"):
            plan = plan_local_run(pdd, "vllm", ports, 8000, "routing.json", device=device, cores=[0, 1])
            for engine in plan.engines:
                if engine.index == 0:
                    name = f"{where} {engine.role.value} (pdserve up, {device})"
                    commands.append({"name": name, "argv": list(engine.argv)})
    first = _as_vllm(load_manifest_file(sorted(EXAMPLES.rglob("*.yaml"))[0]))
    for how, tracing in TRACINGS.items():
        traced = dataclasses.replace(first, spec=dataclasses.replace(first.spec, tracing=tracing))
        for role in (Role.PREFILL, Role.DECODE):
            pod = _pod_templates(traced, role)[0]
            argv = ["vllm", "serve", *(_expand(a) for a in engine_argv(pod))]
            commands.append({"name": f"spec.tracing {role.value} (pod, {how})", "argv": argv})
    return commands


def _pod_templates(pdd: PDDeployment, role: Role) -> list[dict[str, Any]]:
    """Instance 0's pods, leader first; a LeaderWorkerSet's leader and worker templates."""
    pods: list[dict[str, Any]] = []
    for obj in instance_objects(pdd, role, 0, "argcheck"):
        if obj["kind"] == "Pod":
            pods.append(obj)
        else:
            spec = obj["spec"]["leaderWorkerTemplate"]
            pods += [spec["leaderTemplate"], spec["workerTemplate"]]
    return pods


def _expand(arg: str) -> str:
    """Kubelet expands ``$(VAR)`` in args (pod IP, leader address); an address stands in here."""
    return re.sub(r"\$\(([A-Z_]+)\)", "10.0.0.1", arg)


def _as_vllm(pdd: PDDeployment) -> PDDeployment:
    if pdd.spec.engine == "vllm":
        return pdd
    spec = dataclasses.replace(pdd.spec, engine="vllm", image=pdd.spec.image or "vllm/vllm-openai:latest")
    return dataclasses.replace(pdd, spec=spec)


def check_rendered_commands(out_dir: Path) -> int:
    """Fails unless vLLM accepts every rendered command; returns how many were checked."""
    commands = rendered_commands()
    say(f"parsing {len(commands)} rendered engine commands with vLLM's own `vllm serve` parser")
    out = subprocess.run(
        [python_of_venv(), str(HERE / "vllm_argcheck.py")],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
    )
    check(out.returncode == 0, f"vllm_argcheck.py failed:\n{out.stderr[-3000:]}")
    results = json.loads(out.stdout)
    (out_dir / "argcheck.json").write_text(json.dumps(results, indent=1) + "\n")
    refused = [r for r in results if not r["ok"]]
    for r in refused:
        say(f"  vLLM refuses {r['name']}: {r['error']}")
    check(not refused, f"vLLM refused {len(refused)} of {len(results)} rendered commands (above)")
    say(f"vLLM accepts all {len(results)} rendered commands")
    return len(results)
