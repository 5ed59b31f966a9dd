"""How local mode spreads CPU cores over vLLM engines on a machine without GPUs (pure)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.local.cpus import Cores, assign_cores
from pdserve.local.plan import CPU_DTYPE, CPU_KV_CACHE_BYTES, plan_local_run
from pdserve.routing import Role

P, D = Role.PREFILL, Role.DECODE
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_two_cores_keep_the_prefill_and_its_nixl_thread_apart_from_the_decode_ranks() -> None:
    # The shape of the e2e: prefill DP1, decode DP2, on 2 cores (found by hand to serve in 78 s,
    # where a decode rank on the prefill's core took 8 minutes to start).
    prefill, decode = assign_cores([0, 1], [(P, 1), (D, 2)])
    assert prefill == Cores(((1,),)) and prefill.omp_bind == "1"
    assert decode == Cores(((0,), (0,))) and decode.omp_bind == "0|0"
    assert set(prefill.affinity).isdisjoint(decode.affinity)


def test_enough_cores_give_every_rank_its_own_block() -> None:
    cores = assign_cores(range(16), [(P, 2), (D, 2), (D, 2)])
    workers = [w for c in cores for w in c.workers]
    assert all(workers) and len({c for w in workers for c in w}) == 16
    flat = [c for w in workers for c in w]
    assert len(flat) == len(set(flat)), "no core shared between ranks"
    prefill, *decodes = cores
    assert min(prefill.affinity) > max(max(d.affinity) for d in decodes), "decode low, prefill high"
    assert cores[1].omp_bind == "0-2|3-5"


def test_tensor_parallel_ranks_each_get_a_list() -> None:
    (engine,) = assign_cores([0, 1, 2, 3], [(D, 4)])
    assert engine.omp_bind == "0|1|2|3"


def test_one_core_is_shared_by_everything() -> None:
    cores = assign_cores([3], [(P, 1), (D, 2)])
    assert [c.omp_bind for c in cores] == ["3", "3|3"]


def test_no_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="no CPU cores"):
        assign_cores([], [(P, 1)])


def test_cpu_plan_renders_what_vllm_needs_unless_the_manifest_says_otherwise() -> None:
    pdd = load_manifest_file(EXAMPLES / "cpu" / "nixl-1p-1d-dp2.yaml")
    plan = plan_local_run(pdd, "vllm", [9001, 9002], 8000, "routing.json", device="cpu", cores=[0, 1],
                          kv_ports=[5600, 5700])  # fmt: skip
    prefill, decode = plan.engines
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and prefill.cpus == (1,)
    assert decode.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|0" and decode.cpus == (0,)
    for engine in plan.engines:
        assert engine.env["UCX_TLS"] == "sm,self,tcp" and engine.env["UCX_NET_DEVICES"] == "lo"
        assert engine.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert engine.env["VLLM_HOST_IP"] == "127.0.0.1"
        assert "CUDA_VISIBLE_DEVICES" not in engine.env
        argv = list(engine.argv)
        assert "--enforce-eager" in argv and argv[argv.index("--dtype") + 1] == CPU_DTYPE
        # The manifest's own KV cache size wins over the default.
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == "67108864"
        assert argv.count("--kv-cache-memory-bytes") == 1
    assert prefill.ports == (9001, 5600) and decode.ports == (9002, 5700, 5701)
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    notes = "\n".join(plan.notes)
    assert "tiny-prefill-0 on core 1 with its NIXL progress thread" in notes
    assert "tiny-decode-0 on core 0 (VLLM_CPU_OMP_THREADS_BIND=0|0)" in notes

    # Without the manifest's args, the defaults; a manifest's env is kept as written.
    bare = dataclasses.replace(
        pdd.spec,
        prefill=dataclasses.replace(pdd.spec.prefill, args=("--dtype", "bfloat16"),
                                    env=({"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0"},)),
        decode=dataclasses.replace(pdd.spec.decode, args=()),
    )  # fmt: skip
    plan = plan_local_run(dataclasses.replace(pdd, spec=bare), "vllm", [9001, 9002], 8000, "routing.json",
                          device="cpu", cores=[0, 1])  # fmt: skip
    prefill, decode = plan.engines
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert list(prefill.argv).count("--dtype") == 1 and "bfloat16" in prefill.argv
    kv = list(decode.argv)
    assert kv[kv.index("--kv-cache-memory-bytes") + 1] == str(CPU_KV_CACHE_BYTES)
    assert "VLLM_CPU_OMP_THREADS_BIND=0)" in "\n".join(plan.notes)
