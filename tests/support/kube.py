"""Kubernetes test-cluster fixtures.

``kube_cluster`` (session) gives a :class:`KubeCluster` for a real control plane:

* ``PDSERVE_TEST_KUBECONFIG`` set: that cluster (e.g. kind, see ``hack/kind-e2e``); kubectl and
  helm come from the build cache if built, else from PATH. It is never stopped here.
* else the local one from ``hack/cluster/up`` (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler, kwok fake GPU nodes and the pod runner's node on loopback): reused when
  ``.cluster/kubeconfig`` answers (hack/cluster/up is run anyway if the pod runner is not
  running), else built (``hack/cluster/build``, cached) and started, and then stopped with
  ``hack/cluster/down`` at session end, only if this session started it (set
  ``PDSERVE_TEST_KEEP_CLUSTER=1`` to keep it running).

A cluster that cannot be reached or started fails the session (never skips).

``kube_namespace`` (function) creates a fresh namespace and deletes it after the test;
``kube_api`` (session) is a configured ``kubernetes.client.ApiClient``.
Mark tests that use these ``@pytest.mark.cluster``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PosixPath
from typing import Any, TypeVar

import pytest
import yaml

from pdserve.deployment.render.router import routing_reader_rbac

REPO = Path(__file__).resolve().parents[2]
# hack/cluster/up honours the same variable (a second, separate cluster needs other ports too).
CLUSTER_DIR = Path(os.environ.get("PDSERVE_CLUSTER_DIR") or REPO / ".cluster")
LOCAL_KUBECONFIG = CLUSTER_DIR / "kubeconfig"
LOGS = CLUSTER_DIR / "logs"
BUILD_TIMEOUT = 3600.0
UP_TIMEOUT = 300.0

T = TypeVar("T")


class KubeCommandError(subprocess.CalledProcessError):
    """A kubectl/helm call that failed; its message carries the command's stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


class Tool(PosixPath):
    """Path of a CLI (kubectl or helm) bound to a kubeconfig; calling it runs the CLI.

    ``cluster.kubectl`` is a :class:`~pathlib.Path` (``str(cluster.kubectl)`` is the binary) and
    ``cluster.kubectl("get", "nodes")`` runs ``kubectl --kubeconfig=<cluster> get nodes``.
    """

    kubeconfig: Path

    @classmethod
    def bound(cls, path: Path | str, kubeconfig: Path) -> Tool:
        tool = cls(path)
        tool.kubeconfig = kubeconfig
        return tool

    def __call__(
        self,
        *args: object,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self), f"--kubeconfig={self.kubeconfig}", *(str(a) for a in args)]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise KubeCommandError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc


@dataclass(frozen=True)
class KubeCluster:
    kubeconfig: Path
    kubectl: Tool
    helm: Tool
    is_local: bool

    def apply(self, manifest: str, namespace: str | None = None) -> subprocess.CompletedProcess[str]:
        """``kubectl apply -f -`` of a YAML/JSON manifest (server-side apply)."""
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", "--server-side", "--force-conflicts", *ns, "-f", "-", input=manifest)

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Until the CRD ``crd`` is Established. Polled here: ``kubectl wait`` fails at once
        ("status.conditions accessor error") when it reads a CRD created a moment before,
        whose status has no conditions yet."""
        condition = '{.status.conditions[?(@.type=="Established")].status}'
        eventually(
            lambda: (
                self.kubectl("get", f"crd/{crd}", "-o", f"jsonpath={condition}", check=False).stdout == "True"
            ),
            timeout=timeout,
            message=f"CRD {crd} Established",
        )

    def ready(self) -> bool:
        """True if the API server answers /readyz."""
        try:
            out = self.kubectl("get", "--raw", "/readyz", "--request-timeout=5s", check=False, timeout=15)
        except subprocess.TimeoutExpired:
            return False
        return out.returncode == 0 and out.stdout.strip() == "ok"


def eventually(
    fn: Callable[[], T | None],
    timeout: float = 30.0,
    interval: float = 0.25,
    message: str = "condition",
) -> T:
    """Call ``fn`` until it returns a truthy value (returned) or ``timeout`` passes (AssertionError).

    Exceptions raised by ``fn`` count as "not yet"; the last one is reported on timeout.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    last: Any = None
    while True:
        try:
            last = fn()
            if last:
                return last
        except Exception as exc:
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f"; last error: {last_exc!r}" if last_exc else f"; last value: {last!r}"
            raise AssertionError(f"timed out after {timeout}s waiting for {message}{detail}")
        time.sleep(interval)


def _run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[bool, str]:
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        log.write_text(f"$ {' '.join(cmd)}\n{out or ''}\n(timed out after {timeout}s)\n")
        return False, f"timed out after {timeout}s"
    text = f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    log.write_text(text)
    return proc.returncode == 0, "\n".join(text.strip().splitlines()[-15:])


def _local_bin(build_if_missing: bool) -> Path | None:
    build = REPO / "hack" / "cluster" / "build"
    out = subprocess.run([str(build), "--print-bin"], capture_output=True, text=True, cwd=REPO, check=False)
    if out.returncode == 0:
        return Path(out.stdout.strip())
    if not build_if_missing:
        return None
    log = LOGS / "build.log"
    ok, tail = _run_logged([str(build)], log, BUILD_TIMEOUT)
    if not ok:
        pytest.fail(f"hack/cluster/build failed (full output: {log}):\n{tail}", pytrace=False)
    out = subprocess.run([str(build), "--print-bin"], capture_output=True, text=True, cwd=REPO, check=True)
    return Path(out.stdout.strip())


def _runner_running() -> bool:
    """True if the pod runner recorded in .cluster/pids is alive (hack/cluster/lib.sh's check)."""
    try:
        pid = int((CLUSTER_DIR / "pids" / "pod-runner.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError):
        return False
    return b"/podrunner.py " in cmdline


def _tool(name: str, bin_dir: Path | None, kubeconfig: Path) -> Tool:
    if bin_dir is not None and (bin_dir / name).exists():
        return Tool.bound(bin_dir / name, kubeconfig)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: run hack/cluster/build (or put {name} on PATH)", pytrace=False)
    return Tool.bound(found, kubeconfig)


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    external = os.environ.get("PDSERVE_TEST_KUBECONFIG")
    if external:
        kubeconfig = Path(external).expanduser().resolve()
        if not kubeconfig.is_file():
            pytest.fail(f"PDSERVE_TEST_KUBECONFIG={external} is not a file", pytrace=False)
        bin_dir = _local_bin(build_if_missing=False)
        cluster = KubeCluster(
            kubeconfig, _tool("kubectl", bin_dir, kubeconfig), _tool("helm", bin_dir, kubeconfig), False
        )
        if not cluster.ready():
            pytest.fail(
                f"the cluster in PDSERVE_TEST_KUBECONFIG={external} does not answer /readyz", pytrace=False
            )
        yield cluster
        return

    bin_dir = _local_bin(build_if_missing=True)
    assert bin_dir is not None
    kubeconfig = LOCAL_KUBECONFIG
    cluster = KubeCluster(
        kubeconfig, _tool("kubectl", bin_dir, kubeconfig), _tool("helm", bin_dir, kubeconfig), True
    )
    started_here = False
    was_ready = kubeconfig.is_file() and cluster.ready()
    # A running cluster without its pod runner (stopped, or started before the runner existed)
    # gets it from hack/cluster/up's reuse path.
    if not was_ready or not _runner_running():
        log = LOGS / "up.log"
        ok, tail = _run_logged([str(REPO / "hack" / "cluster" / "up")], log, UP_TIMEOUT)
        if not ok:
            pytest.fail(
                f"hack/cluster/up failed; see {log} and the component logs in {LOGS}/:\n{tail}", pytrace=False
            )
        started_here = not was_ready
        if not cluster.ready():
            pytest.fail(f"the test cluster started but does not answer; see {LOGS}/kube-apiserver.log")
    try:
        yield cluster
    finally:
        if started_here and not os.environ.get("PDSERVE_TEST_KEEP_CLUSTER"):
            subprocess.run(
                [str(REPO / "hack" / "cluster" / "down")], cwd=REPO, capture_output=True, check=False
            )


def _namespace_name(test_name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-") or "test"
    suffix = secrets.token_hex(3)
    slug = slug[: 63 - len("t--") - len(suffix)].rstrip("-")
    return f"t-{slug}-{suffix}"


@pytest.fixture
def kube_namespace(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (``t-<test>-<random>``), deleted after the test."""
    name = _namespace_name(request.node.name)
    kube_cluster.kubectl("create", "namespace", name)
    try:
        # Pods need the namespace's default ServiceAccount, which kube-controller-manager creates.
        eventually(
            lambda: (
                kube_cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
                == 0
            ),
            timeout=30,
            message=f"ServiceAccount default in namespace {name}",
        )
        yield name
    finally:
        kube_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture
def local_cluster(kube_cluster: KubeCluster) -> KubeCluster:
    """The local test cluster (hack/cluster/up), with its kwok GPU nodes and its pod runner; on
    another cluster (PDSERVE_TEST_KUBECONFIG) the test is skipped."""
    if not kube_cluster.is_local:
        pytest.skip("needs the kwok GPU nodes and the pod runner of the local test cluster (hack/cluster/up)")
    return kube_cluster


@pytest.fixture
def local_namespace(local_cluster: KubeCluster, kube_namespace: str) -> str:
    """The test's namespace on the local test cluster (skipped on another one)."""
    return kube_namespace


@pytest.fixture(scope="session")
def kube_api(kube_cluster: KubeCluster) -> Iterator[Any]:
    """A ``kubernetes.client.ApiClient`` configured for ``kube_cluster``."""
    from kubernetes import config  # the 'operator' extra, installed by `make install`

    client = config.new_client_from_config(config_file=str(kube_cluster.kubeconfig))
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            client.close()


# --- a router's access to its routing ConfigMap, as the operator grants it ------------------------


def kubectl_for(kubeconfig: Path) -> Tool:
    """The built kubectl (else the one on PATH) bound to ``kubeconfig``; usable outside pytest."""
    return _tool("kubectl", _local_bin(build_if_missing=False), kubeconfig)


def router_role(namespace: str, account: str, configmap: str) -> list[dict[str, Any]]:
    """ServiceAccount, Role (get/list/watch on the one ConfigMap, by resourceNames), RoleBinding,
    as the operator renders them for a router."""
    meta = {"name": account, "namespace": namespace}
    return routing_reader_rbac(configmap, dict(meta), dict(meta), dict(meta))


def apply_objects(kubectl: Tool, objects: list[dict[str, Any]]) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": objects}
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(doc))


def grant_router_access(
    kubectl: Tool, namespace: str, account: str, configmap: str, with_role: bool = True
) -> None:
    """What the operator creates for a router: the account always, the Role and binding unless
    ``with_role`` is False (to see what a router says when RBAC is missing)."""
    objects = router_role(namespace, account, configmap)
    apply_objects(kubectl, objects if with_role else objects[:1])


def router_kubeconfig(
    kubectl: Tool, namespace: str, account: str, directory: Path, server: str | None = None
) -> Path:
    """A kubeconfig with a TokenRequest token of the ServiceAccount (what a router pod mounts),
    for the admin kubeconfig's API server, or ``server`` (a forwarder, a closed port)."""
    from pdserve.proxy.table.kubeconfig import token_kubeconfig

    admin = json.loads(kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    cluster = admin["clusters"][0]["cluster"]
    if "certificate-authority-data" in cluster:
        ca = base64.b64decode(cluster["certificate-authority-data"])
    else:
        ca = (kubectl.kubeconfig.parent / cluster["certificate-authority"]).read_bytes()
    token = kubectl("create", "token", account, "-n", namespace, "--duration=2h").stdout.strip()
    doc = token_kubeconfig(server or cluster["server"], ca, token, namespace)
    path = directory / f"kubeconfig-{account}-{secrets.token_hex(3)}"
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def gpu_pool(
    cluster: KubeCluster,
    count: int,
    gpus: int = 8,
    labels: dict[str, str] | None = None,
    taint: dict[str, str] | None = None,
) -> Iterator[list[str]]:
    """Extra kwok GPU nodes for one test: labelled, tainted (``dedicated=inference:NoSchedule``
    by default, so only pods that tolerate it land there), deleted afterwards."""
    import json

    prefix = f"pool-{secrets.token_hex(3)}"
    capacity = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
    taint = taint or {"key": "dedicated", "value": "inference", "effect": "NoSchedule"}
    nodes = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": f"{prefix}-{i}",
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "type": "kwok-pool",
                    "pdserve.test/pool": prefix,
                    "kubernetes.io/os": "linux",
                    **(labels or {}),
                },
            },
            "spec": {"taints": [taint]},
            "status": {"capacity": capacity, "allocatable": capacity},
        }
        for i in range(count)
    ]
    cluster.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes})
    )
    try:
        yield [n["metadata"]["name"] for n in nodes]
    finally:
        for node in nodes:
            cluster.kubectl("delete", "node", node["metadata"]["name"], "--wait=false", check=False)
