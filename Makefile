# pdserve developer entry points. `make test` is the one command CI runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-workers unit lint fmt bench bench-autoscaling bench-operator bench-prefix bench-replay bench-routing cluster-build cluster-up cluster-down kind-e2e demo clean \
	e2e-vllm record-vllm-fixtures otelcol-build

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	@touch $@

## Whole suite: unit, loopback integration and tests against the real control plane (built and started on demand).
## Lists its 20 slowest tests at the end: the suite's budget is 25 minutes.
test: install cluster-build
	$(VENV)/bin/pytest --durations=20 $(PYTEST_ARGS)

## The proxy's fairness, robustness and guard-rail tests again, with 2 worker processes per proxy
## (one shared counter per role, SO_REUSEPORT, merged admin views; docs/proxy.md#workers-one-router-on-every-core).
PROXY_WORKER_TESTS := tests/integration/test_proxy_routing.py tests/integration/test_proxy_resilience.py \
	tests/integration/test_proxy_faults.py tests/integration/test_proxy_retries.py \
	tests/integration/test_proxy_backpressure.py tests/integration/test_proxy_admin.py \
	tests/integration/test_proxy_load.py tests/integration/test_proxy_workers.py \
	tests/integration/test_proxy_multinode.py tests/integration/test_proxy_engine_loss.py \
	tests/integration/test_proxy_prefix_affinity.py
test-workers: install
	PDSERVE_TEST_PROXY_WORKERS=2 $(VENV)/bin/pytest $(PROXY_WORKER_TESTS) $(PYTEST_ARGS)

## Fast feedback: unit tests only.
unit: install
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check pdserve tests bench hack
	$(VENV)/bin/ruff format --check pdserve tests bench hack
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict --ignore-missing-imports hack/cluster/*.py hack/cluster/runner

fmt: install
	$(VENV)/bin/ruff format pdserve tests bench hack
	$(VENV)/bin/ruff check --fix pdserve tests bench hack

bench: install
	$(PY) -m bench.proxy_bench

## 200 PDDeployments x 10 pods (issue 12 item 7's scale, about 7 minutes); --shape small: see bench/operator_bench.py.
bench-operator: install cluster-up
	$(PY) -m bench.operator_bench

## The Mooncake trace x4 through `pdserve up examples/sim/mooncake.yaml` with an H200 profile (about 5 minutes);
## results in bench/results/replay-latest.md (docs/benchmarking.md).
bench-replay: install
	$(PY) -m bench.replay_bench

## pdserve's autoscaler against fixed sizes and per-role HPA on the Mooncake trace x4 (about 20 minutes);
## results in bench/results/autoscaling-latest.md (docs/benchmarking.md).
bench-autoscaling: install
	$(PY) -m bench.autoscaling_bench

## Cache-aware prefill routing on the Mooncake trace: flat, prefix-affinity (1 and 2 workers, 2 routers)
## and vllm-router cache_aware on fresh profiled sims (about 40 minutes); bench/results/prefix-latest.md.
bench-prefix: install
	$(PY) -m bench.prefix_bench

bench-routing: install cluster-up
	$(PY) -m bench.routing_lag_bench

cluster-build:
	hack/cluster/build

## The OpenTelemetry Collector of the tracing tests (OTLP receiver + file exporter), cached under
## ~/.cache/pdserve/otelcol; the tests build it on demand when it is missing (hack/otelcol/README.md).
otelcol-build:
	hack/otelcol/build

## The pod runner (hack/cluster/podrunner.py) runs on the repo's venv.
cluster-up: install cluster-build
	hack/cluster/up

cluster-down:
	hack/cluster/down

kind-e2e: install
	hack/kind-e2e

## Both router placements: one router, then a sidecar router per decode instance. Needs only the
## package and its plot extra (matplotlib), wheels on Linux x86_64/arm64 and macOS: not the dev
## and bench extras (vllm-router has a Linux x86_64 wheel only).
demo: $(VENV)/.demo-installed
	$(PY) -m pdserve.local.demo
	$(PY) -m pdserve.local.demo --placement decode-sidecar

$(VENV)/.demo-installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[plot]'
	@touch $@

## Opt-in (not in `make test`): real vLLM for CPU behind `pdserve up` (cached venv of several GB
## under ~/.cache/pdserve; see docs/testing.md). One e2e at a time: it needs about 8 GB.
## Then the simulator's model against real vLLM: a profile fitted on this machine, checked on a second run (docs/simulator.md).
e2e-vllm: install
	$(PY) -m tests.e2e_vllm run
	$(PY) -m tests.e2e_vllm fit-and-check

## Re-record tests/fixtures/vllm-<version>/ from real vLLM (the same setup as e2e-vllm).
record-vllm-fixtures: install
	$(PY) -m tests.e2e_vllm record

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
