"""One home per KV connector: nothing outside pdserve/kv/ branches on a connector's name, and the
registry finds every connector by each of its names.

The walk reads the code (not the text) of every module of the package: a connector name as a
string literal compared with something, tested with ``in``, used as a dict key or subscript,
matched in a ``match`` case, collected in a tuple/list/set or bound to a constant (to compare
with later) outside pdserve/kv/ is a branch on
the connector that belongs in its module. Docstrings, comments and messages may name connectors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdserve import kv
from pdserve.kv.base import Render, Simulate
from pdserve.routing import Connector

PACKAGE = Path(__file__).resolve().parents[2] / "pdserve"
NAMES = frozenset(n for c in kv.CONNECTORS for n in (c.names.crd, c.names.table))


def _is_name(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES


def _names_in(node: ast.AST | None) -> bool:
    """A connector name, or a collection of them."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_name(e) for e in node.elts)
    return _is_name(node)


def branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of every use of a connector name as a branch or a lookup key in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names_in(n) for n in (node.left, *node.comparators)):
            found.append((node.lineno, "compared"))
        elif isinstance(node, ast.Dict) and any(_is_name(k) for k in node.keys):
            found.append((node.lineno, "dict key"))
        elif isinstance(node, ast.Subscript) and _is_name(node.slice):
            found.append((node.lineno, "subscript"))
        elif isinstance(node, ast.match_case) and any(
            isinstance(p, ast.MatchValue) and _is_name(p.value) for p in ast.walk(node.pattern)
        ):
            found.append((node.pattern.lineno, "match case"))
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_is_name(e) for e in node.elts):
            found.append((node.lineno, "collection"))
        elif isinstance(node, ast.Assign | ast.AnnAssign) and _is_name(node.value):
            found.append((node.lineno, "constant"))  # NIXL = "NixlConnector", to compare with later
    return found


def outside_kv() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if (PACKAGE / "kv") not in p.parents]


def test_no_module_outside_kv_branches_on_a_connector_name() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: connector name {what}"
        for path in outside_kv()
        for line, what in branches(path.read_text(encoding="utf-8"))
    ]
    assert not found, "look the connector up in pdserve.kv instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        'if spec.connector == "MoRIIOConnector": pass',
        'ok = kind != "nixl"',
        'ok = name in ("NixlConnector", "MoRIIOConnector")',
        'CONNECTORS = ["nixl", "moriio"]',
        'MORIIO = "MoRIIOConnector"',
        'FACTORIES = {"nixl": 1}',
        'factory = FACTORIES["moriio"]',
        'match kind:\n    case "nixl":\n        pass',
    ],
)
def test_the_walk_finds_each_kind_of_branch(snippet: str) -> None:
    assert branches(snippet), snippet


def test_the_walk_lets_names_in_messages_and_paths_be() -> None:
    assert not branches(
        '"""NixlConnector pulls."""\nEXAMPLE = "examples" + "/" + "nixl"\nlog.info("nixl ok")'
    )


def test_the_walk_covers_the_whole_package() -> None:
    paths = {p.relative_to(PACKAGE).as_posix() for p in outside_kv()}
    assert {"routing/table.py", "deployment/render/engine_pod.py", "sim/server.py", "local/plan.py"} <= paths
    assert not any(p.startswith("kv/") for p in paths)


def test_every_connector_is_found_by_each_of_its_names() -> None:
    for connector in kv.CONNECTORS:
        assert kv.by_crd(connector.names.crd) is connector
        assert kv.by_table(connector.names.table) is connector
        route = connector.route(connector.names.modes[0] if connector.names.modes else None)
        assert route.name == connector.names.table
        assert isinstance(connector.render, Render) and isinstance(connector.simulate, Simulate)
    assert len(set(kv.crd_names())) == len(kv.CONNECTORS) == len(set(kv.table_types()))
    assert kv.DEFAULT is kv.CONNECTORS[0]


def test_unknown_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(
        kv.UnknownConnector, match="unknown connector 'LMCacheConnector'; known: NixlConnector"
    ):
        kv.by_crd("LMCacheConnector")
    with pytest.raises(ValueError, match="unknown connector type 'lmcache'; known: nixl, moriio"):
        kv.by_table(Connector("lmcache").type)


def test_owned_environment_is_every_connectors() -> None:
    assert kv.engine_env()[:3] == (
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_HOST_IP",
    )
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in kv.owned_env()
