"""Dependencies point one way: contract and wire formats depend on nothing of ours; the proxy,
simulator and local mode never load each other's internals, and the proxy never loads kopf or
the Kubernetes client (it must start fast and stay small), nor OpenTelemetry unless it traces.

Two kinds of check: what importing a module loads in a fresh interpreter (RULES: what a process
really pays at start-up), and the import statements of every module read from its source (the
floors and cycles below: every ``import``, including those inside functions and under
``TYPE_CHECKING``, since those are dependencies a reader has to follow too).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

#: The router's rule: it starts fast and stays small, so neither the Kubernetes client nor the
#: components it is not.
KUBERNETES_CLIENT = ("kopf", "kubernetes")
NOT_THE_ROUTER = ("pdserve.sim", "pdserve.deployment", "pdserve.operator")

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
    "pdserve.proxy.cli": (*KUBERNETES_CLIENT, "opentelemetry", *NOT_THE_ROUTER, "pdserve.local"),
    "pdserve.proxy.app": (*KUBERNETES_CLIENT, "opentelemetry", *NOT_THE_ROUTER),
    # the SDK is loaded by start_tracing, not by importing the module
    "pdserve.tracing.sdk": ("opentelemetry", "pdserve.proxy", "pdserve.sim", "pdserve.deployment"),
    # the ConfigMap watch speaks to the API server with aiohttp alone
    "pdserve.proxy.table.configmap": (*KUBERNETES_CLIENT, *NOT_THE_ROUTER),
    "pdserve.proxy.table.kubeconfig": (*KUBERNETES_CLIENT, "yaml", *NOT_THE_ROUTER),
    "pdserve.sim.cli": (
        "kopf",
        "kubernetes",
        "opentelemetry",
        "pdserve.proxy",
        "pdserve.routing",
        "pdserve.deployment",
    ),
    "pdserve.sim.server": ("kopf", "kubernetes", "opentelemetry", "pdserve.proxy", "pdserve.deployment"),
    "pdserve.sim.process": ("kopf", "kubernetes", "pdserve.proxy", "pdserve.routing", "pdserve.deployment"),
    "pdserve.deployment.render.static_objects": (
        "kopf",
        "kubernetes",
        "pdserve.proxy",
        "pdserve.sim",
        "pdserve.operator",
    ),
    "pdserve.deployment.render.engine_pod": (
        "kopf",
        "kubernetes",
        "pdserve.proxy",
        "pdserve.sim",
        "pdserve.operator",
    ),
    # a client of any server: wire formats and the routing table's parser, nothing of the components
    "pdserve.loadgen.replay": (
        "kopf",
        "kubernetes",
        "pdserve.proxy",
        "pdserve.operator",
        "pdserve.local",
        "pdserve.deployment",
        "pdserve.sim",
    ),
    # the operator loads OpenTelemetry only with --otlp-traces-endpoint (pdserve.operator.reconcile.tracing)
    "pdserve.operator.reconcile.reconciler": ("opentelemetry",),
    "pdserve.operator.control.handlers": ("opentelemetry",),
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


# --- the floors, read from the source -----------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[2] / "pdserve"

#: Lowest first. A package imports its own modules, packages of lower floors, and its peers only
#: on the ground floor (the contract, the wire formats and the connectors know no service; nor
#: do ``listen``, the commands' check of the ports they are given, and ``argtypes``, their flags'
#: value types).
FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"routing", "wire", "kv", "listen", "argtypes", "tracing"}),
    frozenset({"deployment"}),
    frozenset({"proxy", "sim"}),
    frozenset({"operator", "local", "loadgen"}),  # loadgen: a client (pdserve bench), above what it loads
    frozenset({"cli"}),  # ``pdserve`` itself: loads a component by name, never by import
)

#: Inside a package the same rule, by its subpackages and top modules: a part imports only parts
#: of lower floors. The router: the engine client, shared state and metrics at its
#: ground; the table and the policies; the settings; the request flow; serving; admin; on top the
#: composition root (app) and the command (cli). The deployment: the spec; the rollout planning;
#: rendering; the checks that need rendered pods; the tools. (The KV connectors are pdserve.kv.)
#: The operator: its metrics; the API server as it reaches and sees it; what a pass asks the
#: routers and engines; the reconcile pass; the control loop that runs the passes; the command.
INNER_FLOORS: dict[str, tuple[frozenset[str], ...]] = {
    "deployment": (
        frozenset({"spec"}),
        frozenset({"plan"}),
        frozenset({"render"}),
        frozenset({"validate"}),
        frozenset({"cli", "docgen"}),
    ),
    "operator": (
        frozenset({"metrics"}),
        frozenset({"cluster"}),
        frozenset({"dataplane"}),
        frozenset({"reconcile"}),
        frozenset({"control"}),
        frozenset({"cli"}),
    ),
    "proxy": (
        frozenset({"engine", "state", "metrics"}),
        frozenset({"policies", "table"}),
        frozenset({"settings"}),
        frozenset({"flow"}),
        frozenset({"serving"}),
        frozenset({"admin"}),
        frozenset({"app"}),
        frozenset({"cli"}),
    ),
}

#: The router and the simulator start fast and stay small: neither imports kopf nor the
#: Kubernetes client, nor does anything they are built on.
NO_KUBERNETES_CLIENT = ("routing", "wire", "kv", "tracing", "proxy", "sim")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_names(name: str) -> Iterator[str]:
    """Every name ``name``'s source imports (absolute), and for ``from X import Y``, ``X.Y`` too."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def own_module(imported: str) -> str | None:
    """The module of ours an imported name resolves to (the longest known prefix), or None."""
    known = modules()
    while imported and imported not in known:
        imported = imported.rpartition(".")[0]
    return imported or None


@cache
def graph() -> dict[str, frozenset[str]]:
    """module -> the modules of ours it imports."""
    out: dict[str, frozenset[str]] = {}
    for name in modules():
        targets = {own_module(i) for i in imported_names(name) if i.split(".")[0] == "pdserve"}
        out[name] = frozenset(t for t in targets if t is not None and t != name and t != "pdserve")
    return out


def component(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def floor(pkg: str) -> int:
    return next(i for i, packages in enumerate(FLOORS) if pkg in packages)


def test_every_package_has_a_floor() -> None:
    missing = {component(m) for m in modules()} - {""} - set().union(*FLOORS)
    assert not missing, f"pdserve packages without a floor in FLOORS: {sorted(missing)}"


def test_no_import_points_upward_or_sideways_across_the_floors() -> None:
    wrong = []
    for source, targets in graph().items():
        here = component(source)
        if not here:
            continue
        for target in targets:
            there = component(target)
            if there == here:
                continue
            if floor(there) > floor(here) or (floor(there) == floor(here) and floor(here) != 0):
                wrong.append(f"{source} imports {target}")
    assert not wrong, (
        "imports against the floors (" + " < ".join(map(str, FLOORS)) + "):\n" + "\n".join(wrong)
    )


def part(name: str) -> str:
    """A module's part of its package: the subpackage or top module it belongs to."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 else ""


@pytest.mark.parametrize("package", sorted(INNER_FLOORS))
def test_inside_a_package_no_import_points_upward(package: str) -> None:
    floors = INNER_FLOORS[package]
    level = {name: i for i, names in enumerate(floors) for name in names}
    members = [m for m in modules() if component(m) == package and part(m)]
    missing = sorted({part(m) for m in members} - set(level))
    assert not missing, f"parts of pdserve.{package} without a floor in INNER_FLOORS: {missing}"
    wrong = [
        f"{source} imports {target}"
        for source in members
        for target in graph()[source]
        if component(target) == package
        and part(target)
        and part(target) != part(source)
        and level[part(target)] >= level[part(source)]
    ]
    shown = " < ".join("/".join(sorted(names)) for names in floors)
    assert not wrong, f"pdserve.{package} imports against its floors ({shown}):\n" + "\n".join(wrong)


def find_cycle(edges: dict[str, frozenset[str]]) -> list[str] | None:
    """One cycle of ``edges`` (its nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_find_cycle_finds_one_and_only_one() -> None:
    assert find_cycle({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset()}) is None
    assert find_cycle({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"})}) == [
        "a",
        "b",
        "c",
        "a",
    ]


def test_no_module_imports_itself_back() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", NO_KUBERNETES_CLIENT)
def test_router_and_simulator_never_import_kopf_or_the_kubernetes_client(package: str) -> None:
    offending = sorted(
        f"{name} imports {imported}"
        for name in modules()
        if component(name) == package
        for imported in imported_names(name)
        if imported.split(".")[0] in ("kopf", "kubernetes")
    )
    assert not offending, offending
