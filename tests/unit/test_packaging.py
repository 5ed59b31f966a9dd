"""What installing pdserve asks of a machine: `make demo` needs the package and its plot extra
only (wheels everywhere), the benchmark's peer stays in the bench extra, and the license is an
SPDX expression (setuptools refuses the old table form from 2027-02-18)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_license_is_an_spdx_string() -> None:
    assert PROJECT["license"] == "Apache-2.0"


def test_the_plot_extra_is_only_the_chart_and_vllm_router_only_in_bench() -> None:
    assert _names(EXTRAS["plot"]) == {"matplotlib"}
    everything_but_bench = PROJECT["dependencies"] + [r for k, v in EXTRAS.items() if k != "bench" for r in v]
    assert "vllm-router" not in _names(everything_but_bench)
    assert "vllm-router" in _names(EXTRAS["bench"])
    assert "pdserve[operator,plot]" in EXTRAS["dev"]  # the test suite draws the charts too


def test_the_tracing_extra_is_the_sdk_and_its_exporters_and_dev_has_it() -> None:
    """pdserve imports OpenTelemetry only with --otlp-traces-endpoint; the tests trace."""
    assert _names(EXTRAS["tracing"]) == {
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp-proto-http",
        "opentelemetry-exporter-otlp-proto-grpc",
    }
    assert "pdserve[tracing]" in EXTRAS["dev"]


def test_make_demo_installs_the_plot_extra_only() -> None:
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^demo: (\S+)\n", makefile, re.MULTILINE)
    assert target is not None, "make demo has a prerequisite"
    recipe = re.search(
        rf"^{re.escape(target.group(1))}: pyproject.toml\n((?:\t.*\n)+)", makefile, re.MULTILINE
    )
    assert recipe is not None, f"the rule for {target.group(1)}"
    assert (
        "-e '.[plot]'" in recipe.group(1) and "bench" not in recipe.group(1) and "dev" not in recipe.group(1)
    )
