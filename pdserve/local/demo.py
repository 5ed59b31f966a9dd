"""`make demo`: pdserve working on this machine in under a minute, with nothing but Python.

It runs `pdserve up` (simulated engines) on the 2P_DP8EP:3D_DP8EP NIXL example: two prefill
instances of 8 data-parallel ranks and three decode instances of 8, so 16 prefill and 24
decode slots. It sends a burst of completions through the router, prints how many requests
each slot got (as the router counted them and as each engine counted them), writes a PNG
chart of it, and stops everything.

The point it shows: one counter walking the flat (instance, rank) slot list gives every GPU
group the same share. With ``--placement decode-sidecar`` (the manifest is run with
``spec.router.placement: decode-sidecar``) there is one router per decode instance and
`pdserve up` spreads the burst over them in turn, equal traffic per sidecar: each sidecar's own
counter, started at its instance's offset, still gives every prefill slot exactly the same
share, and each decode instance's ranks theirs. `make demo` runs both placements.

Exit status 0 only when no request failed, every slot got exactly its share of the burst
(when the burst divides evenly over the slots, as the default one does), every sidecar served
the same number of requests, and every engine saw exactly what the routers say they sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.deployment.spec.pddeployment import PLACEMENTS
from pdserve.local.view import slot_counters
from pdserve.routing import Role, load_routing_table, parse_routing_table
from pdserve.wire.headers import SIDECAR

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "nixl" / "2p-dp8ep-3d-dp8ep.yaml"
DEFAULT_OUTPUT = Path("demo-output") / "slots.png"
STARTUP_TIMEOUT = 90.0


@dataclass(frozen=True)
class SlotResult:
    role: Role
    instance: str
    rank: int
    router_requests: int
    router_errors: int
    engine_requests: int


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.local.demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--file", type=Path, default=EXAMPLE, help="PDDeployment to run (default: %(default)s)"
    )
    parser.add_argument("--requests", type=int, default=480, help="requests in the burst (default: 480)")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="requests in flight at once (default: 64)"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=None,
        help="run the manifest with this spec.router.placement (default: the manifest's own)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"PNG chart (default: {DEFAULT_OUTPUT}, slots-decode-sidecar.png for that placement)",
    )
    args = parser.parse_args(argv)

    manifest = args.file
    work = Path(tempfile.mkdtemp(prefix="pdserve-demo-"))
    if args.placement is not None:
        manifest = work / Path(args.file).name
        manifest.write_text(with_placement(Path(args.file).read_text(), args.placement))
    pdd = load_manifest_file(manifest)
    placement = pdd.spec.router.placement
    output = args.output or (
        DEFAULT_OUTPUT.with_name(f"slots-{placement}.png")
        if pdd.spec.router.decode_sidecar
        else DEFAULT_OUTPUT
    )
    port = _free_port()
    log = work / "up.log"
    entry = (
        f"{pdd.spec.decode.instances} decode sidecar routers behind 127.0.0.1:{port}"
        if pdd.spec.router.decode_sidecar
        else f"router on 127.0.0.1:{port}"
    )
    print(
        f"==> pdserve up {_display(args.file)}  (placement {placement}: simulated engines; {entry})",
        flush=True,
    )
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        str(manifest),
        "--port",
        str(port),
        "--no-view",
        "--sim-ttft-ms",
        "2",
        "--sim-itl-ms",
        "0.5",
        "--sim-tokens",
        "8",
    ]
    with log.open("wb") as out:
        up = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    ok = False
    try:
        results, failures, elapsed, by_sidecar = asyncio.run(
            _demo(f"http://127.0.0.1:{port}", pdd.spec.served_model_name, args.requests, args.concurrency, up)
        )
        ok = _report(results, failures, args.requests, elapsed, output, by_sidecar)
    except DemoError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
    finally:
        code = _stop(up)
        if code != 0:
            ok = False
            print(f"demo: error: `pdserve up` exited with {code} on SIGTERM", file=sys.stderr)
        if not ok:
            print(f"--- pdserve up output ({log}) ---\n{log.read_text(errors='replace')}", file=sys.stderr)
        else:
            routers = "every sidecar router" if pdd.spec.router.decode_sidecar else "the router"
            print(f"==> stopped `pdserve up`: every engine and {routers} exited", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def with_placement(manifest: str, placement: str) -> str:
    """The manifest's YAML with ``spec.router.placement`` set."""
    doc = yaml.safe_load(manifest)
    doc.setdefault("spec", {}).setdefault("router", {})["placement"] = placement
    return str(yaml.safe_dump(doc, sort_keys=False))


class DemoError(RuntimeError):
    pass


async def _demo(
    router: str, model: str, count: int, concurrency: int, up: subprocess.Popen[bytes]
) -> tuple[list[SlotResult], list[str], float, dict[str, int]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        debug = await _wait_all_slots(session, router, up)
        slots = slot_counters(debug)
        print(
            f"==> ready: {sum(s.role is Role.PREFILL for s in slots)} prefill and "
            f"{sum(s.role is Role.DECODE for s in slots)} decode slots; sending {count} requests, "
            f"{concurrency} at a time",
            flush=True,
        )
        failures: list[str] = []
        by_sidecar: dict[str, int] = {}  # decode-sidecar: who served, from X-PDServe-Sidecar
        limit = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with limit:
                problem, sidecar = await _complete(session, router, model, i, stream=i % 2 == 1)
                if problem:
                    failures.append(f"request {i}: {problem}")
                if sidecar:
                    by_sidecar[sidecar] = by_sidecar.get(sidecar, 0) + 1

        start = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(count)))
        elapsed = time.monotonic() - start
        after = await _get_json(session, router + "/debug/routing")
        engine_counts = await _engine_counts(session, after)
        results = [
            SlotResult(
                c.role, c.instance, c.rank, c.requests, c.errors, engine_counts.get((c.instance, c.rank), 0)
            )
            for c in slot_counters(after)
        ]
        return in_slot_order(results, after["table"]), failures, elapsed, by_sidecar


def in_slot_order(results: list[SlotResult], table: dict[str, Any]) -> list[SlotResult]:
    """Slots as the table lists them, instance by instance, rank by rank: one order for both
    placements (a router lists its slots in its walk's order, merged sidecars each their own)."""
    position = {(role, inst["name"]): i for role in Role for i, inst in enumerate(table.get(role.value, []))}
    return sorted(
        results, key=lambda r: (r.role is Role.DECODE, position.get((r.role, r.instance), 0), r.rank)
    )


async def _wait_all_slots(
    session: aiohttp.ClientSession, router: str, up: subprocess.Popen[bytes]
) -> dict[str, Any]:
    """The router's view once every instance of the table is routable and /ready says so."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise DemoError(f"`pdserve up` exited with {up.returncode} before the router was ready")
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
            async with session.get(router + "/ready") as ready:
                if ready.status == 200:
                    debug = await _get_json(session, router + "/debug/routing")
                    table = parse_routing_table(debug["table"])
                    sidecars = debug.get("sidecars") or []  # decode-sidecar: every one Ready
                    if all(i.routable for i in (*table.prefill, *table.decode)) and all(
                        s["ready"] for s in sidecars
                    ):
                        return debug
        await asyncio.sleep(0.2)
    raise DemoError(f"not every slot was ready after {STARTUP_TIMEOUT:.0f}s")


async def _complete(
    session: aiohttp.ClientSession, router: str, model: str, i: int, stream: bool
) -> tuple[str | None, str | None]:
    """What went wrong (None: nothing), and the sidecar that served (None: no sidecars)."""
    body = {"model": model, "prompt": f"demo request {i}", "max_tokens": 8, "stream": stream}
    try:
        async with session.post(router + "/v1/completions", json=body) as resp:
            text = await resp.text()
            sidecar = resp.headers.get(SIDECAR)
            if resp.status != 200:
                return f"HTTP {resp.status}: {text[:200]}", sidecar
            if stream:
                return (None if "data: [DONE]" in text else "stream ended without [DONE]"), sidecar
            return (None if json.loads(text).get("choices") else "no choices in the answer"), sidecar
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}", None


async def _engine_counts(session: aiohttp.ClientSession, debug: dict[str, Any]) -> dict[tuple[str, int], int]:
    """Requests per (instance, rank) as each simulated engine counted them (its /sim/stats)."""
    table = load_routing_table(json.dumps(debug["table"]))
    counts: dict[tuple[str, int], int] = {}
    for inst in (*table.prefill, *table.decode):
        stats = await _get_json(session, inst.url + "/sim/stats")
        for rank, n in stats["by_rank"].items():
            counts[(inst.name, int(rank))] = int(n)
    return counts


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as resp:
        resp.raise_for_status()
        data = await resp.json()
    if not isinstance(data, dict):
        raise DemoError(f"{url} did not answer a JSON object")
    return data


# --- report ----------------------------------------------------------------------------------------


def _report(
    results: list[SlotResult],
    failures: list[str],
    count: int,
    elapsed: float,
    output: Path,
    by_sidecar: dict[str, int] | None = None,
) -> bool:
    """Print the per-slot table and the verdict; ``by_sidecar``: requests each decode sidecar served
    (placement decode-sidecar; the slots' counts are then every sidecar's summed)."""
    by_sidecar = by_sidecar or {}
    whose = "the sidecars' summed" if by_sidecar else "the router's"
    print(f"\nRequests per slot, instance by instance ({whose} count, engine's count):")
    print(f"{'role':<8} {'instance':<34} {'rank':>4} {'router':>7} {'engine':>7} {'errors':>6}")
    for r in results:
        print(
            f"{r.role.value:<8} {r.instance:<34} {r.rank:>4} {r.router_requests:>7} "
            f"{r.engine_requests:>7} {r.router_errors:>6}"
        )
    print()
    ok = True
    for role in Role:
        mine = [r.router_requests for r in results if r.role is role]
        print(
            f"{role.value:>8}: {len(mine)} slots, {sum(mine)} requests, "
            f"min {min(mine)} / max {max(mine)} per slot"
        )
        if min(mine) == 0:
            print(f"demo: FAIL: a {role.value} slot got no request", file=sys.stderr)
            ok = False
        elif sum(mine) == count and count % len(mine) == 0 and min(mine) != max(mine):
            print(
                f"demo: FAIL: {count} requests over {len(mine)} {role.value} slots should give each exactly "
                f"{count // len(mine)}",
                file=sys.stderr,
            )
            ok = False
    if by_sidecar:
        served = ", ".join(f"{name} {n}" for name, n in sorted(by_sidecar.items()))
        print(f"sidecars: {len(by_sidecar)} served {served} (X-PDServe-Sidecar)")
        if len(set(by_sidecar.values())) > 1 and count % len(by_sidecar) == 0:
            print("demo: FAIL: the sidecars did not get equal traffic", file=sys.stderr)
            ok = False
    print(f"   burst: {count} requests in {elapsed:.2f}s, {len(failures)} failed")
    for failure in failures[:10]:
        print(f"demo: FAIL: {failure}", file=sys.stderr)
    ok = ok and not failures
    mismatched = [r for r in results if r.engine_requests != r.router_requests]
    for r in mismatched:
        print(
            f"demo: FAIL: {r.instance} rank {r.rank}: "
            f"router sent {r.router_requests}, engine saw {r.engine_requests}",
            file=sys.stderr,
        )
    ok = ok and not mismatched
    _chart(results, output, "decode-sidecar" if by_sidecar else "deployment", count, len(failures))
    print(f"   chart: {output.resolve()}")
    verdict = "OK: every slot got its share, no request failed" if ok else "FAILED (see above)"
    print(f"==> {verdict}")
    return ok


def _chart(results: list[SlotResult], output: Path, placement: str, count: int, failed: int) -> None:
    """Requests per slot, one panel per role, in the table's order (instance by instance, rank by
    rank; one color per instance); the expected share (the burst over the role's slots) as a line,
    so an exact run shows every bar on it; errors stacked in red; totals in the titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), constrained_layout=True)
    for ax, role in zip(axes, Role, strict=True):
        mine = [r for r in results if r.role is role]
        instances = list(dict.fromkeys(r.instance for r in mine))
        colors = [f"C{instances.index(r.instance) % 10}" for r in mine]
        ok = [r.router_requests - r.router_errors for r in mine]
        errors = [r.router_errors for r in mine]
        xs = range(len(mine))
        ax.bar(xs, ok, color=colors)
        ax.bar(xs, errors, bottom=ok, color="#d62728", hatch="//")
        expected = count / len(mine) if mine else 0.0
        ax.axhline(expected, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(list(xs), [f"{instances.index(r.instance)}/{r.rank}" for r in mine], fontsize=7)
        ax.set_xlabel(f"{role.value} slot (instance/rank)")
        ax.set_ylabel("requests")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, max([*(r.router_requests for r in mine), expected]) * 1.15 + 1)
        sent = sum(r.router_requests for r in mine)
        exact = all(r.router_requests == expected for r in mine)
        ax.set_title(
            f"{role.value}: {sent} requests over {len(mine)} slots, {sum(errors)} failed"
            + (f"; every slot got exactly {expected:g}" if exact else f"; min {min(ok)} / max {max(ok)}")
        )
        handles: list[Patch | Line2D] = [
            Patch(color=f"C{i % 10}", label=f"instance {i}: {name}") for i, name in enumerate(instances)
        ]
        handles.append(Line2D([], [], color="black", linestyle="--", label=f"expected share: {expected:g}"))
        if any(errors):
            handles.append(Patch(facecolor="#d62728", hatch="//", label="errors"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    routers = "a sidecar router per decode instance" if placement == "decode-sidecar" else "one router"
    fig.suptitle(
        f"pdserve: flat interleaved routing over every (instance, DP rank) slot, {routers}: "
        f"{count} requests, {failed} failed"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


# --- process handling ------------------------------------------------------------------------------


def _stop(up: subprocess.Popen[bytes]) -> int:
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(5)
    return int(up.returncode)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _display(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd()))
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
