"""Fit the simulator's ``cpu-tiny-llama`` profile to real vLLM on CPU, and check it.

``python -m tests.e2e_vllm fit-profile`` (under ``flock /work/locks/vllm.lock``): one real
``vllm serve`` of the tiny model on one core, the flags the profile describes; the load of
:mod:`tests.e2e_vllm.loadgen`; then least squares: the time to the first token against the
prompt length gives ``prefill_token_ms`` (slope) and the cost of a one-token step (intercept),
the inter-token latency against the batch size gives ``decode_seq_ms`` (slope) and ``step_ms``
(intercept). The figures go into pdserve/sim/engine/profiles/cpu-tiny-llama.yaml with the
measurements they came from.

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

import yaml

from tests.e2e_vllm.common import REPO, check, engine_env, metrics, request, say, total
from tests.e2e_vllm.loadgen import Load, linear_fit
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
TPOT_BATCHES = [1, 2, 4, 8, 16]
CLIENTS = [1, 4, 16]
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


def measure(url: str) -> dict[str, Any]:
    load = Load(url, MODEL)
    out: dict[str, Any] = {}
    out["ttft_s"] = asyncio.run(load.ttft(TTFT_LENGTHS))
    say("ttft: " + ", ".join(f"{n} tok {t * 1000:.1f} ms" for n, t in out["ttft_s"].items()))
    out["tpot_s"] = asyncio.run(load.tpot(TPOT_BATCHES))
    say("tpot: " + ", ".join(f"batch {c} {t * 1000:.2f} ms" for c, t in out["tpot_s"].items()))
    out["req_per_s"] = asyncio.run(load.throughput(CLIENTS))
    say("throughput: " + ", ".join(f"{c} clients {r:.2f} req/s" for c, r in out["req_per_s"].items()))
    return out


@dataclass(frozen=True)
class Lines:
    """The measured straight lines: TTFT = ttft0 + per_token * P, TPOT = tpot0 + per_seq * c (ms)."""

    ttft0: float
    per_token: float
    tpot0: float
    per_seq: float

    @classmethod
    def of(cls, measured: dict[str, Any]) -> Lines:
        ttft0, per_token = linear_fit(measured["ttft_s"])
        tpot0, per_seq = linear_fit(measured["tpot_s"])
        return cls(ttft0 * 1000, per_token * 1000, tpot0 * 1000, per_seq * 1000)


def first_guess(real: Lines) -> dict[str, float]:
    """A decode step costs tpot0 + per_seq * c; a lone request's first token comes one prefill step
    after the frontend handed it over."""
    return {
        "step_ms": max(real.tpot0, 0.0),
        "prefill_token_ms": max(real.per_token, 0.0),
        "decode_seq_ms": max(real.per_seq, 0.0),
        "frontend_ms": max(real.ttft0 - real.tpot0, 0.0),
    }


def corrected(guess: dict[str, float], real: Lines, sim: Lines) -> dict[str, float]:
    """The simulator measured with ``guess`` adds its own overheads (HTTP, event loop): take the
    difference off, so the simulator as a whole answers like vLLM."""
    step = max(guess["step_ms"] - (sim.tpot0 - real.tpot0), 0.0)
    return {
        "step_ms": round(step, 3),
        "prefill_token_ms": round(max(guess["prefill_token_ms"] - (sim.per_token - real.per_token), 0.0), 5),
        "decode_seq_ms": round(max(guess["decode_seq_ms"] - (sim.per_seq - real.per_seq), 0.0), 4),
        "frontend_ms": round(
            max(guess["frontend_ms"] - (sim.ttft0 - real.ttft0) + (guess["step_ms"] - step), 0.0), 3
        ),
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


def fit_profile(work: Path) -> dict[str, Any]:
    ensure_venv()
    with vllm_server(work / "vllm.log") as url:
        measured = measure(url)
    real = Lines.of(measured)
    guess = first_guess(real)
    say(f"vLLM: {real}; first guess {guess}")
    trial = work / "trial.yaml"
    write_profile(trial, guess, "trial")
    with sim_server(work / "sim.log", str(trial)) as url:
        sim = Lines.of(measure(url))
    figures = corrected(guess, real, sim)
    say(f"simulator with the first guess: {sim}; corrected: {figures}")
    source = (
        f"Fitted on {datetime.date.today().isoformat()} by `python -m tests.e2e_vllm fit-profile` "
        "(tests/e2e_vllm/fit.py) to real vLLM 0.32.0 (vllm-cpu) on this 2-core machine, one core for "
        "the engine, token-id prompts. Least squares: time to first token over prompt lengths ("
        + ", ".join(f"{n}: {t * 1000:.1f} ms" for n, t in measured["ttft_s"].items())
        + f"; one request at a time) = {real.ttft0:.2f} ms + {real.per_token:.4f} ms/token; time per "
        "output token over concurrent streams ("
        + ", ".join(f"{c}: {t * 1000:.2f} ms" for c, t in measured["tpot_s"].items())
        + f") = {real.tpot0:.2f} ms + {real.per_seq:.4f} ms/sequence. step_ms, decode_seq_ms and "
        "prefill_token_ms are those lines less the simulator's own overhead (measured with a first "
        "guess), frontend_ms the first-token intercept beyond one step. Throughput then, 64-token "
        "prompts and 32 tokens out: "
        + ", ".join(f"{c} clients {r:.1f} req/s" for c, r in measured["req_per_s"].items())
        + "."
    )
    write_profile(PROFILE, figures, source)
    say(f"wrote {PROFILE.relative_to(REPO)}")
    return {"measured": measured, "vllm_lines": real.__dict__, "sim_lines": sim.__dict__, "fitted": figures}


def check_profile(work: Path) -> dict[str, Any]:
    """Real vLLM and the simulator under the same load; the figures, and a Failed when off."""
    ensure_venv()
    prefix_load = asyncio.run(
        Load("", MODEL, seed=11).shared_prefixes(groups=3, per_group=4, prefix=256, suffix=40)
    )
    results: dict[str, Any] = {}
    for name, server in (("vllm", vllm_server), ("sim", sim_server)):
        with server(work / f"{name}.log") as url:
            say(f"measuring {name}")
            results[name] = measure(url)
            before = metrics(url)
            asyncio.run(Load(url, MODEL).send_each(prefix_load))
            after = metrics(url)
            results[name]["prefix"] = {
                k: total(after, f"vllm:prefix_cache_{k}_total")
                - total(before, f"vllm:prefix_cache_{k}_total")
                for k in ("queries", "hits")
            }
            counts = results[name]["prefix"]
            say(f"{name}: prefix cache over {len(prefix_load)} prompts of 3 shared prefixes: {counts}")
    problems = []
    real, sim = results["vllm"], results["sim"]
    ratios: dict[str, dict[int, float]] = {"ttft": {}, "req_per_s": {}}
    for key, table in (("ttft", "ttft_s"), ("req_per_s", "req_per_s")):
        for x, want in real[table].items():
            ratio = sim[table][x] / want
            ratios[key][x] = round(ratio, 3)
            if abs(ratio - 1) > TOLERANCE:
                problems.append(f"{key} at {x}: sim {sim[table][x]:.4f} vs vLLM {want:.4f} (x{ratio:.2f})")
    hits_real, hits_sim = real["prefix"]["hits"], sim["prefix"]["hits"]
    if not (hits_real > 0 and hits_sim > 0):
        problems.append(f"no prefix-cache hits on shared prefixes: vLLM {hits_real}, sim {hits_sim}")
    elif abs(hits_sim / real["prefix"]["queries"] - hits_real / real["prefix"]["queries"]) > 0.02:
        problems.append(f"prefix hits differ: vLLM {real['prefix']}, sim {sim['prefix']}")
    say("sim / vLLM: " + str(ratios))
    check(not problems, "the profile does not predict real vLLM:\n  " + "\n  ".join(problems))
    return {"vllm": real, "sim": sim, "sim_over_vllm": ratios}
