"""Pure builders: PDDeployment → Kubernetes manifests, as plain dicts.

Nothing here talks to a cluster: the operator diffs and applies these, ``pdserve render``
prints them, and the tests compare them with golden files. Names:

* Pod ``<name>-<role>-<index>-<suffix>`` per instance, the suffix random and chosen by the
  operator, so a replacement can start while the pod it replaces still exists (surge, a pod
  stuck Terminating on a lost node); the index is the ``pdserve.io/instance`` label.
  ``hostname`` ``<role>-<index>-<suffix>`` + ``subdomain`` give it a DNS name. Rendered without
  a cluster (``pdserve render``, local mode) the suffix is left out. An instance larger than
  ``gpusPerNode`` is a group of such pods, or a LeaderWorkerSet (groups.py, which also renders
  the whole set, :func:`~pdserve.deployment.render.groups.render_all`); :func:`pod_spec` renders each.
* headless Service ``<name>-engines`` (that subdomain; not-ready pods included)
* Deployment ``<name>-router`` running ``pdserve proxy``, Service ``<name>`` on the router port;
  with ``spec.router.placement: decode-sidecar`` no Deployment: a ``router`` container in every
  decode pod (decode_sidecar.py), and the Service selects the decode pods
* PodDisruptionBudget ``<name>-prefill`` and ``<name>-decode``, one per role (:func:`disruption_budget`)
* ConfigMap ``<name>-routing`` holding ``routing.json``; the router pods watch it through the
  API server as ServiceAccount ``<name>-router``, whose Role ``<name>-router`` (bound by
  RoleBinding ``<name>-router``) grants get/list/watch on that one ConfigMap (``resourceNames``)
  and nothing else. A router template may not set ``serviceAccountName`` (spec/owned.py), so the
  account is always this one.

Choices the issue left open: engine ``sim`` requests no GPUs (the issue's "no GPUs", so demos
run on kind; kwok tests that check GPU requests use engine ``vllm``, which kwok never runs);
``enableServiceLinks`` is off, because a Service named ``vllm`` would inject ``VLLM_PORT`` and
break vLLM's startup; ownerReferences are left out when the object has no uid (a file rendered
without a cluster), since the API server refuses an empty uid.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from collections.abc import Mapping
from typing import Any

from pdserve.deployment.plan.revision import pairing_revision
from pdserve.deployment.render.decode_sidecar import SIDECAR_PORT_NAME, add_sidecar
from pdserve.deployment.render.defaults import (
    ENGINE_PRESTOP_SECONDS,
    ENGINE_TERMINATION_GRACE_SECONDS,
    ROUTER_PRESTOP_SECONDS,
    ROUTER_TERMINATION_GRACE_SECONDS,
    STARTUP_PERIOD_SECONDS,
    default_requests,
    engine_security_context,
    router_args,
    startup_failure_threshold,
    with_default_requests,
)
from pdserve.deployment.render.groupflags import (
    GroupMember,
    group_flags,
)
from pdserve.deployment.render.security import (
    engine_key_env,
    router_admin_args,
    router_admin_port,
    router_key_env,
)
from pdserve.deployment.render.tracing import engine_tracing_args, engine_tracing_env, router_tracing_env
from pdserve.deployment.spec.multinode import GroupShape
from pdserve.deployment.spec.owned import ENGINE_ENV_OWNED
from pdserve.deployment.spec.pddeployment import (
    API_VERSION,
    DEFAULT_IMAGE,
    ENGINE_PORT,
    KIND,
    PDDeployment,
    RoleSpec,
)
from pdserve.deployment.spec.podtemplate import merge_metadata, merge_pod_spec
from pdserve.deployment.spec.storage import model_argument, storage_env, storage_mounts, storage_volumes
from pdserve.kv.base import PodKV, transfer_config
from pdserve.routing import CONFIGMAP_KEY, Role, RoutingTable

SHM_MOUNT = "/dev/shm"

# Labels.
NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
DEPLOYMENT_LABEL = "pdserve.io/deployment"
ROLE_LABEL = "pdserve.io/role"
INSTANCE_LABEL = "pdserve.io/instance"
TEMPLATE_HASH_LABEL = "pdserve.io/template-hash"
TIER_LABEL = "pdserve.io/tier"  # "engine" on every engine pod: what the headless Service selects
# What an instance pod runs, recorded at creation: during a rollout that changes dataParallel the
# old pods keep serving with their old size, and the routing table must advertise that one.
DP_SIZE_ANNOTATION = "pdserve.io/dp-size"
TP_SIZE_ANNOTATION = "pdserve.io/tp-size"
# Likewise the pairing revision (pdserve.deployment.plan.revision): old pods keep theirs until replaced.
REVISION_ANNOTATION = "pdserve.io/revision"
# Pods of a multi-node instance (a group; only on those): the leader's pod name (pods backend) or
# the LeaderWorkerSet's name, the pod's node index in the group (0 = leader), and the group's size.
GROUP_LABEL = "pdserve.io/group"
GROUP_NODE_LABEL = "pdserve.io/group-node"
GROUP_SIZE_ANNOTATION = "pdserve.io/group-size"
#: On a group's leader once the operator created its workers: a worker missing after that is lost.
GROUP_FORMED_ANNOTATION = "pdserve.io/group-formed"
MANAGER = "pdserve-operator"

# Probes. The startup probe allows startupTimeoutSeconds of model loading (defaults.py) before
# the liveness probe may restart the pod; the simulator starts in well under a second.
_SIM_STARTUP = {"periodSeconds": 1, "failureThreshold": 120}


# --- names and labels --------------------------------------------------------------------------


def instance_name(pdd: PDDeployment, role: Role, index: int, suffix: str = "") -> str:
    """``<name>-<role>-<index>``, plus ``-<suffix>`` for a pod the operator creates."""
    return f"{pdd.name}-{role.value}-{index}" + (f"-{suffix}" if suffix else "")


def instance_hostname(role: Role, index: int, suffix: str = "") -> str:
    """A DNS label (63 characters at most) under the ``<name>-engines`` subdomain."""
    return f"{role.value}-{index}" + (f"-{suffix}" if suffix else "")


def is_instance_name(pdd: PDDeployment, role: Role, index: int, name: str) -> bool:
    """Whether ``name`` is one of :func:`instance_name`'s, for any suffix."""
    base = instance_name(pdd, role, index)
    return name == base or (name.startswith(base + "-") and "-" not in name[len(base) + 1 :])


def engine_service_name(pdd: PDDeployment) -> str:
    return f"{pdd.name}-engines"


def router_name(pdd: PDDeployment) -> str:
    return f"{pdd.name}-router"


def routing_configmap_name(pdd: PDDeployment) -> str:
    return f"{pdd.name}-routing"


def router_account_name(pdd: PDDeployment) -> str:
    """The router's ServiceAccount, Role and RoleBinding share this name."""
    return f"{pdd.name}-router"


def disruption_budget_name(pdd: PDDeployment, role: Role) -> str:
    return f"{pdd.name}-{role.value}"


def labels(pdd: PDDeployment, component: str) -> dict[str, str]:
    """Labels of every object: ``component`` is prefill, decode, router or routing."""
    return {
        NAME: "pdserve",
        INSTANCE: pdd.name,
        COMPONENT: component,
        MANAGED_BY: MANAGER,
        DEPLOYMENT_LABEL: pdd.name,
    }


def role_selector(pdd: PDDeployment, role: Role) -> dict[str, str]:
    """Matches the pods of one role: the scale subresource's ``status.<role>.selector``."""
    return {DEPLOYMENT_LABEL: pdd.name, ROLE_LABEL: role.value}


def selector_string(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in selector.items())


def owner_reference(pdd: PDDeployment) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pdd.name,
        "uid": pdd.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def namespaced(namespace: str) -> dict[str, str]:
    """``{"namespace": ...}``, or nothing for "" (the namespace ``kubectl apply -n`` gives). A
    ServiceAccount subject of a RoleBinding without one is the binding's own (RBAC's rule)."""
    return {"namespace": namespace} if namespace else {}


def object_metadata(pdd: PDDeployment, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, **namespaced(pdd.namespace), "labels": labels(pdd, component)}
    if pdd.uid:
        meta["ownerReferences"] = [owner_reference(pdd)]
    return meta


# --- engine pods -------------------------------------------------------------------------------


def instance_pod(pdd: PDDeployment, role: Role, index: int, suffix: str = "") -> dict[str, Any]:
    """The one pod of a single-node instance (a multi-node role's are groups.group_pods)."""
    name = instance_name(pdd, role, index, suffix)
    meta = pod_metadata(pdd, role, index, name)
    spec = pod_spec(pdd, role, name, instance_hostname(role, index, suffix))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def pod_metadata(
    pdd: PDDeployment, role: Role, index: int, name: str, group: tuple[str, int | None, int] | None = None
) -> dict[str, Any]:
    """An engine pod's metadata; ``group`` is (group name, node index or None, group size)."""
    meta = object_metadata(pdd, name, role.value)
    meta["labels"].update(
        {
            ROLE_LABEL: role.value,
            INSTANCE_LABEL: str(index),
            TEMPLATE_HASH_LABEL: template_hash(pdd, role),
            TIER_LABEL: "engine",
        }
    )
    rs = pdd.spec.role(role)
    meta["annotations"] = {
        DP_SIZE_ANNOTATION: str(rs.data_parallel),
        TP_SIZE_ANNOTATION: str(rs.tensor_parallel),
        REVISION_ANNOTATION: pairing_revision(pdd, role),
    }
    if group is not None:
        group_name, node, size = group
        meta["labels"][GROUP_LABEL] = group_name
        if node is not None:
            meta["labels"][GROUP_NODE_LABEL] = str(node)
        meta["annotations"][GROUP_SIZE_ANNOTATION] = str(size)
    return merge_metadata(meta, rs.template)


def engine_argv(pod: Mapping[str, Any]) -> list[str]:
    """The engine container's arguments, the words of its ``sh -c`` line when it runs through a
    shell (a LeaderWorkerSet's worker template computes its start rank there)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    engine: Mapping[str, Any] = next((c for c in containers if c.get("name") == "engine"), {})
    argv = [str(a) for a in engine.get("args") or []]
    if [str(c) for c in engine.get("command") or []][-1:] == ["-c"] and argv:
        return shlex.split(argv[0])
    return argv


def pod_parallel_sizes(pod: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(dataParallel, tensorParallel) that an instance pod runs; None where it cannot be told.

    The annotations first; for pods created before they existed, the engine's own flags
    (``--data-parallel-size``/``--tensor-parallel-size`` for vLLM, ``--dp-size``/``--tp-size``
    for the simulator), which is what the process was started with.
    """
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    argv = engine_argv(pod)

    def size(annotation: str, flags: tuple[str, ...]) -> int | None:
        candidates = [annotations.get(annotation)]
        candidates += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags]
        for value in candidates:
            try:
                number = int(str(value))
            except ValueError:
                continue
            if number >= 1:
                return number
        return None

    return (
        size(DP_SIZE_ANNOTATION, ("--data-parallel-size", "--dp-size")),
        size(TP_SIZE_ANNOTATION, ("--tensor-parallel-size", "--tp-size")),
    )


def instance_pod_revision(pod: Mapping[str, Any]) -> str | None:
    """The pairing revision an instance pod runs; None for pods created before revisions."""
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(REVISION_ANNOTATION)
    return value if isinstance(value, str) and value else None


def template_hash(pdd: PDDeployment, role: Role) -> str:
    """Short hash of everything that defines an instance pod of ``role``.

    It hashes the rendered pod spec itself (with a placeholder for the instance name), so it
    changes exactly when a pod would come out different: image, args, env, resources, DP/TP,
    connector, and pdserve's own rendering. The instance count is not part of a pod.
    """
    spec: dict[str, Any] = pod_spec(pdd, role, "{instance}", "{instance}")
    shape = pdd.spec.group_shape(role)
    if shape.multi_node:  # a group: its leader's and a worker's pod, and how they are created
        rpc = pdd.spec.multi_node.rpc_port
        worker = pod_spec(pdd, role, "{instance}", "{instance}", GroupMember(shape, 1, rpc, "{leader}"))
        leader = pod_spec(pdd, role, "{instance}", "{instance}", GroupMember(shape, 0, rpc, "{leader}"))
        spec = {"leader": leader, "worker": worker, "backend": pdd.spec.multi_node.backend}
    template_metadata = pdd.spec.role(role).template.metadata
    if template_metadata:  # labels and annotations of a template are part of the pod too
        spec = {"spec": spec, "metadata": template_metadata}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return digest[:10]


def pod_spec(
    pdd: PDDeployment, role: Role, pod_name: str, hostname: str, member: GroupMember | None = None
) -> dict[str, Any]:
    """An engine pod's spec; ``member`` is its place in a multi-node group (None: the whole instance)."""
    spec = pdd.spec
    rs = spec.role(role)
    sim = spec.engine == "sim"
    flags = group_flags(member) if member is not None else []
    shape = member.shape if member is not None else None
    gpus = shape.gpus_per_pod if shape is not None else rs.gpus_per_instance
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine_image,
        "command": ["pdserve", "sim"] if sim else ["vllm", "serve"],
        "args": (_sim_args(pdd, role, pod_name, flags) if sim else _vllm_args(pdd, role, pod_name, flags))
        + engine_tracing_args(spec)
        + list(rs.args),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _engine_env(pdd) + engine_tracing_env(pdd, role) + [_plain(v) for v in rs.env],
        "resources": _engine_resources(spec.gpu_resource, rs, gpus if not sim else None),
        "volumeMounts": [{"name": "dshm", "mountPath": SHM_MOUNT}],
        "startupProbe": {
            "httpGet": _health(),
            **(_SIM_STARTUP if sim else _vllm_startup(rs)),
            "timeoutSeconds": 5,
        },
        "readinessProbe": {
            "httpGet": _health(),
            "periodSeconds": 2 if sim else 5,
            "failureThreshold": 3,
            "timeoutSeconds": 2 if sim else 5,
        },
        "livenessProbe": {
            "httpGet": _health(),
            "periodSeconds": 10,
            "failureThreshold": 6,
            "timeoutSeconds": 5,
        },
        # Out of every router's table before SIGTERM (defaults.ENGINE_PRESTOP_SECONDS).
        "lifecycle": {"preStop": {"sleep": {"seconds": ENGINE_PRESTOP_SECONDS}}},
    }
    if member is not None and member.headless:  # vLLM --headless serves no HTTP: nothing to probe
        container["ports"] = []
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            del container[probe]
    pod: dict[str, Any] = {
        "hostname": hostname,
        "subdomain": engine_service_name(pdd),
        "restartPolicy": "Always",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # an engine never calls the API (defaults.py)
        "terminationGracePeriodSeconds": ENGINE_TERMINATION_GRACE_SECONDS,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": rs.shm_size}}],
    }
    if rs.node_selector:
        pod["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        pod["tolerations"] = [_plain(t) for t in rs.tolerations]
    if rs.affinity:
        pod["affinity"] = _plain(rs.affinity)
    if not sim:  # the model's storage and the KV connector's needs; the simulator has neither
        container["volumeMounts"] += storage_mounts(spec.model, spec.model_cache)
        pod["volumes"] += storage_volumes(spec.model, spec.model_cache)
        kv = _kv_settings(pdd, role, member)
        container["ports"] += kv.ports
        container["env"] = _last_wins(kv.env + container["env"])  # the role's env overrides defaults
        if kv.capabilities:
            container["securityContext"] = {"capabilities": {"add": list(kv.capabilities)}}
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            **container.get("securityContext", {}),
        }
    else:
        pod["securityContext"] = engine_security_context(sim)
    if role is Role.DECODE and spec.router.decode_sidecar:  # the router in the pod (decode_sidecar.py)
        revision = pairing_revision(pdd, role)
        add_sidecar(pod, pdd, routing_configmap_name(pdd), router_account_name(pdd), revision)
    merged = merge_pod_spec(pod, rs.template.spec)
    engine = next(c for c in merged["containers"] if c["name"] == "engine")
    with_default_requests(engine, default_requests(gpus, sim))
    if not engine["ports"]:
        del engine["ports"]
    return merged


def _kv_settings(pdd: PDDeployment, role: Role, member: GroupMember | None) -> PodKV:
    """The connector's pod settings for the ranks this pod runs, from the first global rank it runs."""
    rs = pdd.spec.role(role)
    kv = pdd.spec.kv_transfer
    if member is None:
        return kv.kv.render.pod(kv.extra_config, role, rs.data_parallel, rs.tensor_parallel)
    shape: GroupShape = member.shape
    first = 0 if shape.spans_rank else shape.first_rank(member.node)
    return kv.kv.render.pod(kv.extra_config, role, shape.dp_local, rs.tensor_parallel, first)


def _vllm_startup(rs: RoleSpec) -> dict[str, Any]:
    return {
        "periodSeconds": STARTUP_PERIOD_SECONDS,
        "failureThreshold": startup_failure_threshold(rs.startup_timeout_seconds),
    }


def _last_wins(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per variable name, the last given, in order of first appearance."""
    last = {var["name"]: var for var in env}
    seen: list[str] = []
    for var in env:
        if var["name"] not in seen:
            seen.append(var["name"])
    return [last[name] for name in seen]


def _health() -> dict[str, Any]:
    return {"path": "/health", "port": "http"}


def _vllm_args(pdd: PDDeployment, role: Role, instance: str, group: list[str]) -> list[str]:
    spec = pdd.spec
    rs = spec.role(role)
    args = [
        model_argument(spec.model),
        "--served-model-name",
        spec.served_model_name,
        "--port",
        str(ENGINE_PORT),
        "--data-parallel-size",
        str(rs.data_parallel),
        "--tensor-parallel-size",
        str(rs.tensor_parallel),
    ]
    if rs.pipeline_parallel > 1:
        args += ["--pipeline-parallel-size", str(rs.pipeline_parallel)]
    args += group
    if rs.expert_parallel:
        args.append("--enable-expert-parallel")
    return [*args, "--kv-transfer-config", kv_transfer_json(pdd, role, instance)]


def kv_transfer_json(pdd: PDDeployment, role: Role, instance: str) -> str:
    """``--kv-transfer-config`` of an instance, as compact JSON in the connector's key order: equal
    specs give byte-equal pod args (and template hashes)."""
    kv = pdd.spec.kv_transfer
    config = transfer_config(kv.kv, kv.transfer_mode, kv.extra_config, role, instance, ENGINE_PORT)
    return json.dumps(config, separators=(",", ":"))


def _sim_args(pdd: PDDeployment, role: Role, pod_name: str, group: list[str]) -> list[str]:
    rs = pdd.spec.role(role)
    return [
        "--role",
        role.value,
        "--dp-size",
        str(rs.data_parallel),
        "--tp-size",
        str(rs.tensor_parallel),
        *group,
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--model",
        pdd.spec.served_model_name,
        "--instance-name",
        pod_name,
        "--kv-host",
        "$(POD_IP)",
    ]


def _engine_env(pdd: PDDeployment) -> list[dict[str, Any]]:
    """The pod IP, and the connector's advertised host set to it (vLLM would guess otherwise)."""

    def pod_ip(name: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}

    env = [pod_ip("POD_IP")]
    env += [pod_ip(name) for name in pdd.spec.kv_transfer.kv.render.pod_ip_env]
    if pdd.spec.engine != "sim":
        env += storage_env(pdd.spec.model, pdd.spec.model_cache, pdd.spec.hf_token_secret_ref)
    return env + engine_key_env(pdd.spec)  # the simulator checks VLLM_API_KEY like vLLM


#: Names of the environment variables the renderer sets on engine pods (validate.py refuses them).
OWNED_ENV = ENGINE_ENV_OWNED.names


def _engine_resources(gpu_resource: str, rs: RoleSpec, gpus: int | None) -> dict[str, Any]:
    """The role's resources plus ``gpus`` of ``gpu_resource`` (None: the simulator, no GPUs)."""
    resources = _plain(rs.resources)
    if gpus is not None:
        count = str(gpus)
        for section in ("requests", "limits"):
            resources.setdefault(section, {})[gpu_resource] = count
    return dict(resources)


# --- router ------------------------------------------------------------------------------------


def router_deployment(pdd: PDDeployment) -> dict[str, Any]:
    """The router Deployment: its admin port and keys (security.py), then ``spec.router.template``."""
    deployment = _router_deployment(pdd)
    pod = deployment["spec"]["template"]
    router = next(c for c in pod["spec"]["containers"] if c["name"] == "router")
    router["args"] += router_admin_args(pdd.spec)
    router["ports"].append(router_admin_port(pdd.spec))
    if router_key_env(pdd.spec):
        router["env"] = router.get("env", []) + router_key_env(pdd.spec)
    # pdserve's own image runs as user 10001 and needs no privilege.
    pod["spec"].setdefault(
        "securityContext", {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    )
    router.setdefault(
        "securityContext", {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    )
    template = pdd.spec.router.template
    pod["metadata"] = merge_metadata(pod["metadata"], template)
    pod["spec"] = merge_pod_spec(pod["spec"], template.spec)
    return deployment


def _router_deployment(pdd: PDDeployment) -> dict[str, Any]:
    router = pdd.spec.router
    selector = {DEPLOYMENT_LABEL: pdd.name, COMPONENT: "router"}
    container = {
        "name": "router",
        "image": router.image or DEFAULT_IMAGE,
        "command": ["pdserve"],
        "args": router_args(pdd.spec, routing_configmap_name(pdd), router.port),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "env": [
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *router_tracing_env(pdd, define_pod_name=True),
        ],
        # Ready only with a table that has a routable slot per role; 503 at once on SIGTERM.
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 2,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        # Out of the Service's endpoints before SIGTERM (defaults.ROUTER_PRESTOP_SECONDS).
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SECONDS}}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(pdd, router_name(pdd), "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector},
            # One new router is up before an old one goes: the Service never loses every endpoint.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(pdd, "router")},
                "spec": {
                    "enableServiceLinks": False,
                    # The token is how the router watches its routing ConfigMap.
                    "serviceAccountName": router_account_name(pdd),
                    "automountServiceAccountToken": True,
                    "terminationGracePeriodSeconds": ROUTER_TERMINATION_GRACE_SECONDS,
                    "containers": [container],
                },
            },
        },
    }


def routing_reader_rbac(
    configmap: str, account: dict[str, Any], role: dict[str, Any], binding: dict[str, Any]
) -> list[dict[str, Any]]:
    """A ServiceAccount, a Role that reads only ``configmap`` (by name: the one object a router
    reads) and the RoleBinding of the Role to the account; the arguments are their metadata. The
    router Deployment's account and a client sidecar's get the same rules from here."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": role,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [configmap],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": binding,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["name"]},
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": account["name"],
                    **namespaced(account.get("namespace", "")),
                }
            ],
        },
    ]


def router_rbac(pdd: PDDeployment) -> list[dict[str, Any]]:
    """The router's ServiceAccount, Role and RoleBinding (all named ``<name>-router``)."""
    account, role, binding = (object_metadata(pdd, router_account_name(pdd), "router") for _ in range(3))
    return routing_reader_rbac(routing_configmap_name(pdd), account, role, binding)


def router_service(pdd: PDDeployment) -> dict[str, Any]:
    """The client Service: the router pods, or with placement decode-sidecar the decode pods'
    router container (a draining decode pod turns unready first, so it leaves the endpoints)."""
    router = pdd.spec.router
    selector = {DEPLOYMENT_LABEL: pdd.name, COMPONENT: "router"}
    target = "http"
    if router.decode_sidecar:
        selector, target = role_selector(pdd, Role.DECODE), SIDECAR_PORT_NAME
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_metadata(pdd, pdd.name, "router"),
        "spec": {
            "type": router.service_type,
            "selector": selector,
            "ports": [{"name": "http", "port": router.port, "targetPort": target, "protocol": "TCP"}],
        },
    }


def router_pod_selector(pdd: PDDeployment) -> str:
    """The pods that run a router (what the operator asks ``/routing/served``), as a label selector."""
    if pdd.spec.router.decode_sidecar:
        return selector_string(role_selector(pdd, Role.DECODE))
    return selector_string({DEPLOYMENT_LABEL: pdd.name, COMPONENT: "router"})


def engine_service(pdd: PDDeployment) -> dict[str, Any]:
    """Headless: gives each engine pod a stable DNS name; the router itself routes by pod IP."""
    meta = object_metadata(pdd, engine_service_name(pdd), "engine")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {DEPLOYMENT_LABEL: pdd.name, TIER_LABEL: "engine"},
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def disruption_budget(pdd: PDDeployment, role: Role) -> dict[str, Any]:
    """The role's PodDisruptionBudget: evictions may leave at most maxUnavailable instances not Ready.

    Rendered as an integer ``minAvailable`` (instances minus the allowed count), because for
    ``maxUnavailable`` and percentages the disruption controller reads the expected count from
    the pods' controller's scale subresource, and the PDDeployment's scale is decode's: a
    prefill budget would be computed against decode's instances. An integer minAvailable is
    counted against the pods that exist. ``AlwaysAllow`` lets a drain evict a pod that is
    running but not Ready (crashlooping, or still loading its model), which serves nothing, even
    when the budget is spent, so one broken pod cannot block a node's drain.

    A multi-node role's budget counts pods, not groups: minAvailable is its pods minus the
    allowed instances. Evicting one pod takes its whole group down (vLLM cannot lose a member),
    so each allowed eviction may cost one instance, and maxUnavailable stays a bound on
    instances; two evictions from one group cost one instance but spend two.
    """
    rs = pdd.spec.role(role)
    pods = rs.instances * pdd.spec.group_shape(role).nodes
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_metadata(pdd, disruption_budget_name(pdd, role), role.value),
        "spec": {
            "minAvailable": pods - rs.disruption_budget.allowed(rs.instances),
            "selector": {"matchLabels": role_selector(pdd, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def routing_configmap(pdd: PDDeployment, table: RoutingTable) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(pdd, routing_configmap_name(pdd), "routing"),
        "data": {CONFIGMAP_KEY: table.to_json()},
    }


# --- sets --------------------------------------------------------------------------------------


def desired_static_objects(pdd: PDDeployment) -> list[dict[str, Any]]:
    """Objects whose content follows from the spec alone (no pod state): Services, the router's
    account and its read access to the routing ConfigMap, the router, and the roles' disruption
    budgets (also for a role of 0 instances: minAvailable 0 over no pods, so nothing to prune)."""
    router = [] if pdd.spec.router.decode_sidecar else [router_deployment(pdd)]
    return [
        engine_service(pdd),
        router_service(pdd),
        *router_rbac(pdd),
        *router,
        disruption_budget(pdd, Role.PREFILL),
        disruption_budget(pdd, Role.DECODE),
    ]


def _plain(value: Any) -> Any:
    return copy.deepcopy(dict(value)) if isinstance(value, Mapping) else copy.deepcopy(value)
