"""KV-transfer pod settings per connector: side-channel ports per rank, UCX env, IPC_LOCK, /dev/shm size."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.spec.parse import SpecError
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.deployment.validate import problems
from pdserve.routing import Role
from tests.support.specs import pdd_of


def engine(pdd: PDDeployment, role: Role = Role.DECODE) -> dict[str, Any]:
    container: dict[str, Any] = instance_pod(pdd, role, 0)["spec"]["containers"][0]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


MORIIO = {"connector": "MoRIIOConnector", "transferMode": "READ"}


def test_nixl_listens_on_one_side_channel_port_per_dp_rank() -> None:
    container = engine(pdd_of(decode={"dataParallel": 4, "tensorParallel": 2}))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "nixl-0": 5600, "nixl-1": 5601, "nixl-2": 5602, "nixl-3": 5603}
    env = env_of(container)
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("all", "all")
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_moriio_declares_handshake_and_notify_ports_per_rank() -> None:
    pdd = pdd_of(
        gpuResource="amd.com/gpu", kvTransfer=MORIIO, decode={"dataParallel": 2, "tensorParallel": 2}
    )
    container = engine(pdd)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "http": 8000,
        **{f"mori-hs-{n}": 6301 + n for n in range(4)},
        **{f"mori-nt-{n}": 61005 + n for n in range(4)},
    }
    assert env_of(container)["VLLM_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env_of(container)
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_moriio_ports_follow_extra_config_and_stay_ports() -> None:
    kv = {**MORIIO, "extraConfig": {"handshake_port": 7000, "notify_port": 65530}}
    pdd = pdd_of(gpuResource="amd.com/gpu", kvTransfer=kv, decode={"dataParallel": 8})
    assert {p["containerPort"] for p in engine(pdd)["ports"] if p["name"].startswith("mori-hs")} == set(
        range(7000, 7008)
    )
    assert problems(pdd, None) == [
        "spec.kvTransfer.extraConfig.notify_port: spec.decode needs 8 ports from 65530 (one per rank), "
        "past 65535; lower notify_port"
    ]


def test_the_simulator_gets_no_connector_settings() -> None:
    container = engine(pdd_of(engine="sim", image="", decode={"dataParallel": 4}))
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert "securityContext" not in container or "capabilities" not in container["securityContext"]
    assert "UCX_TLS" not in env_of(container)


def test_ucx_defaults_give_way_to_the_roles_env_and_the_template() -> None:
    template = {
        "spec": {
            "containers": [{"name": "engine", "env": [{"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"}]}]
        }
    }
    pdd = pdd_of(decode={"env": [{"name": "UCX_TLS", "value": "rc,cuda_copy"}], "template": template})
    container = engine(pdd)
    env = env_of(container)
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("rc,cuda_copy", "mlx5_0:1")
    assert [e["name"] for e in container["env"]].count("UCX_TLS") == 1


def test_a_template_adds_capabilities_without_losing_ipc_lock() -> None:
    template = {
        "spec": {
            "containers": [{"name": "engine", "securityContext": {"capabilities": {"add": ["SYS_NICE"]}}}]
        }
    }
    assert engine(pdd_of(decode={"template": template}))["securityContext"]["capabilities"]["add"] == [
        "IPC_LOCK",
        "SYS_NICE",
    ]


def test_shm_size_sets_the_dev_shm_limit() -> None:
    pdd = pdd_of(decode={"shmSize": "32Gi"})
    volumes = {v["name"]: v for v in instance_pod(pdd, Role.DECODE, 0)["spec"]["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}
    prefill = {v["name"]: v for v in instance_pod(pdd, Role.PREFILL, 0)["spec"]["volumes"]}
    assert prefill["dshm"]["emptyDir"]["sizeLimit"] == "8Gi"


@pytest.mark.parametrize("value", ["8GB", "lots", "", "-1Gi"])
def test_shm_size_must_be_a_quantity(value: str) -> None:
    with pytest.raises(SpecError) as info:
        pdd_of(decode={"shmSize": value})
    assert info.value.path == "spec.decode.shmSize"
    assert "expected a quantity such as 8Gi" in info.value.reason


def test_the_side_channel_port_is_pdserves() -> None:
    found = problems(
        pdd_of(prefill={"env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "7000"}]}), None
    )
    assert found == [
        "spec.prefill.env[0]: VLLM_NIXL_SIDE_CHANNEL_PORT is set by pdserve to 5600 (the engines listen from "
        "there, one port per DP rank); remove it from env"
    ]
