"""The admission gate's decisions and queue (issue 13, item 4), without any network."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from pdserve.proxy.flow.admission import (
    SHED_QUEUE_FULL,
    SHED_QUEUE_TIMEOUT,
    AdmissionGate,
    has_room,
    room_first,
    shed_reply,
)
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.serving.cpus import cgroup_v1_quota, quota_cpus, v1_quota_cpus
from pdserve.proxy.state.health import SlotBook
from pdserve.routing import Instance, Role, interleaved_slots


def _slots() -> tuple:  # type: ignore[type-arg]
    return interleaved_slots(
        [Instance("a", "http://a", dp_size=2, ready=True), Instance("b", "http://b", ready=True)]
    )


def test_room_first_keeps_the_policy_order_and_puts_full_slots_last() -> None:
    slots = _slots()
    book = SlotBook(10)
    assert room_first(Role.DECODE, slots, book, 1) == list(slots)
    book.started(Role.DECODE, slots[0].key)
    assert room_first(Role.DECODE, slots, book, 1) == [slots[1], slots[2], slots[0]]
    assert room_first(Role.DECODE, slots, book, 0) == list(slots)  # 0: no limit
    assert not has_room(Role.DECODE, slots[0], book, 1) and has_room(Role.DECODE, slots[0], book, 2)


def test_shed_reply_is_429_with_retry_after_in_vllm_shape() -> None:
    reply = shed_reply(SHED_QUEUE_FULL, 10, 5.0)
    assert reply.status == 429 and reply.reason == "queue_full"
    assert dict(reply.headers)[b"retry-after"] == b"1"
    assert isinstance(reply.body, bytes)
    error = json.loads(reply.body)["error"]
    assert error["code"] == 429 and type(error["code"]) is int and error["type"] == "Too Many Requests"


def test_cgroup_quota_parsing() -> None:
    assert quota_cpus("200000 100000\n") == 2.0
    assert quota_cpus("150000 100000") == 1.5
    assert quota_cpus("max 100000") is None
    assert quota_cpus("garbage") is None
    assert v1_quota_cpus("200000\n", "100000\n") == 2.0
    assert v1_quota_cpus("-1", "100000") is None
    assert v1_quota_cpus("", "100000") is None


def test_cgroup_v1_quota_is_read_from_the_process_cgroup_or_the_mount(tmp_path: Path) -> None:
    """Nodes still on cgroup v1: a container's CPU limit is cpu.cfs_quota_us / cpu.cfs_period_us
    of its cgroup (under a namespaced mount, the mount's own files)."""

    def cgroup(directory: Path, quota: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (directory / "cpu.cfs_period_us").write_text("100000\n")

    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/kubepods/pod1\n4:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n")
    cgroup(tmp_path / "cpu,cpuacct" / "kubepods/pod1/c1", 150000)
    cgroup(tmp_path / "cpu,cpuacct", -1)
    assert cgroup_v1_quota(tmp_path, proc) == 1.5
    proc.write_text("4:cpu,cpuacct:/elsewhere\n")  # a namespaced mount: the mount is the cgroup
    assert cgroup_v1_quota(tmp_path, proc) is None
    cgroup(tmp_path / "cpu,cpuacct", 300000)
    assert cgroup_v1_quota(tmp_path, proc) == 3.0
    proc.write_text("0::/\n")  # cgroup v2 only: not v1's business
    assert cgroup_v1_quota(tmp_path, proc) is None


def test_queue_is_fifo_bounded_and_has_a_deadline() -> None:
    async def scenario() -> list[str | None]:
        room = {"free": 0}
        gate = AdmissionGate(1, 2, 0.5, ProxyMetrics())

        def ready() -> bool:
            return room["free"] > 0

        def take() -> None:
            room["free"] -= 1

        order: list[str | None] = []

        async def request(name: str) -> None:
            result = await gate.admit(ready)
            if result is None:
                take()
                order.append(name)
            else:
                order.append(result)

        tasks = [asyncio.create_task(request(n)) for n in ("first", "second", "third")]
        await asyncio.sleep(0.01)
        assert gate.depth == 2  # the third found the queue full
        room["free"] = 1
        gate.release()
        await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)  # "second" waits past its deadline
        return order

    assert asyncio.run(scenario()) == [SHED_QUEUE_FULL, "first", SHED_QUEUE_TIMEOUT]
