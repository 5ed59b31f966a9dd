"""`pdserve bench replay`'s refusals: a malformed trace names its line and field and sends nothing
(exit 2), a server that is not there says what to do (exit 1)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from pdserve.cli import main
from tests.support.procs import free_port


@pytest.fixture
def counting_server() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server on loopback that records every request it gets."""
    seen: list[str] = []
    port = free_port()
    loop = asyncio.new_event_loop()

    async def record(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path}")
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", seen
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_a_malformed_line_is_named_and_nothing_is_sent(
    tmp_path: Path, counting_server: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, seen = counting_server
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
        '{"timestamp": 5, "input_length": 10, "output_length": "two", "hash_ids": [1]}\n'
    )
    assert main(["bench", "replay", str(trace), "--url", url, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f'{trace}:2: output_length: expected an integer, got "two"; nothing was sent' in err
    assert seen == []


def test_a_missing_trace_file_and_bad_poisson_flags_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "replay", str(tmp_path / "none.jsonl")]) == 2
    assert "no trace file" in capsys.readouterr().err
    assert main(["bench", "replay", "poisson", "--prefix-share", "1.5"]) == 2
    assert "--prefix-share must be in [0, 1], got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "replay", "poisson", "--speedup", "0"])
    assert exit_.value.code == 2


def test_an_unreachable_server_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert main(["bench", "replay", "poisson", "--num-requests", "3", "--url", url, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach {url}" in err
    assert "Is the server up? Start one with `pdserve up examples/sim/quickstart.yaml`" in err
    assert "--url" in err
