"""The planning half of `make e2e-vllm`'s argument check, run in `make test` without vLLM (issue 23,
item 3): every example, multi-node ones included, renders its pod commands and plans its local
runs; vLLM's own parser judges them only in the opt-in target (tests/e2e_vllm/argcheck.py)."""

from __future__ import annotations

from collections import Counter

from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.routing import Role
from pdserve.sim import vllm_cli
from tests.e2e_vllm.argcheck import EXAMPLES, REPO, rendered_commands


def test_every_example_renders_a_command_per_pod_and_per_local_process() -> None:
    commands = rendered_commands()
    names = Counter(c["name"].split(" (")[0] for c in commands)
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        pdd = load_manifest_file(path)
        where = str(path.relative_to(REPO))
        pods = sum(pdd.spec.group_shape(role).nodes for role in (Role.PREFILL, Role.DECODE))
        local = 0
        multi = any(pdd.spec.group_shape(r).multi_node for r in (Role.PREFILL, Role.DECODE))
        if not pdd.spec.kv_transfer.kv.render.local.refused and not multi:
            local = 4  # each role's first process, on GPUs and on CPU
        assert names[f"{where} prefill"] + names[f"{where} decode"] == pods + local, where
    traced = [c for c in commands if c["name"].startswith("spec.tracing ")]
    assert len(traced) == 4 and all("--otlp-traces-endpoint" in c["argv"] for c in traced)
    for command in commands:
        assert command["argv"][:2] == ["vllm", "serve"], command["name"]
        assert not any("$(" in arg for arg in command["argv"]), command["name"]


def test_single_node_pod_commands_pass_the_strict_stand_in_parser() -> None:
    """The pod runner's `vllm` stand-in refuses any flag it does not know; multi-node pods carry
    vLLM's group flags, which only real vLLM's parser judges."""
    for command in rendered_commands():
        if "(pod)" in command["name"]:
            vllm_cli.parse(command["argv"][2:])
