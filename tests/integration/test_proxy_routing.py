"""The proxy in front of real `pdserve sim` processes: the RFC's role shapes with exact per-slot
counts, and each connector's legs as the backends received them.

One pool of simulators and one proxy serve the whole module; each test writes a new routing
table (the proxy hot-reloads it) and resets the simulators' counters.
"""

from __future__ import annotations

import json
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.support.pdstack import (
    HttpAnswer,
    PDStack,
    Sim,
    decode_sim,
    http,
    module_stack,
    prefill_sim,
    sse_events,
)

# TP8 and DP8 instances of both roles, to route any shape between them
stack = module_stack(
    "routing",
    {
        **{f"ptp{i}": prefill_sim(1, 8) for i in range(2)},
        **{f"pdp{i}": prefill_sim(8, 1) for i in range(2)},
        **{f"dtp{i}": decode_sim(1, 8) for i in range(4)},
        **{f"ddp{i}": decode_sim(8, 1) for i in range(3)},
    },
    routed=(["ptp0"], ["dtp0"]),
)


def send_all(pd: PDStack, n: int, streaming: bool | None = None) -> list[tuple[bool, str, HttpAnswer]]:
    """``n`` requests, 8 at a time; streaming or not (None: every other one streams)."""

    def one(i: int) -> tuple[bool, str, HttpAnswer]:
        stream = i % 2 == 1 if streaming is None else streaming
        rid = f"req-{uuid.uuid4().hex}"
        return stream, rid, pd.complete(stream=stream, headers={"X-Request-Id": rid})

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def assert_answer(stream: bool, answer: HttpAnswer, tokens: int) -> None:
    assert answer.status == 200, answer.body
    text = "".join(f" tok{i}" for i in range(tokens))
    if stream:
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = sse_events(answer.body)
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text
    else:
        assert answer.json()["choices"][0]["text"] == text


def slot_count(sims: list[Sim]) -> int:
    return sum(s.dp_size for s in sims)


SHAPES = {
    "1P_TP8:1D_TP8": (["ptp0"], ["dtp0"]),
    "2P_TP8:1D_DP8EP": (["ptp0", "ptp1"], ["ddp0"]),
    "2P_TP8:2D_TP8": (["ptp0", "ptp1"], ["dtp0", "dtp1"]),
    "2P_DP8EP:3D_DP8EP": (["pdp0", "pdp1"], ["ddp0", "ddp1", "ddp2"]),
    "2P_DP8EP:4D_TP8": (["pdp0", "pdp1"], ["dtp0", "dtp1", "dtp2", "dtp3"]),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_role_shape_gives_every_slot_exactly_k(stack: PDStack, shape: str) -> None:
    prefill = [stack.sims[n] for n in SHAPES[shape][0]]
    decode = [stack.sims[n] for n in SHAPES[shape][1]]
    stack.route(prefill, decode)
    sp, sd = slot_count(prefill), slot_count(decode)
    n = 2 * math.lcm(sp, sd)  # k >= 2 for both roles at once
    for stream, _, answer in send_all(stack, n):
        assert_answer(stream, answer, tokens=3)

    for sims, leg, per_slot in ((prefill, "prefill", n // sp), (decode, "decode", n // sd)):
        for sim in sims:
            stats = sim.stats()
            assert stats["by_rank"] == {str(r): per_slot for r in range(sim.dp_size)}, (
                sim.name,
                stats["by_rank"],
            )
            assert stats["by_leg"][leg] == per_slot * sim.dp_size
            # DP instances get the rank header on every leg; TP8 instances never do
            assert stats["without_rank_header"] == (0 if sim.dp_size > 1 else per_slot)
            assert stats["malformed_handoff"] == 0
    for name, sim in stack.sims.items():
        if name not in SHAPES[shape][0] + SHAPES[shape][1]:
            assert sim.stats()["requests"] == 0, name


CONNECTORS = {
    "nixl": {"type": "nixl"},
    "moriio-read": {"type": "moriio", "transferMode": "READ"},
    "moriio-write": {"type": "moriio", "transferMode": "WRITE"},
}


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streaming"])
def test_mooncake_legs_name_the_prefill_engine_and_its_bootstrap_with_exact_counts(
    stack: PDStack, stream: bool
) -> None:
    """Serial legs, as for NIXL; the decode's kv_transfer_params are the router's own: the transfer
    (the prefill leg's id), the prefill engine (vLLM's <engine_id>_dp<rank>) and its bootstrap
    server (the table's kvAddress)."""
    prefill = [stack.sims["pdp0"], stack.sims["ptp0"]]
    decode = [stack.sims["ddp0"], stack.sims["dtp0"]]

    def instance(sim: Sim) -> dict[str, Any]:
        return {**sim.instance(), "kvAddress": f"http://{sim.kv_address}"}  # the bootstrap server

    stack.write(
        stack.table([instance(s) for s in prefill], [instance(s) for s in decode], {"type": "mooncake"})
    )
    for sim in stack.sims.values():
        sim.reset()
    n = 18  # 9 prefill slots, 9 decode slots: k = 2
    results = send_all(stack, n, streaming=stream)
    for _, rid, answer in results:
        assert answer.headers["x-request-id"] == rid
        assert_answer(stream, answer, tokens=3)
    pdp0, ptp0, ddp0, dtp0 = (s.stats() for s in (*prefill, *decode))
    assert pdp0["by_rank"] == {str(r): 2 for r in range(8)} and ptp0["by_rank"] == {"0": 2}
    assert ddp0["by_rank"] == {str(r): 2 for r in range(8)} and dtp0["by_rank"] == {"0": 2}
    assert pdp0["without_rank_header"] == ddp0["without_rank_header"] == 0
    assert ddp0["malformed_handoff"] == dtp0["malformed_handoff"] == 0

    prefill_stats = zip(prefill, (pdp0, ptp0), strict=True)
    prefill_legs = {leg["request_id"]: (sim, leg) for sim, st in prefill_stats for leg in st["recent"]}
    decode_legs = [leg for s in (ddp0, dtp0) for leg in s["recent"]]
    assert len(prefill_legs) == len(decode_legs) == n
    assert {rid.removesuffix("-p1") for rid in prefill_legs} == {rid for _, rid, _ in results}
    for leg in decode_legs:
        params = leg["kv_transfer_params"]
        sim, prefill_leg = prefill_legs[params["transfer_id"]]  # the transfer is the prefill leg's id
        assert prefill_leg["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": params["transfer_id"],
        }
        assert "kv_answer" not in prefill_leg  # vLLM 0.32's Mooncake prefill answers none
        assert params["remote_bootstrap_addr"] == f"http://{sim.kv_address}"
        expected = f"{sim.name}_dp{prefill_leg['rank']}" if sim.dp_size > 1 else sim.name
        assert params["remote_engine_id"] == expected
        assert leg["request_id"] == params["transfer_id"].removesuffix("-p1") + "-d1"
        assert params["do_remote_prefill"] is True and leg["max_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streaming"])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_connector_legs(stack: PDStack, connector: str, stream: bool) -> None:
    prefill = [stack.sims["pdp0"], stack.sims["ptp0"]]
    decode = [stack.sims["ddp0"], stack.sims["dtp0"]]
    stack.route(prefill, decode, CONNECTORS[connector])
    n = 18  # 9 prefill slots, 9 decode slots: k = 2
    results = send_all(stack, n, streaming=stream)
    moriio = connector.startswith("moriio")
    for is_stream, rid, answer in results:
        assert is_stream is stream
        assert answer.headers["x-request-id"] == rid
        assert_answer(stream, answer, tokens=2 if moriio else 3)  # MoRIIO's decode: max_tokens - 1

    pdp0, ptp0 = (s.stats() for s in prefill)
    assert pdp0["by_rank"] == {str(r): 2 for r in range(8)} and pdp0["without_rank_header"] == 0
    assert ptp0["by_rank"] == {"0": 2}
    ddp0, dtp0 = (s.stats() for s in decode)
    assert ddp0["requests"] == 16 and dtp0["requests"] == 2
    if moriio:
        assert ddp0["without_rank_header"] == 16  # MoRIIO: rank header on the prefill leg only
    else:
        assert ddp0["by_rank"] == {str(r): 2 for r in range(8)} and ddp0["without_rank_header"] == 0
    assert ddp0["malformed_handoff"] == dtp0["malformed_handoff"] == 0

    prefill_legs = [r for s in (pdp0, ptp0) for r in s["recent"]]
    decode_legs = [r for s in (ddp0, dtp0) for r in s["recent"]]
    assert len(prefill_legs) == len(decode_legs) == n
    for leg in prefill_legs:
        assert (leg["max_tokens"], leg["stream"], leg["min_tokens"], leg["stream_options"]) == (
            1,
            False,
            None,
            None,
        )
    for leg in decode_legs:
        assert leg["stream"] is stream and leg["max_tokens"] == (2 if moriio else 3)
    if moriio:
        check_moriio_legs(stack, CONNECTORS[connector]["transferMode"], prefill_legs, decode_legs)
    else:
        check_nixl_legs(prefill_legs, decode_legs, {rid for _, rid, _ in results})


def check_nixl_legs(
    prefill_legs: list[dict[str, Any]], decode_legs: list[dict[str, Any]], ids: set[str]
) -> None:
    # each leg has its own X-Request-Id, made from the client's: <client id>-p1 and <client id>-d1
    by_id = {leg["request_id"].removesuffix("-p1"): leg for leg in prefill_legs}
    assert set(by_id) == ids and all(leg["request_id"].endswith("-p1") for leg in prefill_legs)
    for leg in decode_legs:
        assert leg["request_id"].endswith("-d1")
        prefill_leg = by_id[leg["request_id"].removesuffix("-d1")]
        assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
        # forwarded unchanged: every field the prefill answered, nothing renamed or rebuilt
        assert leg["kv_transfer_params"] == prefill_leg["kv_answer"]


def check_moriio_legs(
    stack: PDStack, mode: str, prefill_legs: list[dict[str, Any]], decode_legs: list[dict[str, Any]]
) -> None:
    kv_of = {s.kv_address: s for s in stack.sims.values()}
    by_transfer = {leg["transfer_id"]: leg for leg in prefill_legs}
    assert len(by_transfer) == len(prefill_legs)  # a fresh transfer id per request
    for leg in decode_legs:
        prefill_leg = by_transfer[leg["transfer_id"]]  # both legs share the transfer id ...
        assert leg["request_id"] == prefill_leg["request_id"]  # ... and the request id
        ids = leg["moriio_request_id"]
        assert ids is not None and ids["uid"] == leg["transfer_id"]
        prefill_sim, decode_sim = kv_of[ids["prefill_kv_address"]], kv_of[ids["decode_kv_address"]]
        assert prefill_sim.role == "prefill" and decode_sim.role == "decode"
        assert prefill_leg["rank_header"] is (prefill_sim.dp_size > 1) and leg["rank_header"] is False
        sent = prefill_leg["kv_transfer_params"]
        assert (sent["remote_dp_size"], sent["remote_tp_size"]) == (decode_sim.dp_size, decode_sim.tp_size)
        params = leg["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert (params["remote_dp_size"], params["remote_tp_size"]) == (
            prefill_sim.dp_size,
            prefill_sim.tp_size,
        )
        if prefill_sim.dp_size > 1:
            assert params["remote_dp_rank"] == prefill_leg["rank"]
        elif mode == "WRITE":
            assert "remote_dp_rank" not in params  # one engine: no rank to name
        else:
            assert params.get("remote_dp_rank", 0) == 0  # READ forwards the prefill's own answer
        if mode == "READ":
            answer = prefill_leg["kv_answer"]
            assert params["remote_engine_id"] == answer["remote_engine_id"]
            assert params["remote_block_ids"] == answer["remote_block_ids"]
        else:
            assert params["remote_engine_id"] is None and params["remote_block_ids"] is None


def test_chat_completions_and_models(stack: PDStack) -> None:
    stack.route([stack.sims["ptp0"]], [stack.sims["ddp0"]])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = http("POST", stack.url + "/v1/chat/completions", chat)
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["message"]["content"] == " tok0 tok1"
    streamed = http("POST", stack.url + "/v1/chat/completions", {**chat, "stream": True})
    events = sse_events(streamed.body)
    assert streamed.status == 200 and events[-1] == "[DONE]"
    assert stack.sims["ddp0"].stats()["by_leg"]["decode"] == 2
    models = http("GET", stack.url + "/v1/models")
    assert models.status == 200 and models.json()["data"][0]["id"] == "sim-model"


# --- revisions ----------------------------------------------------------------------------------


def test_prefills_hand_off_only_to_decodes_of_their_revision(stack: PDStack) -> None:
    """Two revisions mid-rollout, plus one prefill and one decode whose revision the other side
    lacks: every handoff stays within its revision, each slot gets its exact share (prefill: one
    counter over all paired prefill slots; decode: each revision's own counter), and the
    unpaired slots take nothing and are reported."""
    s = stack.sims
    revisions = {
        "ra": (["pdp0"], ["ddp0", "dtp0"]),  # 8 prefill slots, 9 decode slots
        "rb": (["ptp0", "ptp1"], ["dtp1", "dtp2"]),  # 2 prefill slots, 2 decode slots
        "rc": (["pdp1"], []),  # prefill only: unpaired
        "rd": ([], ["dtp3"]),  # decode only: unpaired
    }
    prefill = [s[n].instance(revision=rev) for rev, (ps, _) in revisions.items() for n in ps]
    decode = [s[n].instance(revision=rev) for rev, (_, ds) in revisions.items() for n in ds]
    stack.route(prefill, decode)
    n = 90  # 9 per paired prefill slot: revision ra gets 72 requests (8 per decode slot), rb 18 (9 each)
    for stream, _, answer in send_all(stack, n):
        assert_answer(stream, answer, tokens=3)

    assert s["pdp0"].stats()["by_rank"] == {str(r): 9 for r in range(8)}
    assert s["ptp0"].stats()["requests"] == s["ptp1"].stats()["requests"] == 9
    assert s["ddp0"].stats()["by_rank"] == {str(r): 8 for r in range(8)}
    assert s["dtp0"].stats()["requests"] == 8
    assert s["dtp1"].stats()["requests"] == s["dtp2"].stats()["requests"] == 9
    assert s["pdp1"].stats()["requests"] == s["dtp3"].stats()["requests"] == 0  # unpaired: nothing
    for rev, (prefills, decodes) in revisions.items():
        engines = {f"{name}-dp{r}" for name in prefills for r in range(s[name].dp_size)}
        for name in decodes:
            sources = {leg["handoff_from"] for leg in s[name].legs()}
            assert sources <= engines, (rev, name, sources)
    assert s["ddp0"].stats()["malformed_handoff"] == 0

    assert stack.metric("pdserve_proxy_routing_unpaired_slots", role="prefill", revision="rc") == 8
    assert stack.metric("pdserve_proxy_routing_unpaired_slots", role="decode", revision="rd") == 1
    view = stack.debug()
    assert view["revisions"]["ra"] == {"prefill_slots": 8, "decode_slots": 9, "paired": True}
    assert view["revisions"]["rc"] == {"prefill_slots": 8, "decode_slots": 0, "paired": False}
    assert (
        len(view["unpaired"]) == 2 and "revision 'rc' has 8 routable prefill slot(s)" in view["unpaired"][0]
    )
    assert {row["slot"].split("/")[0] for row in view["slots"]["prefill"]} == {"pdp0", "ptp0", "ptp1"}
    assert stack.proxy is not None
    assert "revision 'rd' has 1 routable decode slot(s) but no routable prefill instance" in stack.proxy.log()
    # a revision losing its last decode turns its prefills off, and the metric follows the table
    stack.route(prefill, [d for d in decode if d["revision"] != "rb"])
    assert stack.metric("pdserve_proxy_routing_unpaired_slots", role="prefill", revision="rb") == 2
    for stream, _, answer in send_all(stack, 16):
        assert_answer(stream, answer, tokens=3)
    assert s["ptp0"].stats()["requests"] == s["ptp1"].stats()["requests"] == 0
    assert s["pdp0"].stats()["by_rank"] == {str(r): 2 for r in range(8)}
