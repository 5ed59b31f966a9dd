"""What pdserve knows of one of vLLM's P/D KV connectors, as one value per connector.

A connector module (``nixl.py``, ``moriio.py``, ``mooncake.py``) builds one :class:`KVConnector`
from four parts, one per job, so each floor asks only for the part it needs:

* :class:`Names`: the CRD's ``kvTransfer.connector`` (vLLM's ``kv_connector``), the routing
  table's ``connector.type`` and the transfer modes it takes;
* :class:`Render`: what the operator, ``pdserve render`` and ``pdserve up`` put into an engine
  pod (``--kv-transfer-config``, ports, environment, capabilities, the table's ``kvAddress``)
  and what vLLM accepts between prefill and decode (:class:`Rule`);
* :class:`Route`: how the router turns a client request into a prefill leg and a decode leg
  (request ids, ``kv_transfer_params``, the checks on the prefill's answer);
* :class:`Simulate`: what a simulated engine answers and which handoffs it refuses.

Everything here is pure and imports nothing of pdserve: routing/, deployment/, proxy/, sim/ and
local/ look a connector up (:mod:`pdserve.kv`) and never compare its name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: The two legs of a P/D request, as the routing table's roles name them.
PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True)
class Names:
    crd: str  # spec.kvTransfer.connector, and vLLM's kv_connector
    table: str  # the routing table's connector.type
    #: spec.kvTransfer.transferMode and the table's transferMode; empty: the connector takes none.
    modes: tuple[str, ...] = ()


# --- render: the engine pod -----------------------------------------------------------------------


@dataclass(frozen=True)
class PodKV:
    """What an engine pod gets for its connector, beyond the pod-IP variables."""

    env: list[dict[str, Any]] = field(default_factory=list)
    ports: list[dict[str, Any]] = field(default_factory=list)
    capabilities: tuple[str, ...] = ()


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


def transfer_config(
    connector: KVConnector,
    mode: str | None,
    extra: Mapping[str, Any],
    role: str,
    instance: str,
    http_port: int,
) -> dict[str, Any]:
    """The value of ``vllm serve --kv-transfer-config`` for an instance of ``role``.

    Every connector pdserve renders takes the same roles: the prefill produces KV, the decode
    consumes it (``kv_both`` is never rendered). pdserve's derived extra config comes first, the
    user's ``extraConfig`` last, so a user can set any key the connector documents.
    """
    config: dict[str, Any] = {
        "kv_connector": connector.names.crd,
        "kv_role": "kv_producer" if role == PREFILL else "kv_consumer",
    }
    engine_id = connector.render.engine_id(instance)
    if engine_id is not None:
        config["engine_id"] = engine_id
    merged = {**connector.render.extra_config(mode, http_port), **extra}
    if merged:
        config["kv_connector_extra_config"] = merged
    return config


# --- route: the proxy's legs --------------------------------------------------------------------


class Instance(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def tp_size(self) -> int: ...


class Peer(Protocol):
    """What a connector reads of a slot (pdserve.routing.Slot): one engine and how to reach it."""

    @property
    def instance(self) -> Instance: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def rank_header(self) -> int | None: ...

    @property
    def kv_address(self) -> str | None: ...

    @property
    def local_dp_size(self) -> int: ...


@dataclass(frozen=True)
class LegIds:
    """The X-Request-Id each leg of an attempt carries, and the transfer id they share.

    vLLM takes its request id from X-Request-Id: two requests in flight with one id collide
    there (a cancel of one aborts the other), so a retry must never reuse an id.
    """

    prefill: str
    decode: str
    transfer_id: str | None = None


def leg_id(base: str, role: str, number: int) -> str:
    """``<base>-p<n>`` / ``<base>-d<n>``: the n-th prefill or decode leg of a request."""
    return f"{base}-{role[0]}{number}"


@dataclass(frozen=True)
class LegPlan:
    """One upstream request: its JSON body and the X-data-parallel-rank to send (None: none)."""

    body: dict[str, Any]
    dp_rank: int | None


class Route(Protocol):
    """How one client request becomes a prefill leg and a decode leg (the proxy's connector).

    Built once per routing table (:meth:`KVConnector.route`); the I/O flow (pdserve.proxy) is
    shared by all connectors, a connector only says whether its two legs run one after the other
    or at once and whether a prefill's handoff may go to another decode.
    """

    name: str  # the routing table's connector.type, for logs
    concurrent: bool  # the decode is sent together with the prefill instead of after it
    reusable_handoff: bool  # a prefill's handoff may go to another decode than the one it was made for

    def ids(
        self, base: str, prefill_leg: int, decode_leg: int, prefill: Peer, decode: Peer, uid: str
    ) -> LegIds:
        """Ids of an attempt whose legs are the ``prefill_leg``-th and ``decode_leg``-th of the request."""
        ...

    def prefill_leg(self, body: Mapping[str, Any], prefill: Peer, decode: Peer, ids: LegIds) -> LegPlan: ...

    def handoff_problems(self, answer: object) -> list[str]:
        """Missing or malformed fields in the prefill's ``kv_transfer_params`` (empty: usable)."""
        ...

    def decode_leg(
        self,
        body: Mapping[str, Any],
        prefill: Peer,
        decode: Peer,
        ids: LegIds,
        handoff: Mapping[str, Any] | None,
    ) -> LegPlan: ...


def prefill_only(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request cut down to a prefill: one token, no streaming.

    ``min_tokens`` would contradict ``max_tokens=1`` and ``stream_options`` is invalid without
    ``stream``, so both go.
    """
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


# --- simulate: what a simulated engine answers ----------------------------------------------------


@dataclass(frozen=True)
class SimEngine:
    """The simulated engine that serves a leg: its instance, its global DP rank, and its side channel."""

    instance: str
    rank: int
    dp_size: int
    tp_size: int
    kv_host: str
    kv_port: int


@dataclass(frozen=True)
class PullNotice:
    """A simulated decode telling the simulated prefill that holds its KV "I have it", so the
    prefill's engine (``pdserve sim --profile``) frees the blocks before its lease ends."""

    url: str  # the prefill simulator's side channel: http://host:port
    engine_id: str  # the prefill engine, which names its DP rank
    key: str  # the prefill leg, as its engine holds the blocks (Simulate.hold_key)


class Simulate:
    """What ``pdserve sim`` does for a connector's legs; the defaults answer nothing and refuse nothing."""

    #: A prefill leg's blocks stay held for its decode until a pull notice or the lease's end
    #: (the step engine of ``pdserve sim --profile``); False: freed when the prefill finishes.
    holds_kv: bool = False

    #: Where the ``vllm`` stand-in reads the advertised side channel (pdserve.sim.vllm_cli): the
    #: host's variables in order, the port's variable, and vLLM's default port.
    host_env: tuple[str, ...] = ()
    port_env: str | None = None
    default_port: int = 0

    def recognises(self, params: Mapping[str, Any], leg: str) -> int:
        """How surely ``params`` are this connector's when the simulator is not told its connector:
        2 a key only this connector sends, 1 its shape without such a key, 0 not its."""
        return 0

    def prefill_answer(
        self,
        engine: SimEngine,
        params: Mapping[str, Any],
        request_id: str,
        prompt_tokens: int,
        blocks: list[list[int]],
    ) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a prefill answers with (None: vLLM answers none)."""
        return None

    def handoff_problems(self, params: Mapping[str, Any]) -> list[str]:
        """Missing or malformed fields of a decode leg's ``kv_transfer_params``; a real decode
        given them would wait for KV that never comes, so the simulator refuses them."""
        return []

    def malformed(self, answer: Mapping[str, Any]) -> dict[str, Any]:
        """The prefill answer of the ``malformed-kv-params`` fault: without what the decode needs."""
        return dict(answer)

    def record(self, request_id: str | None) -> dict[str, Any]:
        """Fields of the simulator's per-request record this connector adds (for every request)."""
        return {}

    def hold_key(self, params: Mapping[str, Any], request_id: str) -> str:
        """The key a prefill leg's held blocks go by (``request_id``: vLLM's internal id)."""
        return request_id

    def pull_notice(self, params: Mapping[str, Any]) -> PullNotice | None:
        """Whom a decode leg tells once it has the KV (None: nobody)."""
        return None

    def engine_rank(self, engine_id: str, instance: str) -> int | None:
        """The DP rank of ``instance`` an engine id of this connector names (None: not one of its)."""
        return None


# --- the whole --------------------------------------------------------------------------------------


class RouteFactory(Protocol):
    def __call__(self, mode: str | None) -> Route: ...


@dataclass(frozen=True)
class KVConnector:
    names: Names
    render: Render
    #: The proxy's connector for a table of this type and transfer mode.
    route: RouteFactory
    simulate: Simulate


# --- shared checks -------------------------------------------------------------------------------


#: A field of ``kv_transfer_params`` and the test its value must pass.
FieldCheck = tuple[str, Callable[[object], bool]]


def field_problems(params: object, checks: Sequence[FieldCheck]) -> list[str]:
    """The fields of ``params`` whose value fails its check (``["kv_transfer_params"]`` when
    ``params`` is no object at all), in the order of ``checks``."""
    if not isinstance(params, Mapping):
        return ["kv_transfer_params"]
    return [key for key, ok in checks if not ok(params.get(key))]


def is_true(value: object) -> bool:
    return value is True


def nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def is_port(value: object) -> bool:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def block_ids(value: object) -> bool:
    """vLLM sends one list of block ids per KV-cache group; a flat list is accepted too."""
    if not isinstance(value, list):
        return False
    if all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        return True
    return all(isinstance(g, list) and all(isinstance(b, int) for b in g) for g in value)


def int_value(value: object) -> int | None:
    """An ``extraConfig`` value as an integer (YAML may give ``"6301"``); None when it is not one."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def last_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` (``--flag v`` or ``--flag=v``), as vLLM's parser keeps the last."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
