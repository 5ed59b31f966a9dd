"""Local mode's pure core: the processes it would start, and the view it draws."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.render.router import router_deployment
from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.local.plan import LOOPBACK, PlanError, SimTimings, plan_local_run
from pdserve.local.view import instance_rows, prefix_cache_counts, render_frame, summary_line
from pdserve.routing import Role
from tests.support.specs import pdd_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PYTHON = "/usr/bin/python3"


def _example(name: str) -> PDDeployment:
    return load_manifest_file(EXAMPLES / name)


def _plan(pdd: PDDeployment, engine: str = "sim", sim: SimTimings | None = None) -> Any:
    sim = sim or SimTimings()
    count = pdd.spec.prefill.instances + pdd.spec.decode.instances
    sidecars = list(range(9101, 9101 + pdd.spec.decode.instances)) if pdd.spec.router.decode_sidecar else []
    return plan_local_run(
        pdd,
        engine,
        list(range(9001, 9001 + count)),
        8000,
        "/run/routing.json",
        sim,
        PYTHON,
        sidecar_ports=sidecars,
    )


def _sidecar(pdd: PDDeployment) -> PDDeployment:
    router = dataclasses.replace(pdd.spec.router, placement="decode-sidecar")
    return dataclasses.replace(pdd, spec=dataclasses.replace(pdd.spec, router=router))


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sim_profile_gives_every_engine_the_profile_and_its_own_kv_port() -> None:
    pdd = _example("sim/quickstart.yaml")
    count = pdd.spec.prefill.instances + pdd.spec.decode.instances
    plan = plan_local_run(
        pdd,
        "sim",
        list(range(9001, 9001 + count)),
        8000,
        "/run/routing.json",
        SimTimings(profile="cpu-tiny-llama"),
        PYTHON,
        kv_ports=[7100 + 10 * i for i in range(count)],
    )
    assert [_flag(e.argv, "--profile") for e in plan.engines] == ["cpu-tiny-llama"] * count
    assert [e.argv[-2:] for e in plan.engines] == [("--kv-port", str(7100 + 10 * i)) for i in range(count)]


def test_one_sim_process_per_instance_with_its_dp_size() -> None:
    pdd = _example("nixl/2p-dp8ep-4d-tp8.yaml")
    plan = _plan(pdd, sim=SimTimings(ttft_ms=1.5, itl_ms=0.0, tokens=4))
    assert [(e.role, e.index) for e in plan.engines] == [(Role.PREFILL, 0), (Role.PREFILL, 1)] + [
        (Role.DECODE, i) for i in range(4)
    ]
    assert len({e.port for e in plan.engines}) == 6
    for engine in plan.engines:
        argv = engine.argv
        assert argv[:4] == (PYTHON, "-m", "pdserve.cli", "sim")
        assert _flag(argv, "--role") == engine.role.value
        assert _flag(argv, "--dp-size") == ("8" if engine.role is Role.PREFILL else "1")
        assert _flag(argv, "--host") == LOOPBACK
        assert _flag(argv, "--port") == str(engine.port)
        assert (
            _flag(argv, "--instance-name") == engine.name == f"{pdd.name}-{engine.role.value}-{engine.index}"
        )
        assert _flag(argv, "--kv-host") == LOOPBACK, "$(POD_IP) is expanded to loopback"
        assert _flag(argv, "--model") == pdd.spec.served_model_name
        assert argv[-6:] == ("--ttft-ms", "1.5", "--itl-ms", "0", "--tokens", "4")
        assert engine.env["POD_IP"] == LOOPBACK
    assert plan.deployment.spec.engine == "sim"


def test_engine_args_are_the_operators_but_for_address_and_port() -> None:
    pdd = _example("nixl/2p-tp8-1d-dp8ep.yaml")
    sim_pdd = dataclasses.replace(pdd, spec=dataclasses.replace(pdd.spec, engine="sim"))
    plan = _plan(pdd)
    for engine in plan.engines:
        rendered = instance_pod(sim_pdd, engine.role, engine.index)["spec"]["containers"][0]["args"]
        local = list(engine.argv[4:])
        differing = {rendered[i - 1] for i, (a, b) in enumerate(zip(rendered, local, strict=False)) if a != b}
        assert differing == {"--host", "--port", "--kv-host"}


def test_router_runs_the_operators_proxy_command_on_loopback() -> None:
    pdd = _example("moriio-read/2p-dp8ep-3d-dp8ep.yaml")
    plan = _plan(pdd)
    rendered = router_deployment(pdd)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert len(plan.routers) == 1 and not plan.sidecars
    argv = plan.routers[0].argv
    assert argv[:4] == (PYTHON, "-m", "pdserve.cli", "proxy")
    assert _flag(argv, "--routing-file") == "/run/routing.json"
    # One table source: the file the runner writes replaces the pod's ConfigMap watch.
    assert "--routing-configmap" in rendered and "--routing-configmap" not in argv
    assert _flag(argv, "--host") == LOOPBACK
    assert _flag(argv, "--port") == "8000"
    assert _flag(argv, "--policy") == rendered[rendered.index("--policy") + 1]
    assert plan.routers[0].url == plan.url == "http://127.0.0.1:8000"
    # One port on loopback: metrics and /debug answer there too (the pod's admin port is dropped).
    assert "--admin-port" in rendered and "--admin-port" not in argv


def test_vllm_engine_gets_the_rendered_vllm_serve_command() -> None:
    pdd = _example("nixl/2p-tp8-1d-dp8ep.yaml")
    plan = _plan(pdd, engine="vllm")
    for engine in plan.engines:
        rendered = instance_pod(pdd, engine.role, engine.index)["spec"]["containers"][0]
        assert list(engine.argv[:2]) == rendered["command"] == ["vllm", "serve"]
        assert _flag(engine.argv, "--port") == str(engine.port)
        assert (
            _flag(engine.argv, "--kv-transfer-config")
            == rendered["args"][rendered["args"].index("--kv-transfer-config") + 1]
        )
        assert engine.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == LOOPBACK
    # Disjoint GPUs and NIXL side-channel ports per instance on the one machine.
    gpus = [g for e in plan.engines for g in e.env["CUDA_VISIBLE_DEVICES"].split(",")]
    assert len(gpus) == len(set(gpus)) == 2 * 8 + 1 * 8
    assert len({e.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in plan.engines}) == 3


def test_vllm_with_moriio_is_refused_with_the_reason() -> None:
    with pytest.raises(PlanError, match="fixed handshake/notify ports"):
        _plan(_example("moriio-write/1p-tp8-1d-tp8.yaml"), engine="vllm")


def test_vllm_args_are_dropped_for_simulated_engines_and_said_so() -> None:
    pdd = _example("nixl/1p-tp8-1d-tp8.yaml")
    pdd = dataclasses.replace(
        pdd,
        spec=dataclasses.replace(
            pdd.spec, decode=dataclasses.replace(pdd.spec.decode, args=("--max-model-len=4096",))
        ),
    )
    plan = _plan(pdd)
    assert all("--max-model-len=4096" not in e.argv for e in plan.engines)
    assert any("ignoring the vLLM args of decode" in note for note in plan.notes)


def test_a_role_without_instances_is_refused() -> None:
    pdd = _example("sim/quickstart.yaml")
    pdd = dataclasses.replace(
        pdd, spec=dataclasses.replace(pdd.spec, decode=dataclasses.replace(pdd.spec.decode, instances=0))
    )
    with pytest.raises(PlanError, match="at least one prefill and one decode"):
        plan_local_run(pdd, "sim", [9001], 8000, "/r.json")


def test_decode_sidecar_runs_the_decode_pods_router_container_next_to_each_engine() -> None:
    pdd = _sidecar(_example("nixl/2p-dp8ep-3d-dp8ep.yaml"))
    plan = _plan(pdd)
    assert plan.sidecars and plan.placement == "decode-sidecar"
    assert plan.url == "http://127.0.0.1:8000", "the user's port is the front's"
    decodes = [e for e in plan.engines if e.role is Role.DECODE]
    assert [r.instance for r in plan.routers] == [e.name for e in decodes]
    assert [r.port for r in plan.routers] == [9101, 9102, 9103]
    for index, (router, engine) in enumerate(zip(plan.routers, decodes, strict=True)):
        pod = instance_pod(plan.deployment, Role.DECODE, index)
        rendered = next(c for c in pod["spec"]["containers"] if c["name"] == "router")["args"]
        argv = router.argv
        assert argv[:4] == (PYTHON, "-m", "pdserve.cli", "proxy")
        # The pod's sidecar, but its own engine on loopback and the table from the runner's file.
        assert _flag(argv, "--local-decode") == engine.url
        assert _flag(argv, "--local-dp-size") == "8"
        assert _flag(argv, "--local-revision") == _flag(tuple(rendered), "--local-revision")
        assert _flag(argv, "--routing-file") == "/run/routing.json"
        assert "--routing-configmap" not in argv and "--admin-port" not in argv
        assert (_flag(argv, "--host"), _flag(argv, "--port")) == (LOOPBACK, str(router.port))
        # The downward API, read from the rendered pod: its name and its instance index (the offset).
        assert router.env["POD_NAME"] == engine.name
        assert router.env["PDSERVE_INSTANCE_INDEX"] == str(index)
        assert router.env["POD_NAMESPACE"] == pdd.namespace
    assert not plan.notes


def test_decode_sidecar_needs_a_port_per_decode_instance() -> None:
    pdd = _sidecar(_example("sim/quickstart.yaml"))
    with pytest.raises(PlanError, match="need 2 sidecar ports"):
        plan_local_run(pdd, "sim", [9001, 9002, 9003], 8000, "/r.json", sidecar_ports=[9101])


# --- the view ----------------------------------------------------------------------------------


def _debug() -> dict[str, Any]:
    def inst(name: str, dp: int, ready: bool = True, draining: bool = False) -> dict[str, Any]:
        return {
            "name": name,
            "url": f"http://127.0.0.1:1/{name}",
            "dpSize": dp,
            "ready": ready,
            "draining": draining,
        }

    def slot(key: str, requests: int, in_flight: int = 0, errors: int = 0) -> dict[str, Any]:
        return {"slot": key, "requests": requests, "in_flight": in_flight, "errors": errors}

    return {
        "generation": 4,
        "policy": "flat-interleaved",
        "last_reload_error": None,
        "table": {
            "deployment": "demo",
            "prefill": [inst("p-0", 2), inst("p-1", 2, draining=True)],
            "decode": [inst("d-0", 1), inst("d-1", 1, ready=False)],
        },
        "slots": {"prefill": [slot("p-0/0", 5, 1), slot("p-0/1", 4)], "decode": [slot("d-0/0", 9, 0, 2)]},
    }


def test_view_shows_every_instance_with_per_rank_counters() -> None:
    rows = instance_rows(_debug())
    assert [(r.role, r.name, r.state) for r in rows] == [
        (Role.PREFILL, "p-0", "ready"),
        (Role.PREFILL, "p-1", "draining"),
        (Role.DECODE, "d-0", "ready"),
        (Role.DECODE, "d-1", "not ready"),
    ]
    assert [(s.rank, s.requests, s.in_flight) for s in rows[0].slots] == [(0, 5, 1), (1, 4, 0)]
    frame = "\n".join(render_frame(_debug(), ["1.0s  something happened"], color=False))
    assert "routing generation 4" in frame
    assert "   requests    5   4" in frame
    assert "   in-flight   1   0" in frame
    assert "   errors      2" in frame
    assert "draining" in frame and "not ready" in frame
    assert "something happened" in frame
    assert "\x1b[" not in frame


def test_summary_line_gives_totals_and_spread() -> None:
    line = summary_line(_debug())
    assert "prefill 9 requests over 2 slots (min 4, max 5)" in line
    assert "decode 9 requests over 1 slots" in line
    assert "in flight 1" in line and "errors 2" in line


def test_view_shows_the_engines_prefix_cache_hit_ratio_and_the_routers_index() -> None:
    metrics = (
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0\n'
    )
    counts = prefix_cache_counts(metrics)
    assert counts == {0: (300.0, 400.0), 1: (0.0, 100.0)}
    debug = {
        **_debug(),
        "prefill_policy": "prefix-affinity",
        "prefix": {"policy": "prefix-affinity", "slots": {"p-0/0": {"chunks": 12}, "p-0/1": {"chunks": 3}}},
    }
    frame = "\n".join(render_frame(debug, [], color=False, cache={"p-0": counts}))
    assert "prefill policy prefix-affinity   prefill prefix-cache hits 60%" in frame
    assert "   cache hit 75%  0%" in frame
    assert "   index      12   3" in frame
    assert "prefill prefix-cache hits 60%" in summary_line(debug, {"p-0": counts})


def _multinode(api_servers: str = "perNode", **decode: Any) -> PDDeployment:
    return pdd_of(
        "mn",
        engine="sim",
        image=None,
        gpusPerNode=2,
        multiNode={"apiServers": api_servers},
        prefill={"instances": 2, "dataParallel": 4},
        decode={"instances": 1, "dataParallel": 2, **decode},
    )


def _multinode_plan(pdd: PDDeployment, rpc: list[int] | None = None) -> Any:
    from pdserve.local.plan import engine_process_count, group_count

    count = engine_process_count(pdd)
    rpc = rpc if rpc is not None else list(range(9501, 9501 + group_count(pdd)))
    return plan_local_run(
        pdd, "sim", list(range(9001, 9001 + count)), 8000, "/run/routing.json", python=PYTHON, rpc_ports=rpc
    )


def test_a_multi_node_instance_runs_one_sim_process_per_node() -> None:
    pdd = _multinode()
    plan = _multinode_plan(pdd)
    shape = [(e.role, e.index, e.node, e.name, e.group) for e in plan.engines]
    assert shape == [
        (Role.PREFILL, 0, 0, "mn-prefill-0", "mn-prefill-0"),
        (Role.PREFILL, 0, 1, "mn-prefill-0-1", "mn-prefill-0"),
        (Role.PREFILL, 1, 0, "mn-prefill-1", "mn-prefill-1"),
        (Role.PREFILL, 1, 1, "mn-prefill-1-1", "mn-prefill-1"),
        (Role.DECODE, 0, 0, "mn-decode-0", ""),  # DP2 fits a node of 2: one process, as before
    ]
    assert [e.port for e in plan.engines] == list(range(9001, 9006))  # every process its own port
    for e in plan.engines:
        argv = e.argv
        assert _flag(argv, "--port") == str(e.port) and _flag(argv, "--host") == LOOPBACK
        assert e.serves_http
        if not e.group:
            assert "--data-parallel-size-local" not in argv
            continue
        # The rendered pod's flags, with this machine's addresses and the group's own RPC port.
        assert _flag(argv, "--dp-size") == "4"
        assert _flag(argv, "--data-parallel-size-local") == "2"
        assert _flag(argv, "--data-parallel-start-rank") == str(2 * e.node)
        assert _flag(argv, "--data-parallel-address") == LOOPBACK
        assert _flag(argv, "--data-parallel-rpc-port") == str(9501 + e.index)
        assert "--data-parallel-hybrid-lb" in argv and "--headless" not in argv
        assert _flag(argv, "--instance-name") == e.group


def test_leader_mode_workers_are_headless_processes() -> None:
    plan = _multinode_plan(_multinode("leader"))
    workers = [e for e in plan.engines if e.node > 0]
    assert workers and all("--headless" in e.argv and not e.serves_http for e in workers)
    leaders = [e for e in plan.engines if e.group and e.node == 0]
    assert all(e.serves_http and "--data-parallel-start-rank" not in e.argv for e in leaders)


def test_a_rank_spanning_nodes_gets_its_master_port() -> None:
    pdd = _multinode(dataParallel=1, tensorParallel=2, pipelineParallel=2)
    plan = _multinode_plan(pdd)
    decode = [e for e in plan.engines if e.role is Role.DECODE]
    assert [e.node for e in decode] == [0, 1]
    assert {_flag(e.argv, "--master-port") for e in decode} == {"9503"}
    assert [_flag(e.argv, "--node-rank") for e in decode] == ["0", "1"]
    assert [e.serves_http for e in decode] == [True, False]


def test_multi_node_plans_need_their_ports_and_the_simulator() -> None:
    pdd = _multinode()
    with pytest.raises(PlanError, match="need 5 engine ports, got 3"):
        plan_local_run(pdd, "sim", [9001, 9002, 9003], 8000, "/r", python=PYTHON, rpc_ports=[1, 2])
    with pytest.raises(PlanError, match="need 2 group RPC ports"):
        _multinode_plan(pdd, rpc=[])
    with pytest.raises(PlanError, match="--engine sim only"):
        plan_local_run(pdd, "vllm", list(range(9001, 9006)), 8000, "/r", python=PYTHON, rpc_ports=[1, 2])
