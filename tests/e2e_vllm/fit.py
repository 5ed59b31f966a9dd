"""Fit the simulator's ``cpu-tiny-llama`` profile to real vLLM on CPU, and check it.

``python -m tests.e2e_vllm fit-profile`` (alone on the machine, as far as it can be): one real
``vllm serve`` of the tiny model on one core, the flags the profile describes; the load of
:mod:`tests.e2e_vllm.loadgen`; then least squares: the time to the first token against the
prompt length gives ``prefill_token_ms`` (slope) and the cost of a one-token step (intercept),
the time per decode step of closed-loop clients against their number gives ``decode_seq_ms``
(slope) and ``step_ms`` (intercept). The figures go into
pdserve/sim/engine/profiles/cpu-tiny-llama.yaml with the measurements they came from.

``python -m tests.e2e_vllm check-profile`` (part of ``make e2e-vllm``): the same load against
real vLLM and against ``pdserve sim --profile cpu-tiny-llama``: the simulator's time to first
token per prompt length and its throughput per concurrency must be within 25 % of vLLM's, and
prompts sharing prefixes must raise both engines' prefix-cache hits alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.e2e_vllm.common import REPO, check, engine_env, metrics, request, say, total
from tests.e2e_vllm.loadgen import Load, linear_fit, shared_prefixes, side_by_side
from tests.e2e_vllm.model import ensure_model
from tests.e2e_vllm.venv import ensure_venv
from tests.support.procs import free_port

PROFILE = REPO / "pdserve" / "sim" / "engine" / "profiles" / "cpu-tiny-llama.yaml"
MODEL = "tiny"
MAX_MODEL_LEN = 512
KV_BYTES = 64 * 1024 * 1024
#: The engine the profile describes (vLLM's CPU defaults otherwise: block size 128).
VLLM_FLAGS = [
    "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
    "--dtype", "float32", "--kv-cache-memory-bytes", str(KV_BYTES), "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
]  # fmt: skip
TTFT_LENGTHS = [16, 64, 128, 256, 384, 496]
CLIENTS = [1, 4, 8, 16]
#: The closed loop's requests: a prompt length that is also a TTFT point, and the tokens out.
LOOP_PROMPT, LOOP_TOKENS = 64, 32
TOLERANCE = 0.25


@contextlib.contextmanager
def vllm_server(log: Path) -> Iterator[str]:
    """A real ``vllm serve`` of the tiny model, on core 0 (one engine rank, one core)."""
    model = ensure_model()
    port = free_port()
    env = {**engine_env(), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    argv = ["vllm", "serve", str(model), "--port", str(port), "--host", "127.0.0.1", *VLLM_FLAGS]
    say(f"starting real vLLM: {' '.join(argv[:3])} ... (log {log})")
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, proc, 600)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def sim_server(log: Path, profile: str = "cpu-tiny-llama") -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "sim", "--profile", profile, "--model", MODEL]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--port", str(port), "--kv-port", str(free_port())]
    argv += ["--tokens", "4096", "--enable-prompt-tokens-details"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, proc, 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        check(proc.poll() is None, f"{url}: the server exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            if request("GET", url + "/health", timeout=5).status == 200:
                return
        time.sleep(1)
    raise AssertionError(f"{url} not healthy after {timeout:.0f} s")


def measure(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The load on every engine of ``urls``, side by side (taking turns at every shot)."""
    return asyncio.run(_measure(urls))


async def _measure(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        loads = {name: Load(url, MODEL, session) for name, url in urls.items()}
        for load in loads.values():  # warm-up: every shape once or twice
            for n in TTFT_LENGTHS * 2:
                await load.stream(load.ids(n), 2)
            await load.wall(4, 8)

        ttft = await side_by_side(loads, TTFT_LENGTHS, Load.ttft, 9)
        _say("ttft", ttft, "{} tok {:.1f} ms", 1000)

        async def seconds_per_request(load: Load, c: int) -> float:  # lower is less disturbed
            return 1 / await load.throughput(c, prompt=LOOP_PROMPT, tokens=LOOP_TOKENS)

        spent = await side_by_side(loads, CLIENTS, seconds_per_request, 4)
        rates = {name: {c: 1 / t for c, t in table.items()} for name, table in spent.items()}
        _say("throughput", rates, "{} clients {:.1f} req/s", 1)
    return {name: {"ttft_s": ttft[name], "req_per_s": rates[name]} for name in urls}


def _say(what: str, table: dict[str, dict[int, float]], fmt: str, scale: float) -> None:
    for name, points in table.items():
        say(f"{name} {what}: " + ", ".join(fmt.format(x, y * scale) for x, y in points.items()))


def step_seconds(measured: dict[str, Any]) -> dict[int, float]:
    """Seconds per decode step with ``c`` clients in the closed loop: a request's time (``c`` over
    the rate) less its first token's, over the tokens after the first. The closed loop keeps
    about ``c`` sequences decoding; its many requests average out what a single timed batch of
    streams does not (and real vLLM's API server, busy with every stream's chunks, is in it)."""
    first = measured["ttft_s"][LOOP_PROMPT]
    return {c: (c / rate - first) / (LOOP_TOKENS - 1) for c, rate in measured["req_per_s"].items()}


@dataclass(frozen=True)
class Lines:
    """The measured straight lines: TTFT = ttft0 + per_token * P, a decode step = tpot0 + per_seq * c
    (ms)."""

    ttft0: float
    per_token: float
    tpot0: float
    per_seq: float

    @classmethod
    def of(cls, measured: dict[str, Any]) -> Lines:
        ttft0, per_token = linear_fit(measured["ttft_s"])
        tpot0, per_seq = linear_fit(step_seconds(measured))
        return cls(ttft0 * 1000, per_token * 1000, tpot0 * 1000, per_seq * 1000)


ZERO = {"step_ms": 0.0, "prefill_token_ms": 0.0, "decode_seq_ms": 0.0, "frontend_ms": 0.0}


def fitted(real: Lines, floor: Lines) -> dict[str, float]:
    """vLLM's lines less the simulator's own (its answers with a profile of zeros: HTTP, event loop,
    the client): a decode step costs tpot0 + per_seq * c, a lone request's first token comes one
    step after the frontend handed it over."""
    step = max(real.tpot0 - floor.tpot0, 0.0)
    return {
        "step_ms": round(step, 3),
        "prefill_token_ms": round(max(real.per_token - floor.per_token, 0.0), 5),
        "decode_seq_ms": round(max(real.per_seq - floor.per_seq, 0.0), 4),
        "frontend_ms": round(max(real.ttft0 - floor.ttft0 - step, 0.0), 3),
    }


def write_profile(path: Path, figures: dict[str, float], source: str) -> None:
    data = yaml.safe_load(PROFILE.read_text())
    data["step"] = {
        "step_ms": figures["step_ms"],
        "prefill_token_ms": figures["prefill_token_ms"],
        "decode_seq_ms": figures["decode_seq_ms"],
        "context_ktoken_ms": 0.0,
    }
    data["request"] = {"frontend_ms": figures["frontend_ms"]}
    data["source"] = source
    header = "".join(line + "\n" for line in PROFILE.read_text().splitlines() if line.startswith("#"))
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=100))


def fit_profile(work: Path, target: Path = PROFILE) -> dict[str, Any]:
    """vLLM beside the simulator with a profile of zeros, then :func:`fitted`, written to ``target``."""
    ensure_venv()
    zero = work / "zero.yaml"
    write_profile(zero, ZERO, "all costs zero: the simulator's own time")
    with vllm_server(work / "vllm.log") as vllm, sim_server(work / "sim.log", str(zero)) as sim_url:
        both = measure({"vllm": vllm, "sim": sim_url})
    real, floor = Lines.of(both["vllm"]), Lines.of(both["sim"])
    figures = fitted(real, floor)
    say(f"vLLM {real}; the simulator's own {floor}; fitted {figures}")
    m = both["vllm"]
    source = (
        f"Fitted on {datetime.date.today().isoformat()} by `python -m tests.e2e_vllm fit-profile` "
        "(tests/e2e_vllm/fit.py) to real vLLM 0.32.0 (vllm-cpu) on a shared 2-core machine, one core "
        "for the engine, token-id prompts, beside the simulator with a profile of zeros (taking turns "
        "under the same load). Two straight lines by least squares, each less the simulator's own: "
        "the time to first token over prompt lengths, vLLM "
        + ", ".join(f"{n}: {t * 1000:.1f} ms" for n, t in m["ttft_s"].items())
        + f" (= {real.ttft0:.2f} ms + {real.per_token:.4f} ms/token; the simulator's own "
        f"{floor.ttft0:.2f} ms + {floor.per_token:.4f} ms/token): intercept frontend_ms + step_ms, "
        "slope prefill_token_ms; the time per decode step of clients in a closed loop "
        f"({LOOP_PROMPT}-token prompts, {LOOP_TOKENS} tokens out: a request's time less its first "
        "token's, over the tokens after it), vLLM "
        + ", ".join(
            f"{c} clients {r:.1f} req/s = {s * 1000:.2f} ms"
            for (c, r), s in zip(m["req_per_s"].items(), step_seconds(m).values(), strict=True)
        )
        + f" (= {real.tpot0:.2f} ms + {real.per_seq:.4f} ms/sequence; the simulator's own "
        f"{floor.tpot0:.2f} ms + {floor.per_seq:.4f} ms/sequence): intercept step_ms, slope "
        "decode_seq_ms."
    )
    write_profile(target, figures, source)
    say(f"wrote {target.relative_to(REPO) if target.is_relative_to(REPO) else target}")
    return {"measured": both, "vllm_lines": real.__dict__, "sim_own_lines": floor.__dict__, "fitted": figures}


def check_profile(work: Path, profile: str = "cpu-tiny-llama") -> dict[str, Any]:
    """Real vLLM and the simulator with ``profile`` under the same load, side by side; a Failed when
    off."""
    ensure_venv()
    prompts = shared_prefixes(seed=11, groups=3, per_group=4, prefix=256, suffix=40)
    prefix: dict[str, dict[str, float]] = {}
    with vllm_server(work / "vllm.log") as vllm, sim_server(work / "sim.log", profile) as sim_url:
        urls = {"vllm": vllm, "sim": sim_url}
        results = measure(urls)
        for name, url in urls.items():
            before = metrics(url)
            asyncio.run(_send_each(url, prompts))
            after = metrics(url)
            prefix[name] = {
                k: total(after, f"vllm:prefix_cache_{k}_total")
                - total(before, f"vllm:prefix_cache_{k}_total")
                for k in ("queries", "hits")
            }
            say(f"{name}: prefix cache over {len(prompts)} prompts of 3 shared prefixes: {prefix[name]}")
    problems = []
    real, sim = results["vllm"], results["sim"]
    ratios: dict[str, dict[int, float]] = {"ttft": {}, "req_per_s": {}}
    for key, table in (("ttft", "ttft_s"), ("req_per_s", "req_per_s")):
        for x, want in real[table].items():
            ratio = sim[table][x] / want
            ratios[key][x] = round(ratio, 3)
            if abs(ratio - 1) > TOLERANCE:
                problems.append(f"{key} at {x}: sim {sim[table][x]:.4f} vs vLLM {want:.4f} (x{ratio:.2f})")
    share = {name: p["hits"] / p["queries"] if p["queries"] else 0.0 for name, p in prefix.items()}
    if not (prefix["vllm"]["hits"] > 0 and prefix["sim"]["hits"] > 0):
        problems.append(f"no prefix-cache hits on shared prefixes: {prefix}")
    elif abs(share["sim"] - share["vllm"]) > 0.02:
        problems.append(f"prefix hits differ: {prefix}")
    say(f"sim / vLLM: {ratios}; prefix hit share: {share}")
    check(not problems, "the profile does not predict real vLLM:\n  " + "\n  ".join(problems))
    return {"vllm": real, "sim": sim, "sim_over_vllm": ratios, "prefix": prefix}


def fit_and_check(work: Path) -> dict[str, Any]:
    """The model on this machine: a profile fitted here (to a file of the run, the committed one
    untouched), then checked against a second, separate run of real vLLM. The committed
    ``cpu-tiny-llama`` describes this project's test machines; vLLM's speed on another machine, or
    on a busier or quieter one, is not its, but the model must predict a profile fitted to it."""
    fitted_file = work / "fitted-here.yaml"
    for part in ("fit", "check"):
        (work / part).mkdir(parents=True, exist_ok=True)
    fit = fit_profile(work / "fit", target=fitted_file)
    committed = yaml.safe_load(PROFILE.read_text())
    here = yaml.safe_load(fitted_file.read_text())
    say(
        "fitted here against the committed cpu-tiny-llama: "
        + ", ".join(
            f"{k} {here[s][k]} vs {committed[s][k]}"
            for s, keys in (
                ("step", ("step_ms", "prefill_token_ms", "decode_seq_ms")),
                ("request", ("frontend_ms",)),
            )
            for k in keys
        )
    )
    check = check_profile(work / "check", str(fitted_file))
    return {"fitted_here": fit["fitted"], "committed": {**committed["step"], **committed["request"]}, **check}


async def _send_each(url: str, prompts: list[list[int]]) -> None:
    async with aiohttp.ClientSession() as session:
        await Load(url, MODEL, session).send_each(prompts)
