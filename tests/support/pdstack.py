"""A P/D stack on loopback for proxy tests: real `pdserve sim` processes, a routing file, a real
`pdserve proxy`, and small HTTP helpers (stdlib for single calls, aiohttp for concurrency).

Module-scoped stacks keep the suite lean: processes start once per module, tests rewrite the
routing file (the proxy hot-reloads it) and call POST /sim/reset so counts stay exact. A test
module makes its stack with the ``pd_stack`` factory fixture: the simulators it names, the first
table, the router's flags; every process of the module stops at its end.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdserve.proxy.settings import ServerSettings
from pdserve.wire.headers import ERROR_REASON
from pdserve.wire.openai import error_type
from tests.support.procs import Proc, ProcessGroup, wait_http

# Tiny simulated timings: the proxy's logic is under test, not the model.
FAST_SIM = ["--ttft-ms", "2", "--itl-ms", "1", "--tokens", "4"]

# The proxy suite runs against either HTTP server (default: the proxy's own default):
# PDSERVE_TEST_HTTP_SERVER=hypercorn pytest ...
TEST_HTTP_SERVER = os.environ.get("PDSERVE_TEST_HTTP_SERVER", ServerSettings().http_server)
# ... and with one or several worker processes: PDSERVE_TEST_PROXY_WORKERS=2 pytest ... (make test-workers)
TEST_WORKERS = os.environ.get("PDSERVE_TEST_PROXY_WORKERS", "1")


def proxy_args(routing_file: Path, *extra: str) -> list[str]:
    """``pdserve proxy`` arguments for a test proxy, on the HTTP server and with the workers the
    suite was asked for."""
    return [
        "proxy",
        "--routing-file",
        str(routing_file),
        "--http-server",
        TEST_HTTP_SERVER,
        "--workers",
        TEST_WORKERS,
        *extra,
    ]


def workers_of(args: Sequence[str]) -> int:
    """The worker processes a proxy's arguments ask for (the last ``--workers`` wins, as in argparse)."""
    given = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--workers"]
    return int(given[-1]) if given else 1


def configmap_proxy_args(configmap: str, kubeconfig: Path, *extra: str) -> list[str]:
    """The same for a proxy that watches ``NAMESPACE/NAME`` through the API server."""
    source = ["--routing-configmap", configmap, "--kubeconfig", str(kubeconfig)]
    server = ["--http-server", TEST_HTTP_SERVER, "--workers", TEST_WORKERS]
    return ["proxy", *source, "--host", "127.0.0.1", *server, *extra]


@dataclass
class HttpAnswer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    method: str,
    url: str,
    body: object = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 30.0,
) -> HttpAnswer:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return HttpAnswer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as exc:
        return HttpAnswer(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


@dataclass
class Sim:
    name: str
    role: str
    dp_size: int
    tp_size: int
    proc: Proc
    kv_address: str

    @property
    def url(self) -> str:
        return self.proc.url

    def stats(self) -> dict[str, Any]:
        return http("GET", self.url + "/sim/stats").json()  # type: ignore[no-any-return]

    def reset(self) -> None:
        assert http("POST", self.url + "/sim/reset").status == 200

    def faults(self, *specs: str) -> None:
        answer = http("POST", self.url + "/sim/faults", {"faults": list(specs)})
        assert answer.status == 200, answer.body

    def instance(
        self, ready: bool = True, draining: bool = False, revision: str | None = None
    ) -> dict[str, Any]:
        doc = {
            "name": self.name,
            "url": self.url,
            "dpSize": self.dp_size,
            "tpSize": self.tp_size,
            "ready": ready,
            "draining": draining,
            "kvAddress": self.kv_address,
        }
        if revision is not None:
            doc["revision"] = revision
        return doc

    def legs(self) -> list[dict[str, Any]]:
        """The simulator's record of each request it took, oldest first."""
        return list(self.stats()["recent"])


@dataclass
class PDStack:
    group: ProcessGroup
    directory: Path
    sims: dict[str, Sim] = field(default_factory=dict)
    proxy: Proc | None = None
    generation: int = 0
    admin_headers: dict[str, str] = field(default_factory=dict)  # e.g. the proxy's --api-key

    @property
    def routing_file(self) -> Path:
        return self.directory / "routing.json"

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def sim(
        self,
        name: str,
        role: str,
        dp_size: int = 1,
        tp_size: int = 1,
        extra: Sequence[str] = (),
        wait: bool = True,
        env: dict[str, str] | None = None,
        kv_port: int | None = None,
    ) -> Sim:
        """Start a simulator; with ``wait=False`` call :meth:`wait_sims` later (parallel start-up)."""
        kv_port = kv_port or 20000 + len(self.sims)
        args = ["sim", "--role", role, "--dp-size", str(dp_size), "--tp-size", str(tp_size)]
        args += ["--instance-name", name, "--kv-port", str(kv_port), *FAST_SIM, *extra]
        proc = self.group.start(name, args, health="/health" if wait else None, env=env)
        sim = Sim(name, role, dp_size, tp_size, proc, f"127.0.0.1:{kv_port}")
        self.sims[name] = sim
        return sim

    def wait_sims(self) -> None:
        for sim in self.sims.values():
            wait_http(sim.url + "/health", timeout=60, proc=sim.proc.popen)

    def table(
        self,
        prefill: Sequence[Sim | dict[str, Any]],
        decode: Sequence[Sim | dict[str, Any]],
        connector: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.generation += 1
        return {
            "apiVersion": "pdserve.io/v1alpha1",
            "kind": "RoutingTable",
            "deployment": "test",
            "generation": self.generation,
            "connector": connector or {"type": "nixl"},
            "prefill": [s.instance() if isinstance(s, Sim) else s for s in prefill],
            "decode": [s.instance() if isinstance(s, Sim) else s for s in decode],
        }

    def write(self, doc: dict[str, Any], wait: bool = True) -> None:
        """Replace the routing file atomically (write + rename) and wait until the proxy serves it."""
        tmp = self.routing_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.routing_file)
        if wait and self.proxy is not None:
            self.wait_generation(doc["generation"])

    def route(
        self,
        prefill: Sequence[Sim | dict[str, Any]],
        decode: Sequence[Sim | dict[str, Any]],
        connector: dict[str, Any] | None = None,
    ) -> None:
        self.write(self.table(prefill, decode, connector))
        for sim in self.sims.values():
            sim.faults()
            sim.reset()

    def start_proxy(self, *extra: str, env: dict[str, str] | None = None) -> Proc:
        assert self.routing_file.exists(), "write a routing table first"
        args = proxy_args(self.routing_file, "--host", "127.0.0.1", *extra)
        self.proxy = self.group.start("proxy", args, env=env)
        if workers_of(args) > 1:
            # the port answers once one worker listens; an admin view of the whole router (503
            # until every worker's socket answers) says they all do
            eventually(
                lambda: http("GET", self.url + "/debug/routing", headers=self.admin_headers).status == 200
            )
        return self.proxy

    def wait_generation(self, generation: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.debug().get("generation") == generation:
                return
            time.sleep(0.05)
        raise TimeoutError(f"proxy did not load generation {generation}: {self.debug()}")

    def debug(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        return http("GET", self.url + "/debug/routing", headers=headers or self.admin_headers).json()  # type: ignore[no-any-return]

    def metric(self, name: str, **labels: str) -> float:
        return proxy_metric(self.url, name, **labels)

    def complete(
        self, stream: bool = False, headers: dict[str, str] | None = None, **body: Any
    ) -> HttpAnswer:
        payload = {"prompt": "hello", "max_tokens": 3, "stream": stream, **body}
        return http("POST", self.url + "/v1/completions", payload, headers=headers)


@dataclass(frozen=True)
class SimSpec:
    """One simulator of a stack: its role, DP and TP sizes, ``pdserve sim`` flags and environment."""

    role: str
    dp_size: int = 1
    tp_size: int = 1
    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kv_port: int | None = None


def prefill_sim(dp: int = 1, tp: int = 1, *extra: str) -> SimSpec:
    return SimSpec("prefill", dp, tp, extra)


def decode_sim(dp: int = 1, tp: int = 1, *extra: str) -> SimSpec:
    return SimSpec("decode", dp, tp, extra)


#: ``pd_stack(label, sims, routed=None, proxy=(), env=None, admin_headers=None)``
StackFactory = Callable[..., PDStack]


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFactory]:
    """Makes the router + simulators stacks of one test module; their processes stop at its end.

    ``pd_stack(label, sims, routed=(prefill names, decode names), proxy=flags)``: the simulators
    start in parallel, in ``sims``' order; the first routing table routes ``routed`` (none:
    the test writes one); the router starts with ``proxy``'s flags once there is a table
    (None: the test starts it), with ``env`` added to its environment."""
    groups: list[ProcessGroup] = []

    def make(
        label: str,
        sims: Mapping[str, SimSpec],
        routed: tuple[Sequence[str], Sequence[str]] | None = None,
        proxy: Sequence[str] | None = (),
        env: dict[str, str] | None = None,
        admin_headers: dict[str, str] | None = None,
    ) -> PDStack:
        group = ProcessGroup(Path(tmp_path_factory.mktemp(f"pd-{label}")))
        groups.append(group)
        stack = PDStack(group, group.log_dir, admin_headers=admin_headers or {})
        for name, spec in sims.items():
            stack.sim(
                name, spec.role, spec.dp_size, spec.tp_size, spec.extra, False, dict(spec.env), spec.kv_port
            )
        stack.wait_sims()
        if routed is not None:
            names_p, names_d = routed
            stack.write(stack.table([stack.sims[n] for n in names_p], [stack.sims[n] for n in names_d]))
            if proxy is not None:
                stack.start_proxy(*proxy, env=env)
        return stack

    try:
        yield make
    finally:
        for group in groups:
            group.stop_all()


def module_stack(
    label: str,
    sims: Mapping[str, SimSpec],
    routed: tuple[Sequence[str], Sequence[str]] | None = None,
    proxy: Sequence[str] | None = (),
    **options: Any,
) -> Any:
    """A test module's ``stack`` fixture, made by :func:`pd_stack` once for the module, e.g.
    ``stack = module_stack("x", {"p0": prefill_sim(), "d0": decode_sim()}, routed=(["p0"], ["d0"]))``."""

    @pytest.fixture(scope="module")
    def stack(pd_stack: StackFactory) -> PDStack:
        return pd_stack(label, sims, routed, proxy, **options)

    return stack


def send_requests(url: str, n: int, prefix: str = "req") -> None:
    """``n`` requests, every other one streamed, each with its own X-Request-Id
    (``<prefix>-<i>``); every one must succeed (a stream up to its ``[DONE]``)."""
    for i in range(n):
        stream = i % 2 == 1
        body = {"prompt": "hello", "max_tokens": 3, "stream": stream}
        answer = http("POST", url + "/v1/completions", body, headers={"X-Request-Id": f"{prefix}-{i}"})
        assert answer.status == 200, answer.body
        if stream:
            assert sse_events(answer.body)[-1] == "[DONE]"


def proxy_metric(url: str, name: str, **labels: str) -> float:
    """Sum of a proxy metric's samples whose labels include ``labels``."""
    text = http("GET", url + "/metrics").body.decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, label_text = head.partition("{")
        if metric_name == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def only_these_serve(stack: PDStack, proxy_url: str, prefill: Sequence[Sim], decode: Sequence[Sim]) -> None:
    """2·P·D requests through the proxy reach exactly the given slots, each its exact share."""
    for sim in stack.sims.values():
        sim.reset()
    n = 2 * len(prefill) * len(decode)
    for _ in range(n):
        answer = http("POST", proxy_url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert answer.status == 200, answer.body
    for name, sim in stack.sims.items():
        expected = n // len(prefill) if sim in prefill else n // len(decode) if sim in decode else 0
        assert sim.stats()["requests"] == expected, name


def vllm_error(status: int, body: bytes | str) -> dict[str, Any]:
    """The ``error`` of a body the router sent, checked to be vLLM's shape: exactly message,
    type, param and an integer ``code`` equal to the status, ``type`` the router's one name for
    the status (vLLM's ``Bad Request`` renamed, pdserve.wire.openai)."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert type(error["code"]) is int and error["code"] == status, error
    assert error["type"] == error_type(status), error
    assert isinstance(error["message"], str) and error["message"], error
    return error  # type: ignore[no-any-return]


def router_error(answer: HttpAnswer) -> tuple[str, dict[str, Any]]:
    """(reason, error) of an error the router answered itself: vLLM's body, and pdserve's reason
    in the X-PDServe-Error header."""
    reason = answer.headers.get(ERROR_REASON.lower())
    assert reason, f"no {ERROR_REASON} header: {answer.headers}"
    return reason, vllm_error(answer.status, answer.body)


def sse_error(event: str, status: int) -> dict[str, Any]:
    """An error event of a stream, in vLLM's shape with ``code`` = ``status``."""
    return vllm_error(status, event)


def sse_events(body: bytes) -> list[str]:
    """The data payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in body.decode().split("\n") if line.startswith("data: ")]


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``check`` until it holds; an exception from it fails the test at once."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)
