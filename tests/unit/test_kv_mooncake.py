"""MooncakeConnector end to end on paper: the spec, the pod, the routing table, the compatibility
rules, local mode and the ``vllm`` stand-in, each asking pdserve/kv/mooncake.py (no I/O)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.deployment.render.engine_pod import instance_pod
from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table
from pdserve.deployment.spec.parse import SpecError, load_manifest_file
from pdserve.deployment.validate import problems
from pdserve.kv import mooncake
from pdserve.local.observe import observed_instances
from pdserve.local.plan import plan_local_run
from pdserve.routing import Role, RoutingTableError, parse_routing_table
from pdserve.sim import vllm_cli
from tests.support.specs import pdd_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MOONCAKE = {"connector": "MooncakeConnector"}


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return dict(pod["spec"]["containers"][0])


def _kv_config(pod: dict[str, Any]) -> dict[str, Any]:
    args = _container(pod)["args"]
    return dict(json.loads(args[args.index("--kv-transfer-config") + 1]))


def test_the_pods_name_their_engine_and_the_prefill_serves_its_bootstrap_port() -> None:
    pdd = pdd_of(
        kvTransfer={**MOONCAKE, "extraConfig": {"mooncake_protocol": "tcp"}}, prefill={"dataParallel": 2}
    )
    prefill, decode = instance_pod(pdd, Role.PREFILL, 0, "x1"), instance_pod(pdd, Role.DECODE, 0, "y2")
    assert _kv_config(prefill) == {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer",
        "engine_id": "r1-prefill-0-x1",  # the instance's name: the router derives remote_engine_id from it
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }
    assert _kv_config(decode)["kv_role"] == "kv_consumer"
    p, d = _container(prefill), _container(decode)
    assert {e["name"]: e.get("value") for e in p["env"]}["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "8998"
    assert {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in p["env"]
    assert {port["name"]: port["containerPort"] for port in p["ports"]} == {
        "http": 8000,
        "mc-bootstrap": 8998,
    }
    assert [port["name"] for port in d["ports"]] == ["http"]  # a decode runs no bootstrap server
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in {e["name"] for e in d["env"]}
    for c in (p, d):
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_the_table_names_each_prefills_bootstrap_server_and_requires_it() -> None:
    pdd = pdd_of(kvTransfer=MOONCAKE)
    observed = [
        ObservedInstance(Role.PREFILL, 0, "r1-prefill-0", "10.0.0.5", True),
        ObservedInstance(Role.PREFILL, 1, "r1-prefill-1", "fd00::7", True),
        ObservedInstance(Role.DECODE, 0, "r1-decode-0", "10.0.0.9", True),
    ]
    table = build_routing_table(pdd, observed, None)
    assert table.connector.type == "mooncake" and table.connector.transfer_mode is None
    assert [i.kv_address for i in table.prefill] == ["http://10.0.0.5:8998", "http://[fd00::7]:8998"]
    assert table.decode[0].kv_address is None
    assert parse_routing_table(table.to_dict()) == table
    doc = table.to_dict()
    del doc["prefill"][0]["kvAddress"]
    with pytest.raises(RoutingTableError, match="required for the mooncake connector") as info:
        parse_routing_table(doc)
    assert info.value.path == "prefill[0].kvAddress"


def test_a_mode_and_an_external_bootstrap_server_are_refused() -> None:
    with pytest.raises(SpecError, match="only valid with connector MoRIIOConnector, not MooncakeConnector"):
        pdd_of(kvTransfer={**MOONCAKE, "transferMode": "READ"})
    with pytest.raises(SpecError, match="names each prefill's own bootstrap server") as info:
        pdd_of(kvTransfer={**MOONCAKE, "extraConfig": {"bootstrap_server_address": "10.0.0.1:8998"}})
    assert info.value.path == "spec.kvTransfer.extraConfig.bootstrap_server_address"


def test_block_sizes_must_match_and_the_bootstrap_port_is_pdserves() -> None:
    mixed = pdd_of(
        kvTransfer=MOONCAKE, prefill={"args": ["--block-size", "16"]}, decode={"args": ["--block-size=32"]}
    )
    assert problems(mixed, None) == [
        "spec.prefill.args, spec.decode.args: --block-size 16 on prefill and 32 on decode; with "
        "MooncakeConnector both roles must use the same block size"
    ]
    same = {"args": ["--block-size", "32"]}
    assert problems(pdd_of(kvTransfer=MOONCAKE, prefill=same, decode=same), None) == []
    # NIXL's rule allows a smaller prefill block; Mooncake copies block for block
    assert (
        problems(
            pdd_of(prefill={"args": ["--block-size", "16"]}, decode={"args": ["--block-size", "32"]}), None
        )
        == []
    )
    env = {"env": [{"name": "VLLM_MOONCAKE_BOOTSTRAP_PORT", "value": "9000"}]}
    assert problems(pdd_of(kvTransfer=MOONCAKE, prefill=env), None) == [
        "spec.prefill.env[0]: VLLM_MOONCAKE_BOOTSTRAP_PORT is set by pdserve to 8998 (each prefill's "
        "bootstrap server, which the router names in every decode request); remove it from env"
    ]


def test_local_mode_moves_each_prefills_bootstrap_port_and_the_table_follows() -> None:
    pdd = load_manifest_file(EXAMPLES / "cpu" / "mooncake-1p-1d-dp2.yaml")
    plan = plan_local_run(
        pdd, "vllm", [9001, 9002], 8000, "routing.json", device="cpu", cores=[0, 1], kv_ports=[5600, 5700]
    )
    prefill, decode = plan.engines
    assert prefill.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "5600" and prefill.ports == (9001, 5600)
    assert decode.ports == (9002,)  # the decode listens on no bootstrap port
    assert prefill.env["VLLM_HOST_IP"] == "127.0.0.1" and "UCX_TLS" not in prefill.env
    assert (
        json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])["engine_id"] == prefill.name
    )
    table = build_routing_table(
        plan.deployment, observed_instances(plan.deployment, plan.engines, [True, True]), None
    )
    assert table.prefill[0].kv_address == "http://127.0.0.1:5600"


def test_the_vllm_stand_in_plays_mooncake_under_the_engine_id_it_was_given() -> None:
    pdd = pdd_of(kvTransfer=MOONCAKE, prefill={"dataParallel": 2})
    pod = instance_pod(pdd, Role.PREFILL, 0, "x1")
    container = _container(pod)
    serve = vllm_cli.parse(container["args"])
    env = {"HOSTNAME": "other-pod", "VLLM_HOST_IP": "10.0.0.5", "VLLM_MOONCAKE_BOOTSTRAP_PORT": "8998"}
    argv = vllm_cli.sim_argv(serve, env)
    assert argv[argv.index("--instance-name") + 1] == "r1-prefill-0-x1"
    assert argv[argv.index("--kv-connector") + 1] == "mooncake"
    assert (argv[argv.index("--kv-host") + 1], argv[argv.index("--kv-port") + 1]) == ("10.0.0.5", "8998")


@pytest.mark.parametrize(
    ("engine_id", "rank"), [("p0", 0), ("p0_dp3", 3), ("p0-dp3", None), ("p1_dp0", None), ("p0_dpx", None)]
)
def test_a_pull_notice_names_the_rank_as_vllm_names_its_engines(engine_id: str, rank: int | None) -> None:
    assert mooncake.CONNECTOR.simulate.engine_rank(engine_id, "p0") == rank
