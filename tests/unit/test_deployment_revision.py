"""The pairing revision: equal for a prefill and a decode that can exchange KV, different as soon
as one thing they must agree on differs; old pods keep theirs in the routing table."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.deployment.plan.revision import KV_FLAGS, kv_args, pairing_revision
from pdserve.deployment.render.routing_table import ObservedInstance, build_routing_table
from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.routing import Role, build_slot_table
from tests.unit.test_deployment_routing import pdd_of as routing_pdd_of

P, D = Role.PREFILL, Role.DECODE


def pdd_of(**spec: Any) -> PDDeployment:
    return routing_pdd_of(**{"engine": "vllm", "image": "vllm/vllm-openai:v0.32.0", **spec})


def test_prefill_and_decode_of_one_spec_share_a_revision() -> None:
    pdd = pdd_of()
    assert pairing_revision(pdd, P) == pairing_revision(pdd, D)
    assert len(pairing_revision(pdd, P)) == 12 and int(pairing_revision(pdd, P), 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"model": "meta/llama-2"},
        {"servedModelName": "chat"},
        {"image": "vllm/vllm-openai:v0.33.0"},
        {"engine": "sim"},
        {"kvTransfer": {"connector": "MoRIIOConnector", "transferMode": "READ"}},
        {"kvTransfer": {"connector": "NixlConnector", "extraConfig": {"backends": ["UCX"]}}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_shared_setting_changes_both_revisions(change: dict[str, Any]) -> None:
    before, after = pdd_of(), pdd_of(**change)
    for role in (P, D):
        assert pairing_revision(after, role) != pairing_revision(before, role)
    assert pairing_revision(after, P) == pairing_revision(after, D)


@pytest.mark.parametrize(
    "args",
    [
        ["--kv-cache-dtype", "fp8"],
        ["--dtype", "bfloat16"],
        ["--tokenizer", "other/tok"],
        ["--chat-template", "/t.jinja"],
        ["--trust-remote-code"],
    ],
)
def test_a_kv_flag_on_one_side_only_splits_the_revisions(args: list[str]) -> None:
    """A prefill and a decode that disagree on the KV layout are never paired (and say so)."""
    pdd = pdd_of(decode={"instances": 2, "tensorParallel": 4, "args": args})
    assert pairing_revision(pdd, P) != pairing_revision(pdd, D)
    both = pdd_of(
        prefill={"instances": 1, "dataParallel": 8, "args": args},
        decode={"instances": 2, "tensorParallel": 4, "args": args},
    )
    assert pairing_revision(both, P) == pairing_revision(both, D)


def test_block_sizes_are_hashed_as_a_pair_in_both_revisions() -> None:
    """NIXL pairs a prefill block size that divides the decode's (admission.py): P16/D32 pair, and
    changing either side's size re-revisions both, so a rollout never mixes old and new sizes."""
    mixed = pdd_of(
        prefill={"args": ["--block-size", "16"]}, decode={"instances": 2, "args": ["--block-size=32"]}
    )
    assert pairing_revision(mixed, P) == pairing_revision(mixed, D)
    one_side = pdd_of(decode={"instances": 2, "args": ["--block-size=32"]})  # prefill: vLLM's default
    assert pairing_revision(one_side, P) == pairing_revision(one_side, D)
    base = pdd_of()
    for changed in (mixed, one_side):
        for role in (P, D):
            assert pairing_revision(changed, role) != pairing_revision(base, role)
    assert pairing_revision(mixed, P) != pairing_revision(one_side, P)


def test_what_may_differ_between_the_roles_does_not_change_the_revision() -> None:
    base = pdd_of()
    other = pdd_of(
        prefill={"instances": 3, "dataParallel": 4, "tensorParallel": 2, "args": ["--max-num-seqs", "8"]},
        decode={"instances": 1, "dataParallel": 2, "args": ["--enforce-eager", "--max-model-len=4096"]},
        rollout={"drainSeconds": 5},
        router={"replicas": 2},
    )
    for role in (P, D):
        assert pairing_revision(other, role) == pairing_revision(base, role)


def test_kv_env_counts_and_other_env_does_not() -> None:
    layout = pdd_of(decode={"instances": 2, "env": [{"name": "VLLM_KV_CACHE_LAYOUT", "value": "HND"}]})
    assert pairing_revision(layout, D) != pairing_revision(layout, P)
    noise = pdd_of(decode={"instances": 2, "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]})
    assert pairing_revision(noise, D) == pairing_revision(noise, P)


def test_kv_args_reads_both_flag_forms_order_independently() -> None:
    assert kv_args(
        ["--dtype", "half", "--max-num-seqs", "4", "--kv-cache-dtype=fp8", "--trust-remote-code"]
    ) == [
        ("--dtype", "half"),
        ("--kv-cache-dtype", "fp8"),
        ("--trust-remote-code", None),
    ]
    assert kv_args(["--kv-cache-dtype=fp8", "--dtype", "half"]) == kv_args(
        ["--dtype=half", "--kv-cache-dtype", "fp8"]
    )
    assert "--max-num-seqs" not in KV_FLAGS


def test_the_table_carries_each_pods_revision_and_old_pods_keep_theirs() -> None:
    new = pdd_of(image="vllm/vllm-openai:v0.33.0")
    old_rev = pairing_revision(pdd_of(), D)
    observed = [
        ObservedInstance(P, 0, "r1-prefill-0", "10.0.0.1", True),  # recreated: the spec's revision
        ObservedInstance(D, 0, "r1-decode-0", "10.0.1.1", True, revision=old_rev),  # not yet rolled
        ObservedInstance(D, 1, "r1-decode-1", "10.0.1.2", True),
    ]
    table = build_routing_table(new, observed, None)
    assert [i.revision for i in table.prefill] == [pairing_revision(new, P)]
    assert [i.revision for i in table.decode] == [old_rev, pairing_revision(new, D)]
    slots = build_slot_table(table)
    # the old decode is unpaired (its prefill is gone): it takes no traffic, and is reported
    assert {s.instance.name for s in slots.decode} == {"r1-decode-1"}
    assert [(u.role, u.revision) for u in slots.unpaired] == [(D, old_rev)]
    again = build_routing_table(new, list(reversed(observed)), table)  # order of observation
    assert again.generation == table.generation  # same content, same generation
