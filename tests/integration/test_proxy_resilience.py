"""The proxy under change and damage: hot reload under load (ConfigMap ..data swap and plain
rewrite), killed backends, client disconnects, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.pdstack import (
    PDStack,
    decode_sim,
    eventually,
    http,
    module_stack,
    only_these_serve,
    prefill_sim,
    proxy_args,
    sse_events,
)
from tests.support.procs import Proc

BULK_TOKENS = 40000  # about 10 MB of events: past every buffer between the decode and the client
STALL_EVERY = 1 << 20  # the slow client stops reading after each MB it gets, a few times


stack = module_stack(
    "resilience",
    {
        **{"p0": prefill_sim(), "p1": prefill_sim(), "d0": decode_sim(), "d1": decode_sim()},
        "dlong": decode_sim(1, 1, "--itl-ms", "100", "--tokens", "30"),  # a 3 s stream
        "dbulk": decode_sim(1, 1, "--itl-ms", "0", "--tokens", str(BULK_TOKENS)),  # megabytes, fast
    },
    routed=(["p0"], ["d0"]),
)


def proxy_debug(proxy: Proc) -> dict[str, Any]:
    return http("GET", proxy.url + "/debug/routing").json()  # type: ignore[no-any-return]


def wait_generation(proxy: Proc, generation: int) -> None:
    eventually(lambda: proxy_debug(proxy)["generation"] == generation, timeout=5)


# --- hot reload under load ----------------------------------------------------------------------


async def run_load(url: str, stop: asyncio.Event, concurrency: int = 8) -> list[tuple[int, bool, bytes]]:
    results: list[tuple[int, bool, bytes]] = []
    async with aiohttp.ClientSession() as session:

        async def worker(n: int) -> None:
            while not stop.is_set():
                n += 1
                stream = n % 2 == 0
                body = {"prompt": "hi", "max_tokens": 3, "stream": stream}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    results.append((resp.status, stream, await resp.read()))

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return results


def assert_all_complete(results: list[tuple[int, bool, bytes]]) -> None:
    assert len(results) >= 40
    for status, stream, body in results:
        assert status == 200, body
        if stream:
            events = sse_events(body)
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
        else:
            assert json.loads(body)["choices"][0]["text"] == " tok0 tok1 tok2"


def publish_configmap(mount: Path, version: int, doc: dict[str, Any]) -> None:
    """What the kubelet does: a new timestamped directory, then an atomic swap of ``..data``."""
    target = mount / f"..2026_12_02_00_00_{version:02d}.000000001"
    target.mkdir()
    (target / "routing.json").write_text(json.dumps(doc))
    tmp_link = mount / "..data_tmp"
    tmp_link.symlink_to(target.name)
    os.replace(tmp_link, mount / "..data")
    if not (mount / "routing.json").is_symlink():
        (mount / "routing.json").symlink_to("..data/routing.json")


async def test_hot_reload_configmap_swap_under_load(stack: PDStack, tmp_path: Path) -> None:
    s = stack.sims
    mount = tmp_path / "routing"
    mount.mkdir()
    publish_configmap(mount, 1, stack.table([s["p0"]], [s["d0"]]))
    proxy = stack.group.start("proxy-configmap", proxy_args(mount / "routing.json"))
    stop = asyncio.Event()
    load = asyncio.create_task(run_load(proxy.url, stop))
    shapes = [
        ([s["p0"], s["p1"]], [s["d0"], s["d1"]]),
        ([s["p1"]], [s["d1"]]),
        ([s["p0"]], [s["d0"], s["d1"]]),
    ]
    for version, (prefill, decode) in enumerate(shapes, start=2):
        await asyncio.sleep(0.5)
        doc = stack.table(prefill, decode)
        publish_configmap(mount, version, doc)
        await asyncio.to_thread(wait_generation, proxy, doc["generation"])
    await asyncio.sleep(0.5)
    stop.set()
    assert_all_complete(await load)
    metrics = http("GET", proxy.url + "/metrics").body.decode()
    assert "pdserve_proxy_routing_reloads_total 4.0" in metrics
    assert "pdserve_proxy_routing_reload_errors_total 0.0" in metrics
    only_these_serve(stack, proxy.url, [s["p0"]], [s["d0"], s["d1"]])


async def test_hot_reload_plain_rewrite_under_load_keeps_the_last_good_table(
    stack: PDStack, tmp_path: Path
) -> None:
    s = stack.sims
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(stack.table([s["p0"]], [s["d0"]])))
    proxy = stack.group.start("proxy-rewrite", proxy_args(path))
    stop = asyncio.Event()
    load = asyncio.create_task(run_load(proxy.url, stop))
    await asyncio.sleep(0.5)
    doc = stack.table([s["p0"], s["p1"]], [s["d1"]])
    path.write_text(json.dumps(doc))  # in place: truncate, then write
    await asyncio.to_thread(wait_generation, proxy, doc["generation"])
    await asyncio.sleep(0.3)
    path.write_text('{"apiVersion": "pdserve.io/v1alpha1", "kind": "RoutingTable"')  # broken
    await asyncio.sleep(1.0)
    view = await asyncio.to_thread(proxy_debug, proxy)
    assert view["generation"] == doc["generation"] and "not valid JSON" in view["last_reload_error"]
    await asyncio.sleep(0.3)
    stop.set()
    assert_all_complete(await load)
    metrics = http("GET", proxy.url + "/metrics").body.decode()
    assert "pdserve_proxy_routing_reload_errors_total 1.0" in metrics
    only_these_serve(stack, proxy.url, [s["p0"], s["p1"]], [s["d1"]])


# --- damage -------------------------------------------------------------------------------------


def test_killed_backends_are_retried_and_ejected(stack: PDStack) -> None:
    s = stack.sims
    victim_p = stack.sim("victim-p", "prefill")
    victim_d = stack.sim("victim-d", "decode")
    stack.route([s["p0"], victim_p], [s["d0"], victim_d])
    for _ in range(4):
        assert stack.complete().status == 200
    victim_p.proc.kill()
    victim_d.proc.kill()
    prefills_before = s["p0"].stats()["by_leg"]["prefill"]
    for i in range(12):
        answer = stack.complete(stream=i % 2 == 1)
        assert answer.status == 200, answer.body
        if i % 2:
            assert sse_events(answer.body)[-1] == "[DONE]"
    assert stack.metric("pdserve_proxy_ejections_total", role="prefill", slot="victim-p/0") == 1
    assert stack.metric("pdserve_proxy_ejections_total", role="decode", slot="victim-d/0") == 1
    assert stack.metric("pdserve_proxy_retries_total", role="prefill") >= 1
    # no prefill was spent on the dead decode: a decode that refused got the prefill's handoff
    # again, and a retry found it dead before its new prefill (its connection is opened first)
    assert s["p0"].stats()["by_leg"]["prefill"] - prefills_before == 12
    rows = {row["slot"]: row for row in stack.debug()["slots"]["prefill"]}
    assert rows["victim-p/0"]["ejected_for_seconds"] > 0 and rows["p0/0"]["ejected_for_seconds"] == 0
    del stack.sims["victim-p"], stack.sims["victim-d"]
    stack.route([s["p0"]], [s["d0"]])


def raw_request(port: int, body: dict[str, Any], receive_buffer: int | None = None) -> socket.socket:
    """A request on a socket of its own; ``receive_buffer`` fixes the client's TCP window (set
    before the connect, so the kernel does not grow it)."""
    data = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_client_disconnect_mid_stream_cancels_the_decode(stack: PDStack) -> None:
    dlong = stack.sims["dlong"]
    stack.route([stack.sims["p0"]], [dlong])
    assert stack.proxy is not None
    sock = raw_request(stack.proxy.port, {"prompt": "x", "max_tokens": 30, "stream": True})
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    sock.close()
    eventually(lambda: dlong.stats()["cancelled"] == 1 and dlong.stats()["in_flight"] == 0)
    assert dlong.stats()["completed"] == 0
    eventually(lambda: stack.metric("pdserve_proxy_in_flight") == 0)
    assert stack.debug()["slots"]["decode"][0]["in_flight"] == 0
    assert stack.metric("pdserve_proxy_requests_total", outcome="cancelled") >= 1


def read_chunked(sock: socket.socket, stalls: int, stall_s: float) -> tuple[bytes, bytes]:
    """The head and the de-chunked body of one HTTP/1.1 response, read by a client that stops
    reading for ``stall_s`` seconds, ``stalls`` times, spread over the response's first MBs."""
    buffer = b""
    received = 0

    def more() -> None:
        nonlocal buffer, received
        data = sock.recv(65536)
        assert data, "the proxy closed the connection mid-response"
        buffer += data
        before, received = received, received + len(data)
        if before // STALL_EVERY < min(stalls, received // STALL_EVERY):
            time.sleep(stall_s)

    while b"\r\n\r\n" not in buffer:
        more()
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = []
    while True:
        while b"\r\n" not in buffer:
            more()
        size_line, _, buffer = buffer.partition(b"\r\n")
        size = int(size_line, 16)
        while len(buffer) < size + 2:
            more()
        assert buffer[size : size + 2] == b"\r\n", "chunk framing broken"
        if size == 0:
            return head, b"".join(body)
        body.append(buffer[:size])
        buffer = buffer[size + 2 :]


def test_a_slow_client_gets_a_long_stream_whole_and_in_order(stack: PDStack) -> None:
    """Chunks go to the client straight from the decode's connection while it keeps up, and
    through the serving task (uvicorn's flow control, then the decode's connection paused)
    while it does not: nothing is lost, repeated or reordered when the path switches, and the
    response is framed right. Each stall outlasts what the kernel buffers (4 MB here): the switch happens."""
    dbulk = stack.sims["dbulk"]
    stack.route([stack.sims["p0"]], [dbulk])
    assert stack.proxy is not None
    request = {"prompt": "x", "max_tokens": BULK_TOKENS, "stream": True}
    sock = raw_request(stack.proxy.port, request, receive_buffer=65536)
    try:
        head, body = read_chunked(sock, stalls=2, stall_s=1.5)
    finally:
        sock.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    events = sse_events(body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == "".join(f" tok{i}" for i in range(BULK_TOKENS))
    eventually(lambda: dbulk.stats()["in_flight"] == 0)
    assert dbulk.stats()["completed"] == 1


def test_client_disconnect_during_prefill_cancels_it_and_sends_no_decode(stack: PDStack) -> None:
    p0, dlong = stack.sims["p0"], stack.sims["dlong"]
    stack.route([p0], [dlong])
    p0.faults("hang")
    assert stack.proxy is not None
    sock = raw_request(stack.proxy.port, {"prompt": "x", "max_tokens": 3})
    eventually(lambda: p0.stats()["in_flight"] == 1)
    sock.close()
    eventually(lambda: p0.stats()["cancelled"] == 1 and p0.stats()["in_flight"] == 0)
    assert dlong.stats()["requests"] == 0
    p0.faults()
    eventually(lambda: stack.metric("pdserve_proxy_in_flight") == 0)


def stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": max_tokens, "stream": True}
        result["answer"] = http("POST", url + "/v1/completions", body)
        result["ended"] = time.monotonic()

    client = threading.Thread(target=stream)
    client.start()
    return client, result


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def assert_whole_stream(answer: Any, tokens: int) -> None:
    assert answer.status == 200
    events = sse_events(answer.body)
    assert events[-1] == "[DONE]" and len(events) == tokens + 1  # every token, then [DONE]


def test_sigterm_lets_in_flight_streams_finish(stack: PDStack, tmp_path: Path) -> None:
    """Default (no shutdown delay): connections are refused at once, the stream goes on."""
    dlong = stack.sims["dlong"]
    stack.route([stack.sims["p0"]], [dlong])
    proxy = stack.group.start("proxy-sigterm", proxy_args(stack.routing_file, "--grace-seconds", "20"))
    client, result = stream_in_background(proxy.url, 20)
    eventually(lambda: dlong.stats()["in_flight"] == 1)
    proxy.popen.send_signal(signal.SIGTERM)
    eventually(lambda: refused(proxy.port), timeout=5)
    assert "answer" not in result and dlong.stats()["in_flight"] == 1  # still streaming
    client.join(30)
    assert_whole_stream(result["answer"], 20)
    assert proxy.popen.wait(20) == 0
    assert refused(proxy.port)


def test_sigterm_turns_ready_503_at_once_then_stops_accepting(stack: PDStack) -> None:
    """With --shutdown-delay-seconds: /ready is 503 from the signal on while connections are
    still accepted (a load balancer sees the router leave), then new connections are refused,
    and the in-flight stream finishes within the grace period."""
    dlong = stack.sims["dlong"]
    stack.route([stack.sims["p0"]], [dlong])
    args = proxy_args(stack.routing_file, "--shutdown-grace-seconds", "20", "--shutdown-delay-seconds", "1")
    proxy = stack.group.start("proxy-sigterm-delay", args)
    assert http("GET", proxy.url + "/ready").status == 200
    client, result = stream_in_background(proxy.url, 30)  # 3 s at 100 ms per token
    eventually(lambda: dlong.stats()["in_flight"] == 1)
    signalled = time.monotonic()
    proxy.popen.send_signal(signal.SIGTERM)
    # With --workers the supervisor takes the signal and passes it on, so the first probe may
    # still reach a worker that has not had it: poll, each probe on a new connection.
    answer = http("GET", proxy.url + "/ready")
    while answer.status == 200 and time.monotonic() - signalled < 0.5:
        time.sleep(0.02)
        answer = http("GET", proxy.url + "/ready")
    assert answer.status == 503 and answer.json()["reason"].startswith("shutting down (SIGTERM)")
    assert time.monotonic() - signalled < 1.0  # answered during the delay, on a new connection
    eventually(lambda: refused(proxy.port), timeout=5)
    stopped_accepting = time.monotonic()
    assert "answer" not in result  # the stream outlives the listener
    client.join(30)
    assert_whole_stream(result["answer"], 30)
    assert result["ended"] > stopped_accepting
    assert proxy.popen.wait(20) == 0
    assert "SIGTERM: not ready from now on; stop accepting in 1 s" in proxy.log()


def test_routing_served_counts_a_stream_on_an_instance_that_left_the_table(stack: PDStack) -> None:
    s = stack.sims
    dlong = s["dlong"]
    stack.route([s["p0"]], [dlong])
    assert stack.proxy is not None
    url = stack.proxy.url
    eventually(lambda: dlong.stats()["in_flight"] == 0)  # no stream of an earlier test left on it
    client, result = stream_in_background(url, 30)
    eventually(lambda: dlong.stats()["in_flight"] == 1)
    view = http("GET", url + "/routing/served").json()
    assert view["instances"]["dlong"] == {
        "role": "decode",
        "in_table": True,
        "routable": True,
        "in_flight": 1,
    }
    stack.write(stack.table([s["p0"]], [s["d0"]]))  # a table without dlong; its stream goes on
    view = http("GET", url + "/routing/served").json()
    assert view["generation"] == stack.generation and view["source"] == f"file {stack.routing_file}"
    assert view["routable"] == {"prefill": 1, "decode": 1}
    assert view["instances"]["dlong"] == {
        "role": "decode",
        "in_table": False,
        "routable": False,
        "in_flight": 1,
    }
    assert {"role": "decode", "instance": "dlong", "dp_rank": 0, "in_flight": 1} in view["slots"]
    assert view["instances"]["d0"] == {"role": "decode", "in_table": True, "routable": True, "in_flight": 0}
    assert view["instances"]["p0"]["in_flight"] == 0  # the prefill's KV was pulled at the first byte
    client.join(30)
    assert_whole_stream(result["answer"], 30)
    view = http("GET", url + "/routing/served").json()
    assert "dlong" not in view["instances"]  # 0 in flight: no longer listed
    assert all(row["instance"] != "dlong" for row in view["slots"])
