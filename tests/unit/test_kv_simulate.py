"""Each connector's simulate part: what a simulated prefill answers, which decode handoffs it
refuses, what the malformed-kv-params fault breaks, and how an untold simulator recognises a
connector's legs (pure functions, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve import kv
from pdserve.kv import mooncake, moriio, nixl
from pdserve.kv.base import SimEngine, SimPrefill

ENGINE = SimEngine(instance="sim-a", rank=1, dp_size=2, tp_size=1, kv_host="127.0.0.1", kv_port=5600)


def test_nixl_prefill_answer_is_a_complete_handoff() -> None:
    prefill = SimPrefill(ENGINE, "cmpl-r-0-01234567", 20, [[1, 2]])
    answer = nixl.CONNECTOR.simulate.prefill_answer(prefill, nixl.prefill_params())
    assert answer is not None
    assert nixl.handoff_problems(answer) == []
    assert nixl.CONNECTOR.simulate.handoff_problems(answer) == []
    assert answer["remote_engine_id"] == "sim-a-dp1"
    assert answer["remote_block_ids"] == [[1, 2]]
    assert answer["remote_request_id"] == "cmpl-r-0-01234567"
    assert answer["remote_num_tokens"] == 20
    assert set(answer) == {
        "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
        "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
        "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens",
    }  # fmt: skip


def test_moriio_prefill_answer_feeds_a_read_decode() -> None:
    params = {"do_remote_decode": True, "transfer_id": "tid", "remote_dp_size": 1}
    answer = moriio.CONNECTOR.simulate.prefill_answer(SimPrefill(ENGINE, "r", 3, [[1]]), params)
    assert answer is not None and answer["transfer_id"] == "tid"
    decode = {**answer, "do_remote_prefill": True}
    assert moriio.CONNECTOR.simulate.handoff_problems(decode) == []
    assert moriio.decode_mode({"transfer_id": "t", "remote_engine_id": None}) == "WRITE"
    assert moriio.decode_mode(decode) == "READ"


def test_malformed_kv_params_break_what_the_decode_needs() -> None:
    answer = {
        "do_remote_prefill": True,
        "remote_engine_id": "e-dp0",
        "remote_block_ids": [[1, 2]],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "cmpl-x-0-abcdef01",
    }
    assert nixl.handoff_problems(answer) == []
    broken = nixl.CONNECTOR.simulate.malformed(answer)
    assert set(answer) - set(broken) == {"remote_host", "remote_port", "remote_request_id"}
    assert nixl.handoff_problems(broken) == ["remote_host", "remote_port"]

    answer = {"transfer_id": "t", "remote_engine_id": "e-dp0", "remote_block_ids": [[1]]}
    assert moriio.prefill_answer_problems(moriio.CONNECTOR.simulate.malformed(answer)) == [
        "remote_engine_id",
        "remote_block_ids",
    ]


@pytest.mark.parametrize(
    ("params", "leg", "expected"),
    [
        (nixl.prefill_params(), "prefill", "nixl"),  # nothing of anyone's own: the default
        ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r"}, "decode", "nixl"),
        ({"do_remote_prefill": True, "remote_engine_id": "e"}, "decode", "nixl"),
        (moriio.prefill_params("t", 2, 1), "prefill", "moriio"),
        (moriio.decode_params("t", 1, 8, None, None), "decode", "moriio"),
        ({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e"}, "decode", "moriio"),
    ],
)
def test_an_untold_simulator_recognises_the_connector(
    params: dict[str, Any], leg: str, expected: str
) -> None:
    assert kv.simulated(params, leg).names.table == expected


def test_the_record_names_moriio_peers_for_every_request() -> None:
    rid = str(moriio.MoriioRequestId("host:10.0.0.5,handshake:6301,notify:61005", "d", "0" * 32))
    record = kv.sim_record(rid)
    assert record["moriio_request_id"] == {
        "prefill_kv_address": "host:10.0.0.5,handshake:6301,notify:61005",
        "decode_kv_address": "d",
        "uid": "0" * 32,
    }
    assert kv.sim_record("plain")["moriio_request_id"] is None
    assert kv.sim_record(None)["moriio_request_id"] is None


def test_mooncake_prefill_answers_nothing_and_the_decode_needs_engine_bootstrap_and_transfer() -> None:
    simulate = mooncake.CONNECTOR.simulate
    assert simulate.prefill_answer(SimPrefill(ENGINE, "r", 3, [[1]]), mooncake.prefill_params("t")) is None
    good = mooncake.decode_params("t", "p0_dp1", "http://10.0.0.5:8998")
    assert simulate.handoff_problems(good) == []
    assert simulate.handoff_problems({**good, "remote_bootstrap_addr": "10.0.0.5:8998"}) == [
        "remote_bootstrap_addr"
    ]
    assert simulate.handoff_problems({**good, "remote_bootstrap_addr": "http://[::1]:8998"}) == []
    missing = {k: v for k, v in good.items() if k not in ("transfer_id", "remote_engine_id")}
    assert simulate.handoff_problems(missing) == ["transfer_id", "remote_engine_id"]
    assert simulate.handoff_problems("x") == ["kv_transfer_params"]


@pytest.mark.parametrize(
    ("params", "leg"),
    [
        (mooncake.prefill_params("t"), "prefill"),
        (mooncake.decode_params("t", "e", "http://h:1"), "decode"),
        ({"do_remote_prefill": True, "remote_bootstrap_addr": "x"}, "decode"),
    ],
)
def test_an_untold_simulator_recognises_mooncake(params: dict[str, Any], leg: str) -> None:
    assert kv.simulated(params, leg) is mooncake.CONNECTOR
