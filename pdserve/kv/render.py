"""The render part of a connector: what the operator, ``pdserve render`` and ``pdserve up`` put
into an engine pod, and what vLLM accepts between prefill and decode (its compatibility rules)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.kv.checks import last_value

# --- render: the engine pod -----------------------------------------------------------------------


@dataclass(frozen=True)
class PodKV:
    """What an engine pod gets for its connector, beyond the pod-IP variables."""

    env: list[dict[str, Any]] = field(default_factory=list)
    ports: list[dict[str, Any]] = field(default_factory=list)
    capabilities: tuple[str, ...] = ()


#: The capability of a connector that registers the KV cache for RDMA: it lifts ``RLIMIT_MEMLOCK``.
IPC_LOCK = "IPC_LOCK"


def container_port(name: str, number: int) -> dict[str, Any]:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


@dataclass(frozen=True)
class Side:
    """One role as the compatibility rules see it (deployment's RoleSpec, cut down)."""

    data_parallel: int
    tensor_parallel: int
    args: tuple[str, ...] = ()

    def flag(self, name: str) -> str | None:
        return last_value(self.args, name)


@dataclass(frozen=True)
class Pair:
    """Prefill and decode of a deployment, for :class:`Rule` checks."""

    prefill: Side
    decode: Side
    gpu_resource: str


@dataclass(frozen=True)
class Rule:
    """One thing vLLM needs of prefill and decode, read from the vLLM version pdserve targets.

    Rules a CEL expression can state are in the CRD too, with exactly :attr:`message` as the CEL
    message (tests/unit/test_admission.py compares them); the operator and ``pdserve render``
    check every rule (pdserve.deployment.admission).
    """

    id: str
    where: str  # the fields, relative to spec
    rule: str  # in words
    source: str  # the vLLM source it comes from
    message: str = ""  # CEL rules: the CEL message, and the operator's after "spec."
    cel: bool = False

    @property
    def enforced_by(self) -> str:
        return "API server (CEL), operator, pdserve render" if self.cel else "operator, pdserve render"


@dataclass(frozen=True)
class ExtraProblem:
    """An ``extraConfig`` key that contradicts the spec; ``got`` holds the offending value, shown
    after the reason in the parser's words (empty: not shown)."""

    key: str
    reason: str
    got: tuple[object, ...] = ()


class ConnectorRule(Protocol):
    """A rule of one connector, with its check: the messages as the operator reports them (a CEL
    rule's as ``spec.<message>``)."""

    rule: Rule

    def problems(self, pair: Pair) -> list[str]: ...


@dataclass(frozen=True)
class LocalRun:
    """What one machine needs to run several engines of this connector (``pdserve up --engine vllm``)."""

    #: Why the connector cannot run several vLLM instances on one machine ("": it can).
    refused: str = ""
    #: The variable that moves an instance's side-channel ports (None: the connector has none).
    port_env: str | None = None
    #: The python module vLLM imports for the connector, and what to install when it is missing.
    module: str | None = None
    install: str = ""
    #: Environment for the connector's transport between processes of one machine without RDMA.
    cpu_env: Mapping[str, str] = field(default_factory=dict)
    #: What shares the prefill's cores with its engine (named in the layout `pdserve up` prints).
    prefill_thread: str = ""


class Render:
    """The deployment's view of a connector: pure functions of ``kvTransfer`` and a pod's shape.

    ``mode`` is ``spec.kvTransfer.transferMode`` (None for a connector without modes), ``extra``
    its ``extraConfig``. The defaults describe a connector that needs nothing.
    """

    #: Environment variables set to the pod IP (the address the connector advertises).
    pod_ip_env: tuple[str, ...] = ()
    #: Environment variables pdserve always sets for this connector, and why (validate.py refuses
    #: them in a role's env; the CRD's CEL in a template's).
    owned_env: tuple[tuple[str, str], ...] = ()
    #: Roles whose routing-table instances carry ``kvAddress`` (the table refuses one without).
    address_roles: frozenset[str] = frozenset()
    #: The compatibility rules of this connector, checked only when the deployment uses it.
    rules: tuple[ConnectorRule, ...] = ()
    #: Where vLLM states a rule shared by every connector (``tp-ratio``, ``same-cache-dtype``)
    #: for this one; the reference lists them.
    sources: tuple[tuple[str, str], ...] = ()
    #: What vLLM needs of prefill and decode that depends on the model, so no rule checks it.
    unchecked: str = ""
    local: LocalRun = LocalRun()

    def spec_problems(self, mode: str | None, extra: Mapping[str, Any]) -> list[ExtraProblem]:
        """``extraConfig`` keys that contradict the spec (the parser refuses the first)."""
        return []

    def shape_problems(self, extra: Mapping[str, Any], ranks: int) -> list[tuple[str, str]]:
        """``extraConfig`` keys that cannot serve an instance of ``ranks`` DP x TP ranks."""
        return []

    def extra_config(self, mode: str | None, http_port: int) -> dict[str, Any]:
        """``kv_connector_extra_config`` pdserve derives; the user's ``extraConfig`` is merged last."""
        return {}

    def engine_id(self, instance: str) -> str | None:
        """vLLM's ``engine_id`` for an instance (None: vLLM picks a random one)."""
        return None

    def pod(self, extra: Mapping[str, Any], role: str, dp: int, tp: int, first_rank: int = 0) -> PodKV:
        """Env, ports and capabilities of an engine pod running ``dp`` ranks from ``first_rank``."""
        return PodKV()

    def kv_address(
        self, extra: Mapping[str, Any], role: str, host: str, port: int | None = None
    ) -> str | None:
        """The routing table's ``kvAddress`` of an engine at ``host``; ``port`` is its side-channel
        port when local mode moved it (None: the one the pod is rendered with)."""
        return None

    def local_ports(self, role: str, dp: int, tp: int, base: int) -> tuple[int, ...]:
        """The ports an engine listens on for its connector when local mode gives it ``base``."""
        return ()
