"""Dependencies point one way: contract and wire formats depend on nothing of ours; the proxy,
simulator and local mode never load each other's internals, and the proxy never loads kopf or
the Kubernetes client (it must start fast and stay small)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# module imported -> prefixes it must not pull in
RULES = {
    "pdserve.routing": (
        "pdserve.wire",
        "pdserve.proxy",
        "pdserve.sim",
        "pdserve.deployment",
        "pdserve.operator",
    ),
    # the connectors are ground floor: the routing table, the renderer, the proxy and the simulator
    # look them up, never the other way round
    "pdserve.kv": (
        "pdserve.routing",
        "pdserve.wire",
        "pdserve.proxy",
        "pdserve.sim",
        "pdserve.deployment",
        "pdserve.operator",
        "pdserve.local",
    ),
    "pdserve.wire.openai": ("pdserve.routing", "pdserve.proxy", "pdserve.sim", "pdserve.deployment"),
    "pdserve.proxy.cli": (
        "kopf",
        "kubernetes",
        "pdserve.sim",
        "pdserve.deployment",
        "pdserve.operator",
        "pdserve.local",
    ),
    "pdserve.proxy.app": ("kopf", "kubernetes", "pdserve.sim", "pdserve.deployment", "pdserve.operator"),
    # the ConfigMap watch speaks to the API server with aiohttp alone
    "pdserve.proxy.kubewatch": (
        "kopf",
        "kubernetes",
        "pdserve.sim",
        "pdserve.deployment",
        "pdserve.operator",
    ),
    "pdserve.proxy.kubeconfig": (
        "kopf",
        "kubernetes",
        "yaml",
        "pdserve.sim",
        "pdserve.deployment",
        "pdserve.operator",
    ),
    "pdserve.sim.cli": ("kopf", "kubernetes", "pdserve.proxy", "pdserve.routing", "pdserve.deployment"),
    "pdserve.sim.server": ("kopf", "kubernetes", "pdserve.proxy", "pdserve.deployment"),
    "pdserve.sim.process": ("kopf", "kubernetes", "pdserve.proxy", "pdserve.routing", "pdserve.deployment"),
    "pdserve.deployment.objects": ("kopf", "kubernetes", "pdserve.proxy", "pdserve.sim", "pdserve.operator"),
    "pdserve.local.runner": ("kopf", "kubernetes", "pdserve.operator", "pdserve.proxy.", "pdserve.sim."),
}


def loaded_modules(module: str) -> list[str]:
    """Import ``module`` in a fresh interpreter and list every module that is then loaded."""
    code = f"import json, sys, importlib; importlib.import_module({module!r}); "
    code += "print(json.dumps(list(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return list(json.loads(out))


@pytest.mark.parametrize("module", sorted(RULES))
def test_module_does_not_load_what_it_must_not_depend_on(module: str) -> None:
    forbidden = RULES[module]
    offending = sorted(m for m in loaded_modules(module) if m.startswith(forbidden) and m != module)
    assert not offending, f"importing {module} loads {offending}"
