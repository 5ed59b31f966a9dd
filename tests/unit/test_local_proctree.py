"""Which processes belong to an engine (pure: synthetic /proc tables), and /proc parsing."""

from __future__ import annotations

import os

from pdserve.local.proctree import ProcessTree, ProcStat, members, parse_stat, port_free, scan


def stat(pid: int, ppid: int, sid: int, start: int = 100, zombie: bool = False) -> ProcStat:
    return ProcStat(pid, ppid, sid, start, zombie)


def test_parse_stat_survives_spaces_and_parentheses_in_the_command() -> None:
    line = "4242 (VLLM::Worker (x) y) S 4200 4200 4200 0 -1 4194560 1 0 0 0 5 1 0 0 20 0 3 0 98765 1 2 3"
    assert parse_stat(line) == ProcStat(4242, 4200, 4200, 98765, False)
    assert parse_stat("12 (z) Z 1 12 12 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55 0 0") == ProcStat(
        12, 1, 12, 55, True
    )
    assert parse_stat("garbage") is None


def test_members_are_descendants_session_and_known_survivors() -> None:
    leader = 500
    table = {
        500: stat(500, 1, 500),  # the engine's main process
        501: stat(501, 500, 500),  # API server
        502: stat(502, 501, 502),  # left the session, still a descendant
        503: stat(503, 1, 500),  # orphaned, still in the session
        504: stat(504, 1, 504),  # orphaned and left the session: only known from before
        505: stat(505, 500, 500, zombie=True),  # exited, not yet reaped
        900: stat(900, 1, 900),  # a stranger
    }
    found = members(table, leader, 100, known={(504, 100), (777, 100)})
    assert {pid for pid, _ in found} == {500, 501, 502, 503, 504}


def test_a_reused_pid_is_never_taken_for_the_engine() -> None:
    # The leader died and its pid went to a stranger that leads a session of its own.
    table = {
        500: stat(500, 1, 500, start=900),
        501: stat(501, 500, 500, start=901),
        503: stat(503, 1, 500, start=150),  # left over from the old session? sid now ambiguous
        600: stat(600, 1, 600, start=120),
    }
    found = members(table, 500, 100, known={(600, 120), (601, 110)})
    assert found == {(600, 120)}  # only what was seen before, matched by start time


def test_scan_finds_this_process() -> None:
    table = scan()
    me = table[os.getpid()]
    assert me.ppid == os.getppid() and me.sid == os.getsid(0) and not me.zombie
    tree = ProcessTree.of(os.getpid())
    assert os.getpid() in tree.pids()


def test_port_free() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_free(port)
    assert port_free(port)
