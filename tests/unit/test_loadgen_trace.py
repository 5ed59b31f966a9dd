"""Mooncake traces are read as they are written, a bad line is named with its field before anything
is sent, and the Poisson generator makes records of the same shape."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pdserve.loadgen.trace import (
    BLOCK_TOKENS,
    PoissonSpec,
    TraceError,
    TraceRequest,
    parse_trace,
    poisson_trace,
    read_trace,
    write_trace,
)

GOOD = '{"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]}'


def _line(**changes: object) -> str:
    doc = json.loads(GOOD)
    for key, value in changes.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc)


def test_reads_mooncake_records_and_skips_blank_lines() -> None:
    lines = [
        GOOD,
        "",
        '{"timestamp": 27.5, "input_length": 512, "output_length": 1, "hash_ids": [0], "x": 1}',
    ]
    assert parse_trace(lines) == [
        TraceRequest(0.0, 1100, 6, (0, 1, 2)),
        TraceRequest(27.5, 512, 1, (0,)),
    ]


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        ("{not json", "", "not valid JSON"),
        ("[1, 2]", "", "expected a JSON object"),
        (_line(timestamp=...), "timestamp", "missing"),
        (_line(timestamp="soon"), "timestamp", 'expected a number (ms), got "soon"'),
        (_line(timestamp=-1), "timestamp", "expected a number >= 0"),
        (_line(input_length=...), "input_length", "missing"),
        (_line(input_length=0), "input_length", "expected an integer >= 1, got 0"),
        (_line(output_length=2.5), "output_length", "expected an integer, got 2.5"),
        (_line(output_length=True), "output_length", "expected an integer, got true"),
        (_line(hash_ids="0,1"), "hash_ids", "expected a list of integers"),
        (_line(hash_ids=[0, 1, "2"]), "hash_ids[2]", 'expected an integer >= 0, got "2"'),
        (_line(hash_ids=[0, -1]), "hash_ids[1]", "expected an integer >= 0, got -1"),
        (
            _line(hash_ids=[0, 1, 2, 3]),
            "hash_ids",
            "4 blocks of 512 tokens cover more than input_length 1100",
        ),
    ],
)
def test_a_bad_line_is_named_by_number_and_field(line: str, field: str, reason: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace([GOOD, "", line, GOOD], "t.jsonl")
    error = caught.value
    assert (error.line, error.field) == (3, field)
    assert reason in error.reason
    assert str(error).startswith(f"t.jsonl:3: {field + ': ' if field else ''}")


def test_an_empty_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path)


def test_blocks_without_a_hash_id_get_ids_no_other_request_has() -> None:
    requests = parse_trace(
        [
            '{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [7]}',
            '{"timestamp": 1, "input_length": 600, "output_length": 1}',
        ]
    )
    assert requests[0].hash_ids == (7, 8, 9)
    assert requests[1].hash_ids == (10, 11)


def test_written_traces_read_back_the_same(tmp_path: Path) -> None:
    requests = poisson_trace(PoissonSpec(rate=5, num_requests=20, input_length=900, output_length=3))
    write_trace(requests, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == requests


def test_poisson_arrivals_lengths_and_shared_prefixes() -> None:
    spec = PoissonSpec(
        rate=20,
        num_requests=2000,
        input_length=2048,
        output_length=64,
        range_ratio=0.5,
        prefix_share=0.5,
        prefix_groups=4,
        seed=3,
    )
    requests = poisson_trace(spec)
    assert requests == poisson_trace(spec), "the same seed gives the same workload"
    assert len(requests) == 2000 and requests[0].timestamp_ms == 0
    gaps = [b.timestamp_ms - a.timestamp_ms for a, b in itertools.pairwise(requests)]
    assert min(gaps) >= 0
    assert 45 < sum(gaps) / len(gaps) < 55  # 1/20 s
    assert all(1024 <= r.input_length <= 3072 and 32 <= r.output_length <= 96 for r in requests)
    prefixes, own = set(), []
    for r in requests:
        blocks = -(-r.input_length // BLOCK_TOKENS)
        shared = min(round(0.5 * blocks), r.input_length // BLOCK_TOKENS)
        assert len(r.hash_ids) == blocks
        prefixes.add(r.hash_ids[:1])
        own += r.hash_ids[shared:]
    assert len(prefixes) == 4, "the shared part starts with one of 4 prefixes"
    assert len(own) == len(set(own)), "the rest of each prompt is its own"


def test_poisson_without_sharing_has_no_common_block() -> None:
    requests = poisson_trace(PoissonSpec(rate=1, num_requests=50, input_length=1024, output_length=1))
    ids = [h for r in requests for h in r.hash_ids]
    assert len(ids) == len(set(ids)) == 100


def test_poisson_problems_name_the_flag() -> None:
    assert PoissonSpec(
        rate=0, num_requests=0, input_length=1, output_length=1, prefix_share=2
    ).problems() == [
        "--rate must be > 0, got 0",
        "--num-requests must be >= 1, got 0",
        "--prefix-share must be in [0, 1], got 2",
    ]
