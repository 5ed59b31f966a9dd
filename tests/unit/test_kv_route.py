"""Each connector's route part: its request rewriting, field by field (pure functions, no I/O)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdserve import kv
from pdserve.kv.base import LegIds, Route
from pdserve.kv.moriio import MoriioRoute as MoriioConnector
from pdserve.kv.moriio import parse_request_id as parse_moriio_request_id
from pdserve.kv.nixl import NixlRoute as NixlConnector
from pdserve.kv.nixl import prefill_params as nixl_prefill_params
from pdserve.routing import Connector, Instance, Slot

UID = "0123456789abcdef0123456789abcdef"
P_DP8 = Slot(Instance("p0", "http://p0:8000", 8, 1, True, kv_address="10.0.0.5:6301"), 5)
P_TP8 = Slot(Instance("p1", "http://p1:8000", 1, 8, True, kv_address="10.0.0.6:6301"), 0)
D_DP2 = Slot(Instance("d0", "http://d0:8000", 2, 4, True, kv_address="10.0.0.9:7001"), 1)
D_TP8 = Slot(Instance("d1", "http://d1:8000", 1, 8, True, kv_address="10.0.0.10:7001"), 0)

CLIENT: dict[str, Any] = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 20,
    "max_completion_tokens": 20,
    "min_tokens": 3,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.0,
}

# What real vLLM's NIXL prefill answered (docs: vllm-wire-format), extra fields included.
NIXL_ANSWER: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3, 4]],
    "remote_engine_id": "2b645641-1847-4149-954e-fe5a719f2919",
    "remote_request_id": "cmpl-82ea8aadc2e5dc1c-0-b520a06b",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 481,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}


def make_connector(spec: Connector) -> Route:
    return kv.by_table(spec.type).route(spec.transfer_mode)


def test_registry_builds_connectors_from_the_table() -> None:
    assert {"nixl", "moriio"} <= set(kv.table_types())
    assert isinstance(make_connector(Connector("nixl")), NixlConnector)
    moriio = make_connector(Connector("moriio", "WRITE"))
    assert isinstance(moriio, MoriioConnector) and moriio.concurrent
    assert not make_connector(Connector("moriio", "READ")).concurrent
    assert not make_connector(Connector("nixl")).concurrent
    with pytest.raises(ValueError, match="unknown connector type"):
        make_connector(Connector("lmcache"))
    with pytest.raises(ValueError, match="READ or WRITE"):
        MoriioConnector("PUSH")


# --- NIXL ---------------------------------------------------------------------------------------


def test_nixl_prefill_leg() -> None:
    c = NixlConnector()
    original = copy.deepcopy(CLIENT)
    ids = c.ids("req-1", 1, 1, P_DP8, D_DP2, UID)
    assert ids == LegIds("req-1-p1", "req-1-d1")  # each leg its own X-Request-Id
    assert c.ids("req-1", 2, 3, P_DP8, D_DP2, UID) == LegIds("req-1-p2", "req-1-d3")
    assert c.reusable_handoff  # the handoff names the prefill only: any decode may pull it
    plan = c.prefill_leg(CLIENT, P_DP8, D_DP2, ids)
    assert plan.dp_rank == 5
    expected = {k: v for k, v in CLIENT.items() if k not in ("stream_options", "min_tokens")}
    expected.update(
        max_tokens=1, max_completion_tokens=1, stream=False, kv_transfer_params=nixl_prefill_params()
    )
    assert plan.body == expected
    assert plan.body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert original == CLIENT  # the client's body is not mutated


def test_nixl_prefill_leg_adds_no_max_completion_tokens_the_client_did_not_send() -> None:
    plan = NixlConnector().prefill_leg({"prompt": "x"}, P_TP8, D_TP8, LegIds("r-p1", "r-d1"))
    assert "max_completion_tokens" not in plan.body and plan.body["max_tokens"] == 1
    assert plan.dp_rank is None  # TP8: one engine, no rank header


def test_nixl_decode_leg_forwards_the_handoff_unchanged() -> None:
    c = NixlConnector()
    plan = c.decode_leg(CLIENT, P_DP8, D_DP2, LegIds("req-1-p1", "req-1-d1"), NIXL_ANSWER)
    assert plan.dp_rank == 1
    assert plan.body == {**CLIENT, "kv_transfer_params": NIXL_ANSWER}
    assert plan.body["kv_transfer_params"] is not NIXL_ANSWER  # a copy, equal field for field
    assert c.decode_leg(CLIENT, P_DP8, D_TP8, LegIds("r-p1", "r-d1"), NIXL_ANSWER).dp_rank is None


def test_nixl_handoff_validation() -> None:
    c = NixlConnector()
    assert c.handoff_problems(NIXL_ANSWER) == []
    broken = {k: v for k, v in NIXL_ANSWER.items() if k not in ("remote_host", "remote_port")}
    assert c.handoff_problems(broken) == ["remote_host", "remote_port"]
    assert c.handoff_problems({**NIXL_ANSWER, "remote_request_id": ""}) == ["remote_request_id"]
    assert c.handoff_problems(None) == ["kv_transfer_params"]


# --- MoRIIO -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["READ", "WRITE"])
def test_moriio_ids_encode_both_kv_addresses(mode: str) -> None:
    connector = MoriioConnector(mode)
    ids = connector.ids("client-id", 1, 1, P_DP8, D_DP2, UID)
    assert ids.prefill == f"___prefill_addr_10.0.0.5:6301___decode_addr_10.0.0.9:7001_{UID}"
    assert ids.decode == ids.prefill  # MoRIIO pairs the legs by their shared id
    assert ids.transfer_id == UID
    assert not connector.reusable_handoff  # the id names one decode: a new decode needs a new prefill
    parsed = parse_moriio_request_id(ids.prefill)
    assert parsed is not None
    assert (parsed.prefill_kv_address, parsed.decode_kv_address, parsed.uid) == (
        "10.0.0.5:6301",
        "10.0.0.9:7001",
        UID,
    )


@pytest.mark.parametrize("mode", ["READ", "WRITE"])
def test_moriio_prefill_leg_carries_the_decode_shape_and_the_rank_header(mode: str) -> None:
    c = MoriioConnector(mode)
    ids = c.ids("x", 1, 1, P_DP8, D_DP2, UID)
    plan = c.prefill_leg(CLIENT, P_DP8, D_DP2, ids)
    assert plan.dp_rank == 5
    assert plan.body["max_tokens"] == 1 and plan.body["stream"] is False
    assert "stream_options" not in plan.body and "min_tokens" not in plan.body
    assert plan.body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": UID,
        "remote_dp_size": 2,
        "remote_tp_size": 4,
    }


def test_moriio_read_decode_leg() -> None:
    c = MoriioConnector("READ")
    ids = c.ids("x", 1, 1, P_DP8, D_DP2, UID)
    answer = {"remote_engine_id": "p0-dp5", "remote_block_ids": [[7, 8]], "transfer_id": UID}
    assert c.handoff_problems(answer) == []
    plan = c.decode_leg(CLIENT, P_DP8, D_DP2, ids, answer)
    assert plan.dp_rank is None  # the rank header goes on the prefill leg only
    assert plan.body["max_tokens"] == 19 and plan.body["max_completion_tokens"] == 19
    assert plan.body["stream"] is True and plan.body["stream_options"] == CLIENT["stream_options"]
    kv = plan.body["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == "p0-dp5" and kv["remote_block_ids"] == [[7, 8]]
    assert kv["transfer_id"] == UID
    assert (kv["remote_dp_size"], kv["remote_tp_size"], kv["remote_dp_rank"]) == (8, 1, 5)


def test_moriio_read_handoff_validation() -> None:
    c = MoriioConnector("READ")
    assert c.handoff_problems({"transfer_id": UID}) == ["remote_engine_id", "remote_block_ids"]
    assert c.handoff_problems("nope") == ["kv_transfer_params"]


def test_moriio_write_decode_leg_goes_out_without_the_prefill_answer() -> None:
    c = MoriioConnector("WRITE")
    ids = c.ids("x", 1, 1, P_TP8, D_TP8, UID)
    assert c.handoff_problems(None) == []  # WRITE: only the prefill's status matters
    plan = c.decode_leg({"prompt": "x", "max_tokens": 1}, P_TP8, D_TP8, ids, None)
    assert plan.body["max_tokens"] == 1  # never below one
    kv = plan.body["kv_transfer_params"]
    assert kv["remote_engine_id"] is None and kv["remote_block_ids"] is None
    assert kv["transfer_id"] == UID and kv["do_remote_prefill"] is True
    assert (kv["remote_dp_size"], kv["remote_tp_size"]) == (1, 8)
    assert "remote_dp_rank" not in kv  # the prefill has one engine


def test_moriio_decode_without_max_tokens_leaves_it_to_the_server() -> None:
    c = MoriioConnector("READ")
    ids = c.ids("x", 1, 1, P_TP8, D_TP8, UID)
    plan = c.decode_leg({"messages": [{"role": "user", "content": "hi"}]}, P_TP8, D_TP8, ids, None)
    assert "max_tokens" not in plan.body


# --- Mooncake -----------------------------------------------------------------------------------

MOONCAKE_P_DP8 = Slot(Instance("p0", "http://p0:8000", 8, 1, True, kv_address="http://10.0.0.5:8998"), 5)
MOONCAKE_P_TP8 = Slot(Instance("p1", "http://p1:8000", 1, 8, True, kv_address="http://10.0.0.6:8998"), 0)


def test_mooncake_legs_name_the_prefill_engine_its_bootstrap_and_one_transfer() -> None:
    c = make_connector(Connector("mooncake"))
    assert not c.concurrent and c.reusable_handoff  # serial; the handoff names no decode
    ids = c.ids("req-1", 1, 1, MOONCAKE_P_DP8, D_DP2, UID)
    assert ids == LegIds("req-1-p1", "req-1-d1", transfer_id="req-1-p1")
    # a replacement decode for the same prefill names the same transfer
    assert c.ids("req-1", 1, 2, MOONCAKE_P_DP8, D_TP8, UID).transfer_id == "req-1-p1"
    assert c.ids("req-1", 2, 2, MOONCAKE_P_DP8, D_TP8, UID).transfer_id == "req-1-p2"

    original = copy.deepcopy(CLIENT)
    plan = c.prefill_leg(CLIENT, MOONCAKE_P_DP8, D_DP2, ids)
    assert plan.dp_rank == 5
    expected = {k: v for k, v in CLIENT.items() if k not in ("stream_options", "min_tokens")}
    transfer = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "req-1-p1"}
    expected.update(max_tokens=1, max_completion_tokens=1, stream=False, kv_transfer_params=transfer)
    assert plan.body == expected
    assert c.handoff_problems(None) == []  # vLLM 0.32's prefill answers no kv_transfer_params

    plan = c.decode_leg(CLIENT, MOONCAKE_P_DP8, D_DP2, ids, None)
    assert plan.dp_rank == 1
    assert plan.body == {
        **CLIENT,
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": "req-1-p1",
            "remote_engine_id": "p0_dp5",  # vLLM: <engine_id>_dp<global rank> under DP
            "remote_bootstrap_addr": "http://10.0.0.5:8998",
        },
    }
    assert original == CLIENT
    tp8 = c.decode_leg(CLIENT, MOONCAKE_P_TP8, D_TP8, c.ids("r", 1, 1, MOONCAKE_P_TP8, D_TP8, UID), None)
    assert tp8.dp_rank is None
    assert tp8.body["kv_transfer_params"]["remote_engine_id"] == "p1"  # DP1: the engine id as rendered
