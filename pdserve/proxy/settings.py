"""Everything the proxy is configured with, in one typed value (built by the CLI or by tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.proxy.policies import DEFAULT_POLICY
from pdserve.proxy.serving.worker_views import WorkerInfo
from pdserve.routing.sidecar import LocalDecode

if TYPE_CHECKING:  # the ConfigMap source's types; the file source never imports them
    from pdserve.proxy.table.kubeconfig import ApiCredentials, ConfigMapRef

# Defaults suit real models: a long prompt's prefill or a busy decode's first token can take
# minutes, so deadlines only catch what is truly stuck.
DEFAULT_PREFILL_TTFB_S = 600.0
DEFAULT_DECODE_TTFB_S = 600.0
DEFAULT_STREAM_IDLE_S = 120.0
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# vLLM's NIXL KV lease (kv_lease_duration, 30 s; VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s, before leases).
DEFAULT_KV_LEASE_S = 30.0
# Sequences one request may ask for (prompts x n): OpenAI's own limit for n.
DEFAULT_MAX_FAN_OUT = 128
# The ASGI servers the proxy can run on (pdserve.proxy.serving.server has one function per name).
# uvicorn (httptools) by default: Hypercorn's h11 protocol stack cost about a third more CPU per
# request and per streamed chunk, and no Hypercorn setting removes it (bench/results/latest.md).
HTTP_SERVERS = ("hypercorn", "uvicorn")
DEFAULT_HTTP_SERVER = "uvicorn"
# Legs in flight per slot (one engine rank). vLLM runs up to ``max_num_seqs`` (256 by
# default) at once per rank and queues the rest itself; twice that leaves the engine its own
# queue while a flood of clients cannot open thousands of connections to one rank.
DEFAULT_MAX_PER_SLOT = 512
# Requests that may wait for room; more are shed at once.
DEFAULT_QUEUE_SIZE = 8192
# Seconds a request may wait for room before it is shed.
DEFAULT_QUEUE_TIMEOUT_S = 60.0
# On SIGTERM in-flight streams get this long to finish: a long generation runs for minutes.
DEFAULT_SHUTDOWN_GRACE_S = 120.0


@dataclass(frozen=True)
class ProxySettings:
    """Exactly one table source: ``routing_file``, or ``routing_configmap`` with ``kube``."""

    routing_file: Path | None = None
    routing_configmap: ConfigMapRef | None = None
    kube: ApiCredentials | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    policy: str = DEFAULT_POLICY
    http_server: str = DEFAULT_HTTP_SERVER
    backlog: int = 4096
    max_retries: int = 2
    kv_lease_seconds: float = DEFAULT_KV_LEASE_S
    max_fan_out: int = DEFAULT_MAX_FAN_OUT
    eject_seconds: float = 10.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    backend_api_key: str | None = None
    prefill_ttfb_timeout: float = DEFAULT_PREFILL_TTFB_S
    decode_ttfb_timeout: float = DEFAULT_DECODE_TTFB_S
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_S
    connect_timeout: float = 5.0
    keep_alive_seconds: float = 300.0
    grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_S
    shutdown_delay_seconds: float = 0.0
    reload_interval: float = 0.2
    log_level: str = "info"
    #: Metrics, /debug/* and profiling on this port only (ports.py); None: all on ``port``.
    admin_port: int | None = None
    #: The admin port's address; None: ``host`` (a client sidecar keeps its client port on
    #: localhost and its admin port, with the probes, on the pod's address).
    admin_host: str | None = None
    #: Decode-sidecar mode: every decode leg goes to this local engine (pdserve.proxy.admin.readiness).
    local_decode: LocalDecode | None = None
    #: Legs in flight per slot, router-wide (the workers count them in shared memory); 0: no limit.
    max_per_slot: int = DEFAULT_MAX_PER_SLOT
    #: Requests that may wait for a slot with room (per worker), and for how long.
    admission_queue: int = DEFAULT_QUEUE_SIZE
    admission_timeout: float = DEFAULT_QUEUE_TIMEOUT_S
    #: Worker processes (pdserve.proxy.serving.workers); 1 serves in this process.
    workers: int = 1
    #: Set in each worker process by pdserve.proxy.serving.workers (None: the only process).
    worker: WorkerInfo | None = None

    @property
    def source(self) -> str:
        """The table source, for logs and ``/routing/served``."""
        if self.routing_configmap is not None:
            return f"configmap {self.routing_configmap}"
        return f"file {self.routing_file}"
