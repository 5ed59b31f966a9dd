"""What a router reports it serves (/routing/served) across table swaps, readiness reasons, and
how `pdserve proxy` picks its one table source."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.proxy import cli
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.state.health import SlotBook
from pdserve.proxy.table.kubeconfig import ConfigMapRef
from pdserve.proxy.table.served import ServedTable, served_view
from pdserve.routing import Instance, Role
from tests.support.tables import instance as inst
from tests.support.tables import table_json


def doc(generation: int, prefill: list[Instance], decode: list[Instance]) -> str:
    return table_json(generation, prefill, decode)


def test_served_view_before_any_table() -> None:
    served = ServedTable(ProxyMetrics(), "configmap ns/llama-routing")
    view = served_view(served, SlotBook(10))
    assert view == {
        "deployment": None,
        "generation": None,
        "source": "configmap ns/llama-routing",
        "loaded_at": None,
        "routable": {"prefill": 0, "decode": 0},
        "instances": {},
        "slots": [],
        "error": None,
    }
    assert served.not_ready_reason() == "no routing table loaded yet from configmap ns/llama-routing"


def test_in_flight_survives_the_swap_that_removes_its_instance() -> None:
    served = ServedTable(ProxyMetrics(), "file x", clock=lambda: 1764000000.5)
    book = SlotBook(10)
    assert served.offer(doc(1, [inst("p0")], [inst("d0", dp=2), inst("d1")]), "t")
    book.started(Role.DECODE, "d0/1")  # a stream on generation 1
    book.pin(Role.PREFILL, "p0/0")  # its prefill's KV not yet pulled
    assert served.offer(doc(2, [inst("p0")], [inst("d1"), inst("d2", ready=False)]), "t")  # d0 left
    view = served_view(served, book)
    assert (view["generation"], view["deployment"], view["loaded_at"]) == (2, "llama", 1764000000.5)
    assert view["routable"] == {"prefill": 1, "decode": 1}
    assert view["instances"] == {
        "p0": {"role": "prefill", "in_table": True, "routable": True, "in_flight": 1},
        "d1": {"role": "decode", "in_table": True, "routable": True, "in_flight": 0},
        "d2": {"role": "decode", "in_table": True, "routable": False, "in_flight": 0},
        "d0": {"role": "decode", "in_table": False, "routable": False, "in_flight": 1},
    }
    assert view["slots"] == [
        {"role": "prefill", "instance": "p0", "dp_rank": 0, "in_flight": 1},
        {"role": "decode", "instance": "d1", "dp_rank": 0, "in_flight": 0},
        {"role": "decode", "instance": "d0", "dp_rank": 1, "in_flight": 1},
    ]
    book.unpin(Role.PREFILL, "p0/0")
    book.finished(Role.DECODE, "d0/1", ok=True)
    view = served_view(served, book)
    assert "d0" not in view["instances"] and view["instances"]["p0"]["in_flight"] == 0
    assert all(row["instance"] != "d0" for row in view["slots"])


def test_not_ready_reasons_name_the_missing_role_and_the_cause() -> None:
    served = ServedTable(ProxyMetrics(), "configmap ns/x")
    served.offer(doc(3, [inst("p0")], [inst("d0", draining=True)]), "t")
    assert served.not_ready_reason() == "generation 3 has no routable decode instance"
    served.set_problem("cannot list ConfigMap ns/x: forbidden: ...")
    assert served.not_ready_reason() == (
        "generation 3 has no routable decode instance; cannot list ConfigMap ns/x: forbidden: ..."
    )
    served.offer("{", "ConfigMap ns/x (resourceVersion 9)")
    reason = served.not_ready_reason() or ""
    assert reason.endswith(
        "ConfigMap ns/x (resourceVersion 9) rejected, keeping generation 3: not valid JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    )


# --- the one table source -------------------------------------------------------------------------


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(argv)


def token_kubeconfig_file(tmp_path: Path, namespace: str | None = "ctx-ns", **user: Any) -> Path:
    path = tmp_path / "kubeconfig"
    context: dict[str, Any] = {"cluster": "c", "user": "u"}
    if namespace:
        context["namespace"] = namespace
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": user or {"token": "t"}}],
                "contexts": [{"name": "c", "context": context}],
                "current-context": "c",
            }
        )
    )
    return path


def test_file_source_from_flag_or_env(tmp_path: Path) -> None:
    assert cli.table_source(parse_args("--routing-file", "r.json"), {}) == (Path("r.json"), None, None)
    assert cli.table_source(parse_args(), {"PDSERVE_ROUTING_FILE": "e.json"})[0] == Path("e.json")
    # a flag chooses even when the other source's env var is set (e.g. in a pod template)
    chosen = cli.table_source(parse_args("--routing-file", "r.json"), {"PDSERVE_ROUTING_CONFIGMAP": "x"})
    assert chosen[0] == Path("r.json")


def test_configmap_source_with_a_kubeconfig(tmp_path: Path) -> None:
    kubeconfig = token_kubeconfig_file(tmp_path)
    args = parse_args("--routing-configmap", "llama-routing", "--kubeconfig", str(kubeconfig))
    _, ref, creds = cli.table_source(args, {"POD_NAMESPACE": "pod-ns"})
    assert ref == ConfigMapRef("pod-ns", "llama-routing")
    assert creds is not None and creds.server == "https://127.0.0.1:1"
    _, ref, _ = cli.table_source(args, {})  # no POD_NAMESPACE, no service account: the context's
    assert ref == ConfigMapRef("ctx-ns", "llama-routing")
    _, ref, _ = cli.table_source(
        parse_args(), {"PDSERVE_ROUTING_CONFIGMAP": "a/b", "KUBECONFIG": str(kubeconfig)}
    )
    assert ref == ConfigMapRef("a", "b")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ((), {}, "a routing table source is required"),
        (("--routing-file", "a", "--routing-configmap", "b/c"), {}, "give one table source, not both"),
        (
            (),
            {"PDSERVE_ROUTING_FILE": "a", "PDSERVE_ROUTING_CONFIGMAP": "b/c"},
            "both PDSERVE_ROUTING_FILE and",
        ),
        (
            ("--routing-file", "a", "--kubeconfig", "k"),
            {},
            "--kubeconfig is only used with --routing-configmap",
        ),
        (("--routing-configmap", "ns/x"), {}, "not running in a Kubernetes pod"),
        (("--routing-configmap", "ns/x", "--kubeconfig", "/nonexistent/kc"), {}, "cannot read kubeconfig"),
    ],
)
def test_source_errors_are_clear(argv: tuple[str, ...], env: dict[str, str], message: str) -> None:
    with pytest.raises(cli.UsageError, match=message):
        cli.table_source(parse_args(*argv), env)


def test_unsupported_credentials_and_missing_namespace_stop_the_start(tmp_path: Path) -> None:
    plugin = token_kubeconfig_file(tmp_path, exec={"command": "aws"})
    with pytest.raises(cli.UsageError, match="exec credential plugin"):
        cli.table_source(parse_args("--routing-configmap", "ns/x", "--kubeconfig", str(plugin)), {})
    no_ns = token_kubeconfig_file(tmp_path, namespace=None)
    with pytest.raises(cli.UsageError, match="gives no namespace"):
        cli.table_source(parse_args("--routing-configmap", "x", "--kubeconfig", str(no_ns)), {})


def test_run_prints_the_error_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse_args("--routing-file", "a", "--routing-configmap", "b/c")) == 2
    assert "pdserve proxy: give one table source" in capsys.readouterr().err


def test_shutdown_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    def server(*argv: str) -> tuple[float, float]:
        settings = cli.settings_from_args(parse_args("--routing-file", "a", *argv)).server
        return settings.grace_seconds, settings.shutdown_delay_seconds

    assert server() == (120.0, 0.0)
    assert server("--grace-seconds", "7")[0] == 7
    monkeypatch.setenv("PDSERVE_PROXY_SHUTDOWN_GRACE_SECONDS", "45")
    monkeypatch.setenv("PDSERVE_PROXY_SHUTDOWN_DELAY_SECONDS", "3")
    assert server() == (45.0, 3.0)
    assert server("--shutdown-grace-seconds", "9")[0] == 9
