"""The live view counts client requests (not attempts), shows client errors, and the runner's
words for how a process ended say a signal when one ended it."""

from __future__ import annotations

import io
import signal
from typing import Any

from pdserve.local.child import describe_exit
from pdserve.local.view import LiveView, render_frame, request_totals, summary_line


def _debug(requests: dict[str, int]) -> dict[str, Any]:
    """8 client requests, one retried on the other decode slot: 9 decode legs."""
    slot = lambda key, n, errors=0: {"slot": key, "requests": n, "in_flight": 0, "errors": errors}  # noqa: E731
    return {
        "generation": 2,
        "policy": "flat-interleaved",
        "requests": requests,
        "table": {
            "deployment": "demo",
            "prefill": [{"name": "p-0", "url": "u", "dpSize": 1, "ready": True}],
            "decode": [{"name": "d-0", "url": "u", "dpSize": 2, "ready": True}],
        },
        "slots": {"prefill": [slot("p-0/0", 8)], "decode": [slot("d-0/0", 5, 1), slot("d-0/1", 4)]},
    }


def test_the_header_counts_requests_not_attempts_and_shows_client_errors() -> None:
    debug = _debug({"ok": 8, "client_error": 3})
    frame = render_frame(debug, [], color=False)
    assert frame[1].startswith("requests 11   ok 8   client errors 3   failed 0   cancelled 0   in flight 0")
    assert "slot errors 1" in frame[1]
    assert "client errors 3" in summary_line(debug) and "requests 11: ok 8" in summary_line(debug)


def test_failures_group_what_is_neither_ok_nor_the_clients() -> None:
    totals = request_totals(
        {"requests": {"ok": 5, "upstream_error": 1, "no_slot": 2, "shed": 1, "cancelled": 1}}
    )
    assert (totals.total, totals.ok, totals.client_errors, totals.failed, totals.cancelled) == (
        10,
        5,
        0,
        4,
        1,
    )
    assert request_totals({}).total == 0


def test_client_errors_are_red_only_when_there_are_some() -> None:
    assert "\x1b[31mclient errors 2" in render_frame(_debug({"ok": 1, "client_error": 2}), [])[1]
    assert "\x1b[31mclient errors" not in render_frame(_debug({"ok": 1}), [])[1]


def test_the_live_view_prints_its_last_word_under_the_frame() -> None:
    out = io.StringIO()
    LiveView(out).final("stopped on SIGINT (Ctrl-C): 3 engine(s) and the router; 5 process(es) got SIGTERM")
    (line,) = out.getvalue().splitlines()
    assert line.endswith(
        "s  stopped on SIGINT (Ctrl-C): 3 engine(s) and the router; 5 process(es) got SIGTERM"
    )


def test_an_exit_says_the_signal_that_caused_it() -> None:
    assert describe_exit(-signal.SIGTERM) == "was stopped by SIGTERM"
    assert describe_exit(-signal.SIGKILL) == "was stopped by SIGKILL"
    assert describe_exit(128 + signal.SIGTERM) == "exited with code 143 (stopped by SIGTERM)"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(0) == "exited with code 0"
