"""The Helm chart: lint, golden renders, schema refusals, and agreement with its sources.

The chart copies two single sources it cannot reference from outside its folder: the CRD
(``crds/``) and the operator's RBAC (``deploy/rbac/``, whose rules the templates read).
``hack/sync-chart`` refreshes both; these tests fail when a copy drifts or the rendered rules
differ from the source. Helm comes from the test cluster's build (hack/cluster/build); without
it these tests skip locally and FAIL under CI.

Regenerate the golden files with ``PDSERVE_UPDATE_GOLDEN=1 pytest tests/unit/test_chart.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve import __version__
from pdserve.deployment.render.client_sidecar import client_rbac
from pdserve.deployment.spec.parse import parse_pddeployment
from pdserve.operator.cli import configure as configure_operator_cli
from tests.support.specs import check_golden, pdd_of

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdserve"
GOLDEN = REPO / "tests" / "golden" / "chart"
RELEASE, NAMESPACE = "pdserve", "pdserve-system"

CASES: dict[str, list[str]] = {
    "default": [],
    "namespaced": ["--set", "operator.scope=namespaced", "--set", "operator.namespaces={team-a,team-b}"],
    "monitoring": [
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.labels.release=prometheus",
        "--set",
        "operator.logLevel=debug",
        "--set",
        "image.tag=0.1.0-rc1",
        "--set",
        "serviceAccount.annotations.owner=platform",
    ],
}


CASES["client-sidecars"] = [
    "--set",
    "clientSidecars[0].deployment=chat",
    "--set",
    "clientSidecars[0].namespace=serving",
    "--set",
    "clientSidecars[0].serviceAccount=chat-frontend",
    "--set",
    "clientSidecars[1].deployment=chat",
    "--set",
    "clientSidecars[1].namespace=serving",
    "--set",
    "clientSidecars[1].serviceAccount=batch",
    "--set",
    "clientSidecars[1].serviceAccountNamespace=jobs",
]


CASES["tracing"] = [
    "--set",
    "tracing.endpoint=grpc://otel-collector.observability:4317",
    "--set-json",
    "tracing.samplingRatio=0.1",
    *("--set", "deployments[0].name=chat", "--set", "deployments[0].spec.model=m"),
    *("--set", "deployments[0].spec.engine=sim"),
    *("--set", "deployments[1].name=batch", "--set", "deployments[1].spec.model=m"),
    *("--set", "deployments[1].spec.engine=sim"),
    *("--set", "deployments[1].spec.tracing.endpoint=http://elsewhere:4318/v1/traces"),
]


#: The production values file (charts/pdserve/ci/): also installed in the test cluster.
PRODUCTION_VALUES = CHART / "ci" / "production-values.yaml"
CASES["production"] = ["--values", str(PRODUCTION_VALUES)]


def find_helm() -> str | None:
    """helm from the test cluster's build cache, else from PATH."""
    if os.environ.get("PDSERVE_HELM"):
        return os.environ["PDSERVE_HELM"]
    build = REPO / "hack" / "cluster" / "build"
    if build.exists():
        result = subprocess.run([str(build), "--print-bin"], capture_output=True, text=True, timeout=60)
        candidate = Path(result.stdout.strip()) / "helm"
        if result.returncode == 0 and candidate.exists():
            return str(candidate)
    return shutil.which("helm")


_HELM_ENV: dict[str, str] = {}


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> str:
    binary = find_helm()
    if binary is None:
        message = "helm not built: run hack/cluster/build (make cluster-build)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    home = tmp_path_factory.mktemp("helm-home")
    # No repositories, plugins or kube context of the user's: only the chart on disk.
    _HELM_ENV.update(
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
    )
    return binary


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **_HELM_ENV}
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, env=env)


def render(helm: str, extra: Sequence[str] = ()) -> str:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


def objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def source_docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((REPO / "deploy" / "rbac" / name).read_text()) if d]


# --- copies of the single sources (no helm needed) -------------------------------------------------


def test_chart_crds_are_exact_copies_of_crds_dir() -> None:
    source = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    copied = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert copied == source, "run hack/sync-chart"
    for name in source:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/pdserve/crds/{name} drifted from crds/{name}: run hack/sync-chart"
        )


def test_chart_rbac_sources_are_exact_copies_of_deploy_rbac() -> None:
    for name in ("cluster.yaml", "namespaced.yaml"):
        assert (CHART / "files" / "rbac" / name).read_bytes() == (
            REPO / "deploy" / "rbac" / name
        ).read_bytes(), (
            f"charts/pdserve/files/rbac/{name} drifted from deploy/rbac/{name}: run hack/sync-chart"
        )


def test_chart_versions_follow_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert chart["version"] == __version__


# --- helm ------------------------------------------------------------------------------------------


def test_helm_lint_is_clean(helm: str) -> None:
    for extra in CASES.values():
        result = run_helm(helm, "lint", "--strict", str(CHART), *extra)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_helm_template_matches_golden(helm: str, case: str) -> None:
    check_golden(GOLDEN / f"{case}.yaml", render(helm, CASES[case]))


def _rules(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["rules"])


OPERATOR_NAMESPACE = "pdserve-system"  # where deploy/rbac puts the operator's own objects


def _own(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Objects in the operator's own namespace (leader election), not a watched one."""
    return [d for d in by_kind(docs, kind) if d["metadata"].get("namespace") == OPERATOR_NAMESPACE]


def _watched(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in by_kind(docs, kind) if d["metadata"].get("namespace") != OPERATOR_NAMESPACE]


def _lease_rules(source: list[dict[str, Any]], lease: str) -> list[dict[str, Any]]:
    """The source's leader-election rules with the release's Lease name."""
    (role,) = _own(source, "Role")
    return [{**r, "resourceNames": [lease]} if "resourceNames" in r else r for r in _rules(role)]


def test_cluster_scope_rbac_equals_deploy_rbac(helm: str) -> None:
    docs = objects(render(helm))
    source = source_docs("cluster.yaml")
    (source_role,) = by_kind(source, "ClusterRole")
    (role,) = by_kind(docs, "ClusterRole")
    assert _rules(role) == _rules(source_role)
    # The only Role: leader election's, in the release namespace, for the release's Lease.
    (lease_role,) = by_kind(docs, "Role")
    assert lease_role["metadata"]["namespace"] == NAMESPACE
    assert _rules(lease_role) == _lease_rules(source, "pdserve-operator")
    (lease_binding,) = by_kind(docs, "RoleBinding")
    assert lease_binding["roleRef"]["name"] == lease_role["metadata"]["name"]
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    (sa,) = by_kind(docs, "ServiceAccount")
    (deployment,) = by_kind(docs, "Deployment")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_namespaced_scope_rbac_equals_deploy_rbac_in_every_namespace(helm: str) -> None:
    docs = objects(render(helm, CASES["namespaced"]))
    source = source_docs("namespaced.yaml")
    (source_role,) = _watched(source, "Role")
    roles = _watched(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _rules(role) == _rules(source_role)
    bindings = _watched(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    # Leader election's Role stays in the release namespace, whatever is watched.
    (lease_role,) = _own(docs, "Role")
    assert _rules(lease_role) == _lease_rules(source, "pdserve-operator")
    # Cluster-scoped reads (nodes, for the GPU fit check) stay a ClusterRole, with nothing more.
    assert [_rules(r) for r in by_kind(docs, "ClusterRole")] == [
        _rules(r) for r in by_kind(source, "ClusterRole")
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_args_are_accepted_by_the_operator_cli(helm: str, case: str) -> None:
    docs = objects(render(helm, CASES[case]))
    (deployment,) = by_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert (
        container["image"]
        == f"ghcr.io/pdserve/pdserve:{'0.1.0-rc1' if case == 'monitoring' else __version__}"
    )
    args = container["args"]
    assert container["command"] == ["pdserve"] and args[0] == "operator"
    parser = argparse.ArgumentParser(exit_on_error=False)
    configure_operator_cli(parser)
    parsed = parser.parse_args(args[1:])
    # Routers and engine: sim pods run the image the operator runs from.
    assert parsed.pdserve_image == container["image"]
    if case == "namespaced":
        assert parsed.namespace == ["team-a", "team-b"] and not parsed.all_namespaces
    else:
        assert parsed.all_namespaces and not parsed.namespace
    assert parsed.verbose is (case == "monitoring")
    traced = "grpc://otel-collector.observability:4317" if case == "tracing" else None
    assert parsed.otlp_traces_endpoint == traced
    # Leader election: on, the release's Lease, the chart's timings, identity and namespace from
    # the downward API; two replicas that prefer different nodes.
    assert parsed.leader_elect and parsed.leader_election_id == "pdserve-operator"
    assert (parsed.lease_duration, parsed.renew_deadline, parsed.retry_period) == (15, 10.0, 2.0)
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    assert deployment["spec"]["replicas"] == 2
    pod_spec = deployment["spec"]["template"]["spec"]
    if "podAntiAffinity" in pod_spec.get("affinity", {}):
        (term,) = pod_spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": parsed.metrics_port, "liveness": parsed.liveness_port}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_client_sidecar_rbac_is_what_pdserve_render_sidecar_prints(helm: str) -> None:
    docs = objects(render(helm, CASES["client-sidecars"]))
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "chat-routing-reader"]
    bindings = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"].startswith("chat-")]
    pdd = pdd_of("chat", metadata={"namespace": "serving"}, engine="sim", image=None)
    for account, namespace, binding in zip(
        ("chat-frontend", "batch"), ("serving", "jobs"), bindings, strict=True
    ):
        _, source_role, source_binding = client_rbac(pdd, account, namespace)
        assert role["metadata"]["name"] == source_role["metadata"]["name"]
        assert role["metadata"]["namespace"] == source_role["metadata"]["namespace"] == "serving"
        assert role["rules"] == source_role["rules"]
        for key in ("roleRef", "subjects"):
            assert binding[key] == source_binding[key]
        assert binding["metadata"]["name"] == source_binding["metadata"]["name"]
        assert binding["metadata"]["namespace"] == "serving"


def test_metrics_service_and_service_monitor_select_the_operator(helm: str) -> None:
    docs = objects(render(helm, CASES["monitoring"]))
    (deployment,) = by_kind(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (service,) = by_kind(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert not by_kind(objects(render(helm)), "ServiceMonitor"), "ServiceMonitor is opt-in"


def test_tracing_values_trace_the_operator_and_the_releases_deployments(helm: str) -> None:
    """tracing.endpoint: the operator's flag, and spec.tracing of each PDDeployment without one."""
    docs = objects(render(helm, CASES["tracing"]))
    chat, batch = (parse_pddeployment(d) for d in by_kind(docs, "PDDeployment"))
    assert chat.spec.tracing is not None and batch.spec.tracing is not None
    assert (chat.spec.tracing.endpoint, chat.spec.tracing.sampling_ratio) == (
        "grpc://otel-collector.observability:4317",
        0.1,
    )
    assert batch.spec.tracing.endpoint == "http://elsewhere:4318/v1/traces"  # its own is kept
    assert batch.spec.tracing.sampling_ratio == 1.0
    without = by_kind(objects(render(helm, CASES["tracing"][4:])), "PDDeployment")
    assert "tracing" not in without[0]["spec"]


BAD_VALUES = [
    (["--set", "operator.replicas=0"], "operator.replicas"),
    (["--set", "operator.leaderElection.leaseDuration=soon"], "operator.leaderElection.leaseDuration"),
    (["--set", "operator.scope=everywhere"], "operator.scope"),
    (["--set", "operator.metricsPort=http"], "operator.metricsPort"),
    (["--set", "operator.livenessPort=70000"], "operator.livenessPort"),
    (["--set", "operator.logLevel=trace"], "operator.logLevel"),
    (["--set", "operatr.scope=namespaced"], "operatr"),
    (["--set", "operator.namespaces={Team_A}", "--set", "operator.scope=namespaced"], "operator.namespaces"),
    (["--set", "rbac.create=maybe"], "rbac.create"),
    (["--set", "tracing.endpoint=collector:4317"], "tracing.endpoint"),
    (["--set-json", "tracing.samplingRatio=2"], "tracing.samplingRatio"),
    (["--set", "metrics.serviceMonitor.interval=often"], "metrics.serviceMonitor.interval"),
    (["--set", "clientSidecars[0].deployment=chat"], "serviceAccount"),
    (
        ["--set", "clientSidecars[0].deployment=Chat", "--set", "clientSidecars[0].serviceAccount=a"],
        "deployment",
    ),
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES, ids=[v[1] for v in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_field(helm: str, values: list[str], field: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values)
    assert result.returncode != 0, f"accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert field.replace(".", "/") in result.stderr or field in result.stderr, result.stderr


def test_leader_election_off_only_for_one_replica(helm: str) -> None:
    off = ["--set", "operator.leaderElection.enabled=false"]
    result = run_helm(helm, "template", RELEASE, str(CHART), *off)
    assert result.returncode != 0
    assert "operator.replicas > 1 needs operator.leaderElection.enabled=true" in result.stderr
    docs = objects(render(helm, [*off, "--set", "operator.replicas=1"]))
    (deployment,) = by_kind(docs, "Deployment")
    assert "--no-leader-elect" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not by_kind(docs, "Role"), "no Lease, no Role for it"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "operator.leaderElection.leaseDuration=10"], "leaseDuration must be greater than"),
        (["--set", "operator.leaderElection.retryPeriod=9"], "renewDeadline must be greater than 1.2 x"),
    ],
)
def test_leader_election_timings_follow_client_go_rules(helm: str, values: list[str], message: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), *values)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_each_release_has_its_own_lease(helm: str) -> None:
    """Two releases in one namespace (different watched namespaces) must not share a Lease."""
    result = run_helm(helm, "template", "team-a", str(CHART), "--namespace", NAMESPACE)
    assert result.returncode == 0, result.stderr
    docs = objects(result.stdout)
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-election-id=team-a-pdserve-operator" in args
    (role,) = by_kind(docs, "Role")
    assert role["rules"][1]["resourceNames"] == ["team-a-pdserve-operator"]


def test_namespaces_without_namespaced_scope_are_refused(helm: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--set", "operator.namespaces={team-a}")
    assert result.returncode != 0
    assert "operator.namespaces is only used with operator.scope=namespaced" in result.stderr


def test_service_monitor_without_service_is_refused(helm: str) -> None:
    result = run_helm(
        helm,
        "template",
        RELEASE,
        str(CHART),
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.service.enabled=false",
    )
    assert result.returncode != 0
    assert "metrics.service.enabled=true" in result.stderr


def render_notes(helm: str, tmp_path: Path, extra: Sequence[str] = ()) -> str:
    """NOTES.txt through Helm's engine, without a cluster (`helm install --dry-run` needs one).

    A copy of the chart gets a template that holds NOTES.txt as a YAML block scalar.
    """
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart)
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    wrapper = "notes: |\n" + "".join(f"  {line}\n" for line in notes.splitlines())
    (chart / "templates" / "zz-notes.yaml").write_text(wrapper)
    result = run_helm(
        helm,
        "template",
        RELEASE,
        str(chart),
        "--namespace",
        NAMESPACE,
        "--show-only",
        "templates/zz-notes.yaml",
        *extra,
    )
    assert result.returncode == 0, result.stderr
    return str(yaml.safe_load(result.stdout)["notes"])


def test_notes_say_what_to_do_next(helm: str, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path)
    assert f"kubectl -n {NAMESPACE} rollout status deployment/{RELEASE}" in notes
    assert "kubectl apply -f examples/sim/quickstart.yaml" in notes
    assert "watches PDDeployments in every namespace" in notes
    assert f"service/{RELEASE}-metrics port 9090" in notes


def test_notes_name_the_watched_namespaces(helm: str, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path, CASES["namespaced"])
    assert "watches PDDeployments in: team-a, team-b." in notes


# --- production values: PDDeployments and network policies ----------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_production_values_render_a_valid_pddeployment_and_policies_that_fit_its_pods(helm: str) -> None:
    from pdserve.deployment.render.groups import render_all
    from pdserve.deployment.validate import problems

    docs = objects(render(helm, CASES["production"]))
    (doc,) = by_kind(docs, "PDDeployment")
    assert doc["metadata"]["labels"]["team"] == "ml"
    pdd = parse_pddeployment(doc)
    assert problems(pdd, None) == []
    assert pdd.spec.model_cache is not None and pdd.spec.hf_token_secret_ref is not None
    rendered = render_all(pdd)
    pods = [o for o in rendered if o["kind"] == "Pod"]
    (router,) = [o for o in rendered if o["kind"] == "Deployment"]
    router_pod = router["spec"]["template"]
    policies = {p["metadata"]["name"]: p for p in by_kind(docs, "NetworkPolicy")}
    engines, routers = policies[f"{RELEASE}-engines"], policies[f"{RELEASE}-routers"]
    assert all(_selects(engines["spec"]["podSelector"], p["metadata"]["labels"]) for p in pods)
    assert not _selects(engines["spec"]["podSelector"], router_pod["metadata"]["labels"])
    assert _selects(routers["spec"]["podSelector"], router_pod["metadata"]["labels"])
    assert not any(_selects(routers["spec"]["podSelector"], p["metadata"]["labels"]) for p in pods)
    # Engines take HTTP from the routers' pods, and anything from engine pods (KV transfer).
    from_routers, from_engines, from_monitoring = engines["spec"]["ingress"]
    assert _selects(from_routers["from"][0]["podSelector"], router_pod["metadata"]["labels"])
    assert all(_selects(from_engines["from"][0]["podSelector"], p["metadata"]["labels"]) for p in pods)
    assert "ports" not in from_engines
    # The named ports exist on the pods they are meant for.
    engine_ports = {p["name"] for p in pods[0]["spec"]["containers"][0]["ports"]}
    router_ports = {p["name"] for p in router_pod["spec"]["containers"][0]["ports"]}
    assert {"http", "nixl-0"} <= engine_ports and {"http", "admin"} <= router_ports
    client, admin = routers["spec"]["ingress"]
    assert client["ports"] == [{"port": "http", "protocol": "TCP"}] and "from" not in client
    assert admin["ports"] == [{"port": "admin", "protocol": "TCP"}]
    assert from_monitoring["from"] == admin["from"][1:]
    # The template reached the pods: the private registry and the GPU pool's taint.
    assert pods[0]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"} in pods[0][
        "spec"
    ]["tolerations"]


def test_network_policies_and_deployments_are_opt_in(helm: str) -> None:
    docs = objects(render(helm))
    assert not by_kind(docs, "NetworkPolicy") and not by_kind(docs, "PDDeployment")


def test_the_grafana_dashboard_ships_behind_a_value_and_queries_real_metrics(helm: str) -> None:
    import json
    import re

    from pdserve.proxy.metrics import ProxyMetrics

    assert not [
        d for d in by_kind(objects(render(helm)), "ConfigMap") if d["metadata"]["name"].endswith("dashboard")
    ]
    (config,) = [d for d in by_kind(objects(render(helm, CASES["production"])), "ConfigMap")]
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["pdserve.json"])
    assert dashboard == json.loads((CHART / "files" / "dashboards" / "pdserve.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in (
        "Requests per slot",
        "Time to first token",
        "Errors",
        "Engine queue",
        "Served routing generation",
    ):
        assert wanted in titles
    # Every series a panel asks for is one the router (or vLLM's engine, for vllm:*) exports.
    families = {m.name for m in ProxyMetrics().registry.collect()}
    exported = set()
    for name in families:
        exported |= {name, f"{name}_total", f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for metric in re.findall(r"\b(pdserve_[a-z_]+|vllm:[a-z_]+)\{", target["expr"]):
                assert metric in exported or metric in (
                    "vllm:num_requests_waiting",
                    "vllm:num_requests_running",
                ), metric
