"""Every engine command pdserve renders, for every example and role, judged by vLLM's own parser.

Pod commands (what the operator would run on a cluster) and local-mode commands (what
`pdserve up --engine vllm` runs, on GPUs and on CPU) alike; examples with ``engine: sim`` are
rendered as if they named vLLM. The judging runs in the vLLM virtualenv (vllm_argcheck.py).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

from pdserve.deployment.objects import instance_pod
from pdserve.deployment.spec import PDDeployment, load_manifest_file
from pdserve.local.plan import plan_local_run
from pdserve.routing import Role
from tests.e2e_vllm.common import HERE, REPO, check, python_of_venv, say

EXAMPLES = REPO / "examples"


def rendered_commands() -> list[dict[str, Any]]:
    commands: list[dict[str, Any]] = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        pdd = _as_vllm(load_manifest_file(path))
        where = str(path.relative_to(REPO))
        for role in (Role.PREFILL, Role.DECODE):
            container = instance_pod(pdd, role, 0)["spec"]["containers"][0]
            argv = [*container["command"], *container["args"]]
            commands.append({"name": f"{where} {role.value} (pod)", "argv": argv})
        if pdd.spec.kv_transfer.kv.render.local.refused:
            continue  # local mode refuses this connector with vLLM (MoRIIO: fixed ports)
        count = pdd.spec.prefill.instances + pdd.spec.decode.instances
        for device in ("gpu", "cpu"):
            plan = plan_local_run(
                pdd, "vllm", list(range(20000, 20000 + count)), 8000, "routing.json",
                device=device, cores=[0, 1],
            )  # fmt: skip
            for engine in plan.engines:
                if engine.index == 0:
                    name = f"{where} {engine.role.value} (pdserve up, {device})"
                    commands.append({"name": name, "argv": list(engine.argv)})
    return commands


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
