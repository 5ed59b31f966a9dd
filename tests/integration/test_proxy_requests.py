"""Request shapes P/D cannot serve as one sequence, and each attempt's engine request id, through
a real proxy in front of real `pdserve sim` processes (issue 12, part 5).

* A batched prompt and ``n > 1`` fan out into one P/D request per sequence, merged in OpenAI's
  shape (choices re-indexed, usage summed, streams merged by index); ``best_of > 1``,
  ``use_beam_search`` and more sequences than ``--max-fan-out`` get a 400 naming the field.
* Every leg carries its own X-Request-Id (``<client id>-p1``, ``-d1``, ``-d2``...): the
  simulator refuses a second request in flight with an id it is serving, as vLLM collides.
"""

from __future__ import annotations

import json
import threading
import time
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
    sse_error,
    sse_events,
)

TEXT = " tok0 tok1 tok2"  # what the simulator generates for max_tokens 3
EJECT_S = 0.2  # short cool-downs: every test starts with every slot healthy


stack = module_stack(
    "requests",
    {
        "p0": prefill_sim(),
        "p1": prefill_sim(),
        "d0": decode_sim(2),
        "d1": decode_sim(),
        "pslow": prefill_sim(1, 1, "--ttft-ms", "400"),
    },  # pslow holds requests in flight
    routed=(["p0", "p1"], ["d0", "d1"]),
    proxy=["--max-fan-out", "8", "--eject-seconds", str(EJECT_S)],
)


def prefill(pd: PDStack) -> list[Sim]:
    return [pd.sims["p0"], pd.sims["p1"]]


def decode(pd: PDStack) -> list[Sim]:
    return [pd.sims["d0"], pd.sims["d1"]]


@pytest.fixture(autouse=True)
def fresh(stack: PDStack) -> None:
    time.sleep(EJECT_S + 0.05)  # earlier ejections have cooled down
    stack.route(prefill(stack), decode(stack))


def legs(sims: list[Sim]) -> list[dict[str, Any]]:
    return [leg for sim in sims for leg in sim.legs()]


def post(stack: PDStack, path: str, body: dict[str, Any], rid: str) -> HttpAnswer:
    return http("POST", stack.url + path, body, headers={"X-Request-Id": rid})


def merged_stream(answer: HttpAnswer) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """Text per choice index, and every event of an SSE answer (which ends with one [DONE])."""
    assert answer.status == 200, answer.body
    events = sse_events(answer.body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    docs = [json.loads(e) for e in events[:-1]]
    text: dict[int, str] = {}
    for doc in docs:
        for choice in doc["choices"]:
            piece = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
            text[choice["index"]] = text.get(choice["index"], "") + piece
    return text, docs


# --- fan-out ------------------------------------------------------------------------------------

PROMPTS = ["alpha beta", "gamma delta epsilon", "zeta"]  # 2, 3 and 1 prompt tokens for the sim


def test_batched_prompt_fans_out_into_one_pd_request_per_prompt(stack: PDStack) -> None:
    body = {"prompt": PROMPTS, "max_tokens": 3, "echo": True}
    answer = post(stack, "/v1/completions", body, "batch-1")
    assert answer.status == 200, answer.body
    doc = answer.json()
    assert doc["id"] == "cmpl-batch-1" and answer.headers["x-request-id"] == "batch-1"
    # choice i answers prompt i (echo puts the prompt before the output)
    assert [(c["index"], c["text"]) for c in doc["choices"]] == [(i, p + TEXT) for i, p in enumerate(PROMPTS)]
    assert doc["usage"]["prompt_tokens"] == 6 and doc["usage"]["completion_tokens"] == 9
    assert doc["usage"]["total_tokens"] == 15
    # one prefill and one decode per prompt, each leg with its own id, each with one prompt
    prefills = {leg["request_id"]: leg for leg in legs(prefill(stack))}
    decodes = {leg["request_id"]: leg for leg in legs(decode(stack))}
    assert set(prefills) == {f"batch-1-{k}-p1" for k in range(3)}
    assert set(decodes) == {f"batch-1-{k}-d1" for k in range(3)}
    for k, prompt in enumerate(PROMPTS):
        assert prefills[f"batch-1-{k}-p1"]["prompt"] == prompt
        assert decodes[f"batch-1-{k}-d1"]["kv_transfer_params"] == prefills[f"batch-1-{k}-p1"]["kv_answer"]
    assert all(s.stats()["malformed_handoff"] == 0 for s in decode(stack))
    assert "request id=batch-1 " in stack.proxy.log() if stack.proxy else False


def test_batched_prompt_streams_merged_by_index(stack: PDStack) -> None:
    body = {
        "prompt": PROMPTS,
        "max_tokens": 3,
        "echo": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, docs = merged_stream(post(stack, "/v1/completions", body, "batch-2"))
    assert text == {i: p + TEXT for i, p in enumerate(PROMPTS)}
    assert {d["id"] for d in docs} == {"cmpl-batch-2"}
    usage_chunks = [d for d in docs if not d["choices"]]
    assert len(usage_chunks) == 1 and docs[-1] is usage_chunks[0]  # one usage chunk, last
    assert usage_chunks[0]["usage"]["prompt_tokens"] == 6
    assert usage_chunks[0]["usage"]["completion_tokens"] == 9
    assert sum(s.stats()["by_leg"]["decode"] for s in decode(stack)) == 3
    assert all(leg["stream"] is True for leg in legs(decode(stack)))


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streaming"])
def test_chat_n_fans_out_with_vllms_child_seeds(stack: PDStack, stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "seed": 7}
    answer = post(stack, "/v1/chat/completions", {**body, "stream": stream}, f"chat-n-{stream}")
    if stream:
        text, docs = merged_stream(answer)
        assert text == {0: TEXT, 1: TEXT, 2: TEXT}
        assert {d["id"] for d in docs} == {f"chatcmpl-chat-n-{stream}"}
        roles = [c["index"] for d in docs for c in d["choices"] if c["delta"].get("role") == "assistant"]
        assert sorted(roles) == [0, 1, 2]  # each choice opens with its role, as vLLM's n > 1 does
    else:
        assert answer.status == 200, answer.body
        doc = answer.json()
        assert [(c["index"], c["message"]["content"]) for c in doc["choices"]] == [
            (i, TEXT) for i in range(3)
        ]
        assert doc["usage"]["prompt_tokens"] == 2  # the prompt once, as vLLM counts it for n > 1
        assert doc["usage"]["completion_tokens"] == 9
    sent = legs(decode(stack)) + legs(prefill(stack))
    assert len(sent) == 6 and all(leg["n"] is None for leg in sent)  # no leg asks for n
    # child i gets seed + i, as vLLM seeds its child requests
    assert sorted(leg["seed"] for leg in legs(decode(stack))) == [7, 8, 9]


def test_batch_times_n_orders_choices_prompt_by_prompt(stack: PDStack) -> None:
    body = {"prompt": ["one two", "three"], "n": 2, "max_tokens": 3, "echo": True}
    answer = post(stack, "/v1/completions", body, "batch-n")
    assert answer.status == 200, answer.body
    doc = answer.json()
    assert [c["text"] for c in doc["choices"]] == ["one two" + TEXT] * 2 + ["three" + TEXT] * 2
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2, 3]
    assert doc["usage"]["prompt_tokens"] == 3 and doc["usage"]["completion_tokens"] == 12
    assert sorted(leg["request_id"] for leg in legs(prefill(stack))) == [f"batch-n-{k}-p1" for k in range(4)]


def test_fanned_out_stream_ends_with_the_error_of_a_broken_part(stack: PDStack) -> None:
    stack.sims["d0"].faults("drop-mid-stream")  # one of the two parts lands on d0, the other on d1
    before = stack.metric("pdserve_proxy_requests_total", outcome="stream_error")
    answer = post(stack, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 3, "stream": True}, "broken")
    assert answer.status == 200  # the first bytes had reached the client
    events = sse_events(answer.body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "stream broke" in sse_error(events[-2], 502)["message"]
    assert stack.metric("pdserve_proxy_requests_total", outcome="stream_error") == before + 1
    stack.sims["d0"].faults()


REFUSED = [
    ({"best_of": 2}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"n": 9}, "n"),  # 9 sequences, --max-fan-out is 8 here
    ({"prompt": ["x"] * 9}, "prompt"),
    ({"prompt": ["x", "y", "z"], "n": 3}, "n"),
    ({"n": 0}, "n"),
    ({"best_of": "2"}, "best_of"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streaming"])
@pytest.mark.parametrize(("extra", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_shapes_pd_cannot_serve_are_refused_naming_the_field(
    stack: PDStack, extra: dict[str, Any], field: str, stream: bool
) -> None:
    answer = stack.complete(stream=stream, **extra)
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (field, 400) and field in error["message"]
    assert all(s.stats()["requests"] == 0 for s in stack.sims.values())  # nothing reached an engine


# --- engine request ids -------------------------------------------------------------------------


def test_every_attempt_of_every_leg_gets_its_own_request_id(stack: PDStack) -> None:
    p0, d0, d1 = stack.sims["p0"], stack.sims["d0"], stack.sims["d1"]
    stack.route([p0], [d1, d0])
    d0.faults("http-500")
    for rid in ("retry-a", "retry-b"):  # consecutive requests: at least one starts on d0
        assert stack.complete(headers={"X-Request-Id": rid}).status == 200
    retried = 0
    for rid in ("retry-a", "retry-b"):
        decodes = sorted(
            (int(leg["request_id"].rpartition("-d")[2]), sim.name, leg["outcome"])
            for sim in (d0, d1)
            for leg in sim.legs()
            if leg["request_id"].startswith(f"{rid}-d")
        )
        # -d1, -d2, ...: every decode attempt its own id; all but the last failed at d0
        assert [n for n, _, _ in decodes] == list(range(1, len(decodes) + 1))
        assert decodes[-1][1:] == ("d1", "ok")
        assert all((name, outcome) == ("d0", "http-500") for _, name, outcome in decodes[:-1])
        # a decode that answered 5xx may have freed the KV: each retry ran a new prefill, -p2, ...
        prefills = sorted(leg["request_id"] for leg in p0.legs() if leg["request_id"].startswith(rid))
        assert prefills == [f"{rid}-p{n}" for n in range(1, len(decodes) + 1)]
        retried += len(decodes) - 1
    assert retried >= 1
    ids = [leg["request_id"] for sim in stack.sims.values() for leg in sim.legs()]
    assert len(ids) == len(set(ids))  # no engine ever saw an id twice
    assert "request id=retry-a " in stack.proxy.log() if stack.proxy else False  # the client's id


def test_concurrent_requests_with_one_client_id_do_not_collide_at_the_engine(stack: PDStack) -> None:
    slow = stack.sims["pslow"]
    stack.route([slow], decode(stack))
    answers: list[HttpAnswer] = []

    def send() -> None:
        answers.append(stack.complete(headers={"X-Request-Id": "same-id"}))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [a.status for a in answers] == [200, 200, 200], [a.body for a in answers]
    assert all(a.headers["x-request-id"] == "same-id" for a in answers)  # the client's id comes back
    sent = sorted(leg["request_id"] for leg in slow.legs())
    assert len(sent) == 3 and len(set(sent)) == 3 and "same-id-p1" in sent
    assert all(s.startswith("same-id") and s.endswith("-p1") for s in sent)
    assert slow.stats()["rejected"].get("duplicate_request_id", 0) == 0
