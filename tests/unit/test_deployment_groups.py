"""Rendering of multi-node instances: group pods (backend pods) and LeaderWorkerSets (backend lws).

Goldens of a DeepSeek-class shape for both backends (regenerate with
``PDSERVE_UPDATE_GOLDEN=1 pytest tests/unit/test_deployment_groups.py`` and review the diff), plus
the invariants: names and labels, per-node flags, probes only where vLLM serves HTTP, the template
hash over the whole group, the disruption budget in pods.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.deployment.cli import to_yaml
from pdserve.deployment.render.engine_pod import instance_pod, template_hash
from pdserve.deployment.render.groups import group_pods, instance_lws, render_all
from pdserve.deployment.render.names import (
    GROUP_LABEL,
    GROUP_NODE_LABEL,
    GROUP_SIZE_ANNOTATION,
    INSTANCE_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_LABEL,
)
from pdserve.deployment.render.static_objects import disruption_budget
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.deployment.validate import problems
from pdserve.routing import Role
from tests.support import specs
from tests.support.specs import check_golden
from tests.unit.test_deployment_objects import SHAPES, shape_manifest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "render" / "multinode"
UID = "7a1e2c3d-1d7a-4c1e-9a53-2b7d3c9e8f10"

#: prefill DP16 with expert parallelism over 2 nodes of 8 GPUs; decode DP32 over 4 nodes.
DEEPSEEK: dict[str, Any] = {
    "model": "deepseek-ai/DeepSeek-R1",
    "servedModelName": "deepseek-r1",
    "image": "vllm/vllm-openai:v0.11.0",
    "gpusPerNode": 8,
    "prefill": {"instances": 1, "dataParallel": 16, "expertParallel": True},
    "decode": {"instances": 1, "dataParallel": 32, "expertParallel": True},
}
#: A dense model whose rank is larger than a node: TP8 x PP2 over 2 nodes, leader-served.
SPANNING: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-405B-Instruct",
    "image": "vllm/vllm-openai:v0.11.0",
    "gpusPerNode": 8,
    "prefill": {"instances": 1, "tensorParallel": 8, "pipelineParallel": 2},
    "decode": {"instances": 1, "tensorParallel": 8},
}
CASES: dict[str, dict[str, Any]] = {
    "deepseek-pods": DEEPSEEK,
    "deepseek-pods-leader": {**DEEPSEEK, "multiNode": {"apiServers": "leader"}},
    "deepseek-lws": {**DEEPSEEK, "multiNode": {"backend": "lws"}},
    "spanning-pods": SPANNING,
    "spanning-lws": {**SPANNING, "multiNode": {"backend": "lws"}},
    "sim-pods": {
        "model": "m",
        "engine": "sim",
        "gpusPerNode": 2,
        "prefill": {"instances": 1, "dataParallel": 4},
        "decode": {"instances": 2, "dataParallel": 2},
    },
}


def pdd_of(spec: dict[str, Any], name: str = "ds") -> PDDeployment:
    metadata = {"namespace": "serving", "uid": UID, "generation": 1}
    return specs.pdd_of(name, metadata=metadata, **{"image": None, **spec})  # the image the case gives


def engine(pod: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod["spec"]["containers"]
    return next(c for c in containers if c["name"] == "engine")


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_render(case: str) -> None:
    pdd = pdd_of(CASES[case])
    assert problems(pdd, None) == []
    check_golden(GOLDEN / f"{case}.yaml", to_yaml(render_all(pdd)))


@pytest.mark.parametrize("connector", ["nixl", "moriio"])
@pytest.mark.parametrize("shape", SHAPES)
def test_single_node_groups_are_todays_pod(shape: str, connector: str) -> None:
    """With gpusPerNode as large as an instance the pods are byte-identical to those without it."""
    plain = parse_pddeployment(shape_manifest(shape, connector))
    sized = parse_pddeployment(shape_manifest(shape, connector, gpusPerNode=8))
    for role in Role:
        assert group_pods(sized, role, 0, "abcde", "10.1.2.3") == [instance_pod(plain, role, 0, "abcde")]
        assert template_hash(sized, role) == template_hash(plain, role)
        assert disruption_budget(sized, role) == disruption_budget(plain, role)


def test_group_pod_names_labels_and_flags_per_node() -> None:
    pdd = pdd_of(DEEPSEEK)
    pods = group_pods(pdd, Role.DECODE, 3, "x7k2p", "10.4.0.9")
    names = [p["metadata"]["name"] for p in pods]
    assert names == ["ds-decode-3-x7k2p", "ds-decode-3-x7k2p-1", "ds-decode-3-x7k2p-2", "ds-decode-3-x7k2p-3"]
    for node, pod in enumerate(pods):
        meta = pod["metadata"]
        assert meta["labels"][GROUP_LABEL] == "ds-decode-3-x7k2p"
        assert meta["labels"][GROUP_NODE_LABEL] == str(node)
        assert meta["labels"][INSTANCE_LABEL] == "3" and meta["labels"][ROLE_LABEL] == "decode"
        assert meta["labels"][TEMPLATE_HASH_LABEL] == template_hash(pdd, Role.DECODE)
        assert meta["annotations"][GROUP_SIZE_ANNOTATION] == "4"
        assert pod["spec"]["hostname"] == "decode-3-x7k2p" + (f"-{node}" if node else "")
        container = engine(pod)
        args = container["args"]
        assert flag(args, "--data-parallel-size") == "32"
        assert flag(args, "--data-parallel-size-local") == "8"
        assert flag(args, "--data-parallel-start-rank") == str(8 * node)
        assert "--data-parallel-hybrid-lb" in args and "--headless" not in args
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        nixl = [p["containerPort"] for p in container["ports"] if p["name"].startswith("nixl-")]
        assert nixl == list(range(5600 + 8 * node, 5608 + 8 * node))  # vLLM: base + global DP rank
        assert "readinessProbe" in container  # perNode: every pod serves HTTP
        if node == 0:
            assert flag(args, "--data-parallel-address") == "$(POD_IP)"
        else:
            assert flag(args, "--data-parallel-address") == "$(PDSERVE_LEADER_ADDRESS)"
            assert container["env"][0] == {"name": "PDSERVE_LEADER_ADDRESS", "value": "10.4.0.9"}


def test_leader_mode_workers_are_headless_without_probes() -> None:
    pdd = pdd_of({**DEEPSEEK, "multiNode": {"apiServers": "leader", "rpcPort": 20000}})
    leader, *workers = group_pods(pdd, Role.PREFILL, 0, "a", None)
    args = engine(leader)["args"]
    assert "--data-parallel-start-rank" not in args  # vLLM would make it a hybrid-LB node
    assert flag(args, "--data-parallel-rpc-port") == "20000"
    assert "readinessProbe" in engine(leader)
    for worker in workers:
        container = engine(worker)
        assert "--headless" in container["args"] and "--data-parallel-hybrid-lb" not in container["args"]
        assert flag(container["args"], "--data-parallel-start-rank") == "8"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe not in container
        assert "http" not in [p["name"] for p in container["ports"]]
        # Without the leader's IP: its DNS name in the engines' headless Service.
        assert container["env"][0]["value"] == "prefill-0-a.ds-engines.serving.svc"


def test_leader_address_does_not_change_the_pods_but_its_env() -> None:
    pdd = pdd_of(DEEPSEEK)
    with_ip = group_pods(pdd, Role.PREFILL, 0, "a", "10.0.0.1")
    without = group_pods(pdd, Role.PREFILL, 0, "a", None)
    assert with_ip[0] == without[0]
    engine(with_ip[1])["env"].pop(0)
    engine(without[1])["env"].pop(0)
    assert with_ip[1] == without[1]


def test_template_hash_covers_the_group() -> None:
    base = template_hash(pdd_of(DEEPSEEK), Role.PREFILL)
    for change in (
        {"multiNode": {"apiServers": "leader"}},
        {"multiNode": {"rpcPort": 14000}},
        {"multiNode": {"backend": "lws"}},
        {"gpusPerNode": 4},
    ):
        assert template_hash(pdd_of({**DEEPSEEK, **change}), Role.PREFILL) != base, change
    # The gang timeout is how the operator waits, not what a pod runs.
    assert template_hash(pdd_of({**DEEPSEEK, "multiNode": {"gangTimeoutSeconds": 60}}), Role.PREFILL) == base


def test_disruption_budget_counts_pods_and_allows_instances() -> None:
    spec = copy.deepcopy(DEEPSEEK)
    spec["decode"]["instances"] = 3
    budget = disruption_budget(pdd_of(spec), Role.DECODE)
    assert budget["spec"]["minAvailable"] == 3 * 4 - 1
    spec["decode"]["disruptionBudget"] = {"maxUnavailable": "50%"}
    assert disruption_budget(pdd_of(spec), Role.DECODE)["spec"]["minAvailable"] == 12 - 2


def test_lws_object() -> None:
    pdd = pdd_of({**DEEPSEEK, "multiNode": {"backend": "lws"}})
    lws = instance_lws(pdd, Role.DECODE, 2, "q1w2e")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    assert lws["metadata"]["name"] == "ds-decode-2-q1w2e"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == UID
    template = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 1
    assert template["size"] == 4 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    for part in (leader, worker):
        assert "hostname" not in part["spec"] and "subdomain" not in part["spec"]
        assert part["metadata"]["labels"][GROUP_LABEL] == "ds-decode-2-q1w2e"
        assert part["metadata"]["labels"][TEMPLATE_HASH_LABEL] == template_hash(pdd, Role.DECODE)
        assert "name" not in part["metadata"]
    assert leader["metadata"]["labels"][GROUP_NODE_LABEL] == "0"
    assert GROUP_NODE_LABEL not in worker["metadata"]["labels"]  # LWS labels its worker index
    assert flag(engine(leader)["args"], "--data-parallel-address") == "$(POD_IP)"
    command = engine(worker)["command"]
    (script,) = engine(worker)["args"]
    assert command == ["/bin/sh", "-c"]
    assert script.startswith("exec vllm serve deepseek-ai/DeepSeek-R1 ")
    assert '--data-parallel-start-rank "$$((LWS_WORKER_INDEX * 8))"' in script
    assert "--data-parallel-address '$(LWS_LEADER_ADDRESS)'" in script
    with pytest.raises(ValueError):
        instance_lws(pdd_of({**DEEPSEEK, "gpusPerNode": 64}), Role.DECODE, 0, "a")


def test_lws_worker_script_runs_the_same_argv_as_the_pod() -> None:
    """The shell gets exactly the engine's words, with the start rank computed from the index."""
    pdd = pdd_of({**DEEPSEEK, "multiNode": {"backend": "lws"}})
    worker = instance_lws(pdd, Role.PREFILL, 0, "a")["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    script = engine(worker)["args"][0].replace("$$", "$").replace("exec ", "printf '%s\\n' ", 1)
    out = subprocess.run(
        ["/bin/sh", "-c", script],
        env={"LWS_WORKER_INDEX": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pods = group_pods(pdd_of(DEEPSEEK), Role.PREFILL, 0, "a", None)
    expected = [*engine(pods[1])["command"], *engine(pods[1])["args"]]
    expected[expected.index("$(PDSERVE_LEADER_ADDRESS)")] = "$(LWS_LEADER_ADDRESS)"
    assert out == expected


def test_render_cli_prints_group_pods_and_lws(tmp_path: Path) -> None:
    for backend, kinds in (("pods", ["Pod"] * 6), ("lws", ["LeaderWorkerSet"] * 2)):
        manifest = specs.manifest("ds", **{**DEEPSEEK, "multiNode": {"backend": backend}})
        path = tmp_path / f"{backend}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "render", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        docs = list(yaml.safe_load_all(out))
        assert [d["kind"] for d in docs if d["kind"] in ("Pod", "LeaderWorkerSet")] == kinds
