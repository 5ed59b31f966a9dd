"""Shape math of multi-node instances (multinode.py): every accepted shape is one vLLM can run,
the ranks tile the instance exactly once, and every refusal names the field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.deployment.render.groupflags import GroupMember, group_flags
from pdserve.deployment.spec.multinode import (
    API_LEADER,
    API_PER_NODE,
    GroupShape,
    MultiNodeSpec,
    group_shape,
    uniform_gpus_per_node,
)
from pdserve.deployment.spec.parse import SpecError


@dataclass(frozen=True)
class Role:
    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1


PER_NODE = MultiNodeSpec()
LEADER = MultiNodeSpec(api_servers=API_LEADER)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize(
    ("role", "gpn", "expected"),
    [
        (Role(8), None, GroupShape(1, 8, 8, 8, API_LEADER, False)),  # unknown node size: one pod
        (Role(8), 8, GroupShape(1, 8, 8, 8, API_LEADER, False)),
        (Role(1, 8), 8, GroupShape(1, 8, 1, 1, API_LEADER, False)),
        (Role(16), 8, GroupShape(2, 8, 16, 8, API_PER_NODE, False)),  # DeepSeek prefill DP16 EP
        (Role(32), 8, GroupShape(4, 8, 32, 8, API_PER_NODE, False)),  # decode DP32
        (Role(8, 2), 8, GroupShape(2, 8, 8, 4, API_PER_NODE, False)),
        (Role(6, 3), 8, GroupShape(3, 6, 6, 2, API_PER_NODE, False)),  # 2 GPUs of each node idle
        (Role(1, 8, 2), 8, GroupShape(2, 8, 1, 1, API_LEADER, True)),  # TP8 x PP2 over 2 nodes
        (Role(1, 4, 4), 8, GroupShape(2, 8, 1, 1, API_LEADER, True)),
        (Role(1, 16, 2), 8, GroupShape(4, 8, 1, 1, API_LEADER, True)),
    ],
)
def test_shapes(role: Role, gpn: int | None, expected: GroupShape) -> None:
    assert group_shape(role, gpn, PER_NODE) == expected


def test_leader_mode_is_kept_for_dp_groups_and_forced_for_spanning_ranks() -> None:
    assert group_shape(Role(16), 8, LEADER).api_servers == API_LEADER
    assert group_shape(Role(1, 8, 2), 8, PER_NODE).api_servers == API_LEADER


@pytest.mark.parametrize(
    ("role", "gpn", "path", "reason"),
    [
        (
            Role(12),
            8,
            "spec.decode.dataParallel",
            "dataParallel must be a multiple of 8 (for example 8 or 16)",
        ),
        (Role(3, 2), 4, "spec.decode.dataParallel", "a pod holds 2 ranks"),
        (Role(2, 16, 1), 8, "spec.decode.dataParallel", "must be 1 when a rank is larger than a node"),
        (Role(1, 16), 8, "spec.decode.tensorParallel", "needs pipelineParallel > 1"),
        (Role(1, 4, 3), 8, "spec.decode.tensorParallel", "must be a multiple of gpusPerNode 8"),
    ],
)
def test_refusals_name_the_field(role: Role, gpn: int, path: str, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        group_shape(role, gpn, PER_NODE, "spec.decode")
    assert info.value.path == path
    assert reason in info.value.reason


def test_uniform_gpus_per_node() -> None:
    assert uniform_gpus_per_node([8, 8, 0]) == 8
    assert uniform_gpus_per_node([8, 4]) is None
    assert uniform_gpus_per_node([0, 0]) is None
    assert uniform_gpus_per_node([]) is None


SIZES = st.integers(min_value=1, max_value=64)


@given(dp=SIZES, tp=st.integers(1, 16), pp=st.integers(1, 8), gpn=st.integers(1, 16), leader=st.booleans())
def test_every_accepted_shape_tiles_the_instance(dp: int, tp: int, pp: int, gpn: int, leader: bool) -> None:
    """Accepted: pods x GPUs per pod = the instance's GPUs, each pod fits a node, and the pods'
    ranks (or, for a spanning rank, its nodes) cover [0, dp) exactly once; else a SpecError."""
    role = Role(dp, tp, pp)
    try:
        shape = group_shape(role, gpn, LEADER if leader else PER_NODE, "spec.prefill")
    except SpecError as exc:
        assert exc.path in ("spec.prefill.dataParallel", "spec.prefill.tensorParallel")
        assert dp * tp * pp > gpn  # only instances larger than a node are refused
        return
    assert shape.nodes * shape.gpus_per_pod >= dp * tp * pp or shape.nodes == 1
    if shape.nodes == 1:
        assert shape.gpus_per_pod == dp * tp * pp and shape.dp_local == dp
        return
    assert shape.gpus_per_pod <= gpn
    assert shape.nodes * shape.gpus_per_pod == dp * tp * pp
    if shape.spans_rank:
        assert dp == 1 and shape.dp_local == 1 and tp * pp > gpn
        assert (tp * pp) % shape.nodes == 0  # vLLM: --nnodes divides the world size
        assert [shape.serves_api(n) for n in range(shape.nodes)] == [True] + [False] * (shape.nodes - 1)
        return
    ranks = [
        r
        for n in range(shape.nodes)
        for r in range(shape.first_rank(n), shape.first_rank(n) + shape.dp_local)
    ]
    assert ranks == list(range(dp))
    assert shape.dp_local <= dp  # vLLM: data_parallel_size_local <= data_parallel_size
    served = [r for n in range(shape.nodes) for r in shape.api_ranks(n)]
    assert sorted(served) == list(range(dp))  # every rank reachable through exactly one API server


@given(dp=SIZES, tp=st.integers(1, 8), gpn=st.integers(1, 16), leader=st.booleans())
def test_flags_follow_vllms_launch_rules(dp: int, tp: int, gpn: int, leader: bool) -> None:
    """vLLM 0.32's arg_utils.py: hybrid LB never with --headless; a non-headless node given a start
    rank becomes hybrid LB, so the leader of a leader-mode group has none; start ranks tile the ranks."""
    try:
        shape = group_shape(Role(dp, tp), gpn, LEADER if leader else PER_NODE)
    except SpecError:
        return
    starts = []
    for node in range(shape.nodes):
        args = group_flags(GroupMember(shape, node, 13345, "10.0.0.1"))
        if not shape.multi_node:
            assert args == []
            continue
        headless = "--headless" in args
        assert headless == (not shape.serves_api(node))
        assert not (headless and "--data-parallel-hybrid-lb" in args)
        if "--data-parallel-start-rank" in args and not headless:
            assert "--data-parallel-hybrid-lb" in args
        if not shape.spans_rank:
            assert flag(args, "--data-parallel-size-local") == str(shape.dp_local)
            assert flag(args, "--data-parallel-rpc-port") == "13345"
            starts.append(int(flag(args, "--data-parallel-start-rank") or 0))
    if starts:
        assert starts == [n * shape.dp_local for n in range(shape.nodes)]


def test_spanning_rank_flags() -> None:
    shape = group_shape(Role(1, 8, 2), 8, PER_NODE)
    assert group_flags(GroupMember(shape, 0, 13345, "$(POD_IP)")) == [
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "$(POD_IP)",
        "--master-port",
        "13345",
    ]
    assert group_flags(GroupMember(shape, 1, 13345, "10.0.0.1"))[-1] == "--headless"


def test_nodes_outside_the_group_are_an_error() -> None:
    shape = group_shape(Role(16), 8, PER_NODE)
    with pytest.raises(ValueError):
        shape.first_rank(2)
