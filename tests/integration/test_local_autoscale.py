"""`pdserve up` honours spec.autoscaling: simulator instances started and stopped by the
operator's own decision, on the signals `pdserve up` reads itself (the router's /load, the
engines' /metrics); a removed instance is drained through the router first. Step-engine sims
(the cluster test's profile), a load ramp low -> high -> low from streaming clients.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.integration.test_autoscale_cluster import ITL_MS, MAX_TOKENS, PROFILE, PROMPT_WORDS, TTFT_MS
from tests.support.kube import eventually
from tests.support.load import Load
from tests.support.procs import REPO, free_port, pdserve_argv, spawn_pdserve
from tests.support.specs import sim_manifest


def manifest(directory: Path) -> Path:
    doc = sim_manifest(
        "local-scaled",
        prefill={"instances": 1},
        decode={"instances": 1},
        rollout={"drainSeconds": 10},
        autoscaling={
            "prefill": {"minInstances": 1, "maxInstances": 3},
            "decode": {"minInstances": 1, "maxInstances": 3},
            "objectives": {"ttftMilliseconds": TTFT_MS, "itlMilliseconds": ITL_MS, "windowSeconds": 6},
            "syncPeriodSeconds": 1,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 8}},
        },
    )
    path = directory / "scaled.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def table_counts(url: str) -> dict[str, int] | None:
    """Routable instances per role in the router's table (None while it cannot answer for all its
    workers: a worker starting, or too busy to answer in time)."""
    try:
        with urllib.request.urlopen(url + "/debug/routing", timeout=5) as r:
            table = json.loads(r.read()).get("table") or {}
    except urllib.error.HTTPError:
        return None
    return {
        role: sum(1 for i in table.get(role, []) if i["ready"] and not i["draining"])
        for role in ("prefill", "decode")
    }


def test_pdserve_up_scales_with_the_load_and_fails_nothing(tmp_path: Path) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    port = free_port()
    output = tmp_path / "up.log"
    args = ["up", str(manifest(tmp_path)), "--port", str(port), "--sim-profile", str(profile)]
    up = spawn_pdserve(args, output)
    url = f"http://127.0.0.1:{port}"
    log = lambda: output.read_text(errors="replace")  # noqa: E731
    try:
        eventually(lambda: "is serving on" in log(), timeout=60, message="pdserve up serving")
        eventually(lambda: table_counts(url) == {"prefill": 1, "decode": 1}, timeout=30)
        targets = lambda: [f"127.0.0.1:{port}"]  # noqa: E731
        load: dict[str, Any] = {"max_tokens": MAX_TOKENS, "prompt_words": PROMPT_WORDS}
        peak = {"prefill": 1, "decode": 1}
        with Load(targets, concurrency=2, **load) as base:
            with Load(targets, concurrency=12, **load) as extra:

                def grown() -> bool:
                    now = table_counts(url) or peak
                    for role in peak:
                        peak[role] = max(peak[role], now[role])
                    return min(peak.values()) > 1

                eventually(grown, timeout=60, message=f"both roles scaled up:\n{log()[-3000:]}")
                high = extra.stop()
            eventually(
                lambda: (
                    table_counts(url) == {"prefill": 1, "decode": 1}
                    and log().count("drained and stopped") >= 2
                ),
                timeout=60,
                message=f"both roles back to one instance:\n{log()[-3000:]}",
            )
            low = base.stop()
        assert high.failed == [] and low.failed == [], (high.failed[:3], low.failed[:3])
        assert high.ok > 0 and low.ok > 0
        text = log()
        assert "autoscaling between prefill 1-3, decode 1-3" in text
        assert "autoscaler: prefill 1 -> " in text and "decode 1 -> " in text
        assert "autoscaling: prefill " in text and f"/ {TTFT_MS} ms" in text  # the summary lines
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0, log()[-3000:]


def test_autoscaling_with_vllm_locally_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        pdserve_argv("up", str(manifest(tmp_path)), "--engine", "vllm"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2
    assert "spec.autoscaling runs locally with --engine sim only" in result.stderr
