"""Everything the router is configured with: one frozen dataclass per concern.

Each field is written once, with its default, its flag, the environment variable that may give
its default, and its help (pdserve.argtypes.setting): ``pdserve proxy``'s flags are generated from
these fields (pdserve.proxy.cli), so a default cannot differ between the CLI and the code, and every help
line shows it. Values are checked where they are made (``__post_init__``): a bad flag,
environment variable or argument is refused naming the flag, before anything starts. A policy's
options are declared so in its own module (prefix-affinity's: PrefixOptions), and grouped here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.argtypes import Checked, SettingsError, port_or_unset, setting
from pdserve.proxy.policies import DEFAULT_POLICY, POLICIES, PREFILL_POLICIES, PrefixOptions
from pdserve.routing.sidecar import LocalDecode
from pdserve.tracing.endpoint import EndpointError, OtlpEndpoint, parse_endpoint

if TYPE_CHECKING:  # the ConfigMap source's types; the file source never imports them
    from pdserve.proxy.table.kubeconfig import ApiCredentials, ConfigMapRef

#: The ASGI servers the router can run on (pdserve.proxy.serving.server has one function per
#: name). uvicorn (httptools) by default: Hypercorn's h11 stack costs more CPU per request and
#: per streamed chunk, and no Hypercorn setting removes it (bench/results/latest.md).
HTTP_SERVERS = ("hypercorn", "uvicorn")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ListenSettings(Checked):
    """Where the router listens: the client port, and optionally an admin port."""

    host: str = setting("0.0.0.0", "--host", env="PDSERVE_PROXY_HOST", help="address to listen on")
    port: int = setting(8000, "--port", env="PDSERVE_PROXY_PORT", minimum=1, help="port to listen on")
    admin_port: int | None = setting(
        None,
        "--admin-port",
        env="PDSERVE_PROXY_ADMIN_PORT",
        type=port_or_unset,
        minimum=1,
        help="also listen here, and serve /metrics, /debug/* and profiling only here (the client port "
        "answers 404 for them; /health, /ready and /routing/served answer on both)",
    )
    admin_host: str | None = setting(
        None,
        "--admin-host",
        env="PDSERVE_PROXY_ADMIN_HOST",
        help="address of the admin port; unset: --host's. E.g. --host 127.0.0.1 --admin-host 0.0.0.0 "
        "keeps the API to the pod while probes and scrapers reach the admin port",
    )
    backlog: int = setting(
        4096,
        "--backlog",
        env="PROXY_LISTEN_BACKLOG",
        minimum=1,
        help="listen backlog: connections the kernel queues during a burst",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.admin_port is not None and self.admin_port == self.port:
            raise SettingsError(f"--admin-port must differ from --port ({self.port})")


@dataclass(frozen=True)
class ServerSettings(Checked):
    """The HTTP server and the processes that run it."""

    http_server: str = setting(
        "uvicorn",
        "--http-server",
        env="PROXY_HTTP_SERVER",
        choices=HTTP_SERVERS,
        help="ASGI server: uvicorn with httptools (less CPU per request), or hypercorn; both on uvloop "
        "with the same backlog, keep-alive and grace period",
    )
    workers: int = setting(
        0,
        "--workers",
        env="PDSERVE_PROXY_WORKERS",
        minimum=0,
        help="worker processes sharing the port (SO_REUSEPORT), one routing counter per role in shared "
        "memory; 0: the CPUs available to the process (affinity and cgroup cpu.max)",
    )
    keep_alive_seconds: float = setting(
        300.0,
        "--keep-alive-seconds",
        minimum=0,
        help="how long an idle client connection is kept open between requests",
    )
    grace_seconds: float = setting(
        120.0,  # a long generation runs for minutes
        "--shutdown-grace-seconds",
        "--grace-seconds",
        env="PDSERVE_PROXY_SHUTDOWN_GRACE_SECONDS",
        minimum=0,
        help="on SIGTERM: stop accepting, let in-flight requests and streams finish this long, then "
        "cancel them",
    )
    shutdown_delay_seconds: float = setting(
        0.0,
        "--shutdown-delay-seconds",
        env="PDSERVE_PROXY_SHUTDOWN_DELAY_SECONDS",
        minimum=0,
        help="on SIGTERM: /ready answers 503 at once, but connections are still accepted this long "
        "before the grace period starts; for load balancers without a pod preStop hook",
    )
    log_level: str = setting(
        "info",
        "--log-level",
        env="PDSERVE_PROXY_LOG_LEVEL",
        choices=LOG_LEVELS,
        help="log level; info logs one line per request",
    )


@dataclass(frozen=True)
class TableSettings(Checked):
    """Where the routing table comes from: exactly one source, a watched file or a ConfigMap.

    The source's flags (``--routing-file``, ``--routing-configmap``, ``--kubeconfig``) are the
    CLI's (pdserve.proxy.cli.table_source): the ConfigMap's reference and credentials are
    resolved there, once, so a bad kubeconfig stops the start with its file's name.
    """

    routing_file: Path | None = None
    routing_configmap: ConfigMapRef | None = None
    kube: ApiCredentials | None = None
    reload_interval: float = setting(
        0.2, "--reload-interval", minimum=0.001, help="seconds between checks of the routing file"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.routing_file is None) == (self.routing_configmap is None):
            raise SettingsError("give one routing table source: --routing-file or --routing-configmap")
        if self.routing_configmap is not None and self.kube is None:
            raise SettingsError("--routing-configmap needs credentials for the API server")

    @property
    def source(self) -> str:
        """The table source, for logs and ``/routing/served``."""
        if self.routing_configmap is not None:
            return f"configmap {self.routing_configmap}"
        return f"file {self.routing_file}"


@dataclass(frozen=True)
class SidecarSettings(Checked):
    """Decode-sidecar mode (``--local-decode``): the router inside a decode pod (pdserve.routing.sidecar)."""

    url: str | None = setting(
        None,
        "--local-decode",
        env="PDSERVE_LOCAL_DECODE",
        metavar="URL",
        help="decode-sidecar mode: send every decode leg to this engine (http://$(POD_IP):8000 in a decode "
        "pod: its own engine) and walk its DP ranks here; prefills come from the routing table. /ready "
        "then also needs the engine's /health",
    )
    dp_size: int = setting(
        1,
        "--local-dp-size",
        minimum=1,
        help="with --local-decode: the local engine's data-parallel size: its local ranks on a node of a "
        "multi-node instance with an API server per node",
    )
    first_rank: int = setting(
        0,
        "--local-first-rank",
        minimum=0,
        help="with --local-decode: the global DP rank of the local engine's first rank (a node of a "
        "multi-node instance with an API server per node: its --data-parallel-start-rank); its slots "
        "keep their global ranks and carry local ranks in X-data-parallel-rank",
    )
    revision: str = setting(
        "",
        "--local-revision",
        help="with --local-decode: the local engine's pairing revision; only prefills of this revision "
        "are used; empty: the unversioned revision",
    )
    name: str = setting(
        "",
        "--local-name",
        env="POD_NAME",
        help="with --local-decode: this pod's name in the routing table (draining, kvAddress; the "
        "slot name in metrics)",
    )
    instance_index: int = setting(
        0,
        "--instance-index",
        env="PDSERVE_INSTANCE_INDEX",
        minimum=0,
        help="with --local-decode: this decode instance's index; the prefill walk starts at "
        "index * prefill slots / decode instances, so equal traffic per decode pod gives every prefill "
        "slot an exact share",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise SettingsError(
                f"--local-decode: expected an http(s) URL such as http://127.0.0.1:8000, got {self.url!r}"
            )

    @property
    def local(self) -> LocalDecode | None:
        """The local engine every decode leg goes to; None when the router is not a sidecar."""
        if not self.url:
            return None
        return LocalDecode(
            self.url, self.dp_size, self.revision, self.name, self.instance_index, self.first_rank
        )


@dataclass(frozen=True)
class RetrySettings(Checked):
    """How a request survives a failed leg: how often it is tried again, and what is skipped."""

    max_retries: int = setting(
        2,
        "--max-retries",
        env="PDSERVE_PROXY_MAX_RETRIES",
        minimum=0,
        help="extra attempts on other slots after a connect error, 5xx, deadline or bad KV handoff, "
        "before anything was sent to the client",
    )
    eject_seconds: float = setting(
        10.0,
        "--eject-seconds",
        minimum=0,
        help="cool-down of a failed slot: it is tried only after every healthy slot",
    )
    # vLLM's NIXL KV lease (kv_lease_duration, 30 s; VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s, before leases).
    kv_lease_seconds: float = setting(
        30.0,
        "--kv-lease-seconds",
        minimum=0,
        help="how long a prefill keeps its KV for the decode (vLLM NIXL's kv_lease_duration; 480 for "
        "vLLM before leases, its VLLM_NIXL_ABORT_REQUEST_TIMEOUT): a decode that could not be reached "
        "is retried with the same KV while less than half of it has passed, else after a new prefill; "
        "0 always re-prefills",
    )


@dataclass(frozen=True)
class DeadlineSettings(Checked):
    """How long each step may take. Real models need minutes for a long prompt's prefill or a busy
    decode's first token, so the deadlines only catch what is truly stuck."""

    prefill_ttfb: float = setting(
        600.0,
        "--prefill-ttfb-timeout",
        minimum=0.001,
        help="seconds a prefill may take to answer (a long prompt takes minutes) before it is cancelled "
        "and retried elsewhere",
    )
    decode_ttfb: float = setting(
        600.0,
        "--decode-ttfb-timeout",
        minimum=0.001,
        help="seconds until the decode's first byte (its whole answer when not streaming) before it is "
        "cancelled and retried",
    )
    stream_idle: float = setting(
        120.0,
        "--stream-idle-timeout",
        minimum=0.001,
        help="seconds allowed between two chunks of a stream before it is cancelled and ended with an "
        "error event",
    )
    connect: float = setting(
        5.0, "--connect-timeout", minimum=0.001, help="seconds to open a TCP connection to a backend"
    )


@dataclass(frozen=True)
class AdmissionSettings(Checked):
    """Back-pressure: legs in flight per slot, and the queue of requests waiting for room."""

    # vLLM runs up to max_num_seqs (256 by default) at once per rank and queues the rest itself;
    # twice that leaves the engine its own queue while a flood of clients cannot open thousands of
    # connections to one rank.
    max_per_slot: int = setting(
        512,
        "--max-per-slot",
        env="PDSERVE_PROXY_MAX_PER_SLOT",
        minimum=0,
        help="most legs in flight per slot (one engine rank), router-wide; a request whose slots are "
        "full waits in the admission queue; 0: no limit",
    )
    queue: int = setting(
        8192,
        "--admission-queue",
        minimum=0,
        help="requests that may wait for a slot with room (per worker); more get 429 with Retry-After",
    )
    timeout: float = setting(
        60.0,
        "--admission-timeout",
        minimum=0,
        help="seconds a request may wait in the admission queue before it gets 429",
    )


@dataclass(frozen=True)
class RequestSettings(Checked):
    """What a client request may be, and the keys on either side of the router."""

    max_body_bytes: int = setting(
        32 * 1024 * 1024, "--max-body-bytes", minimum=1, help="larger request bodies get 413"
    )
    # OpenAI's own limit for n.
    max_sequences: int = setting(
        128,
        "--max-fan-out",
        minimum=1,
        help="most sequences (prompts x n) one request may ask for; each is its own prefill/decode "
        "request, merged in the answer; more gets 400",
    )
    api_key: str | None = setting(
        None,
        "--api-key",
        env="PDSERVE_PROXY_API_KEY",
        help="if set, clients must send 'Authorization: Bearer <key>' (401 otherwise); /health, /ready "
        "and /metrics stay open",
    )
    backend_api_key: str | None = setting(
        None,
        "--backend-api-key",
        env="PDSERVE_BACKEND_API_KEY",
        help="key sent to the vLLM backends; without it the client's Authorization header is forwarded",
    )


@dataclass(frozen=True)
class TracingSettings(Checked):
    """OpenTelemetry traces of the generation requests (docs/operations.md#tracing): off without
    an endpoint, and then nothing of OpenTelemetry is loaded."""

    endpoint: str | None = setting(
        None,
        "--otlp-traces-endpoint",
        env="PDSERVE_PROXY_OTLP_TRACES_ENDPOINT",
        metavar="URL",
        help="send a trace of every sampled request here: http(s)://HOST:PORT/v1/traces for OTLP over "
        "HTTP, grpc://HOST:PORT for OTLP over gRPC (grpcs:// with TLS); the SDK's OTEL_* variables "
        "(service name, headers, timeouts, batching) apply. Needs the tracing extra (pdserve[tracing])",
    )
    sampling_ratio: float = setting(
        1.0,
        "--trace-sampling-ratio",
        env="PDSERVE_PROXY_TRACE_SAMPLING_RATIO",
        minimum=0,
        metavar="RATIO",
        help="with --otlp-traces-endpoint: the share of requests traced, 0 to 1, decided when a request "
        "starts a trace; a request whose client sent a traceparent follows that parent's decision",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sampling_ratio > 1:
            raise SettingsError(
                f"--trace-sampling-ratio: expected a value from 0 to 1, got {self.sampling_ratio}"
            )
        if self.endpoint is not None:
            try:
                parse_endpoint(self.endpoint)
            except EndpointError as exc:
                raise SettingsError(f"--otlp-traces-endpoint: {exc}") from None

    @property
    def otlp(self) -> OtlpEndpoint | None:
        """Where spans go; None: the router does not trace."""
        return parse_endpoint(self.endpoint) if self.endpoint else None


@dataclass(frozen=True)
class ProxySettings(Checked):
    """The router's whole configuration: built by the CLI, or by tests and benches directly."""

    table: TableSettings
    policy: str = setting(
        DEFAULT_POLICY,
        "--policy",
        env="PDSERVE_PROXY_POLICY",
        choices=tuple(sorted(POLICIES)),
        help="slot choice: flat-interleaved gives every slot exactly one request per cycle; "
        "least-outstanding picks the slot with the fewest in-flight requests",
    )
    prefill_policy: str | None = setting(
        None,
        "--prefill-policy",
        env="PDSERVE_PROXY_PREFILL_POLICY",
        choices=PREFILL_POLICIES,
        help="the prefill slots' choice, when it differs from --policy's: prefix-affinity sends a prompt to "
        "the slot that already holds its longest prefix, among the slots whose load stays within "
        "--prefix-balance, and otherwise to the flat interleave's slot; the decode keeps --policy's; "
        "unset: --policy's",
    )
    listen: ListenSettings = field(default_factory=ListenSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    sidecar: SidecarSettings = field(default_factory=SidecarSettings)
    retries: RetrySettings = field(default_factory=RetrySettings)
    deadlines: DeadlineSettings = field(default_factory=DeadlineSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    requests: RequestSettings = field(default_factory=RequestSettings)
    prefix: PrefixOptions = field(default_factory=PrefixOptions)
    tracing: TracingSettings = field(default_factory=TracingSettings)


#: The concerns in the order ``pdserve proxy --help`` lists them: (ProxySettings field, title, class).
GROUPS: tuple[tuple[str, str, type], ...] = (
    ("listen", "listening", ListenSettings),
    ("server", "server and processes", ServerSettings),
    ("table", "routing table", TableSettings),
    ("sidecar", "decode sidecar", SidecarSettings),
    ("retries", "retries", RetrySettings),
    ("deadlines", "deadlines", DeadlineSettings),
    ("admission", "admission (back-pressure)", AdmissionSettings),
    ("requests", "requests and keys", RequestSettings),
    ("prefix", "prefix affinity (--prefill-policy prefix-affinity)", PrefixOptions),
    ("tracing", "tracing (OpenTelemetry)", TracingSettings),
)
