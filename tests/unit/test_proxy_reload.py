"""The routing-file watcher on a real filesystem: plain rewrites, ConfigMap ..data swaps, bad files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.table.file import RoutingWatcher
from pdserve.proxy.table.served import ServedTable


def watch(path: Path, metrics: ProxyMetrics | None = None) -> tuple[RoutingWatcher, ServedTable]:
    served = ServedTable(metrics or ProxyMetrics(), f"file {path}")
    return RoutingWatcher(path, served), served


def loaded(tmp_path: Path) -> tuple[Path, RoutingWatcher, ServedTable, ProxyMetrics]:
    """A routing file with generation 1, watched, and its first poll done (it loads)."""
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(table(1)))
    metrics = ProxyMetrics()
    watcher, served = watch(path, metrics)
    assert watcher.poll(confirm_errors=False)
    return path, watcher, served, metrics


def table(generation: int, decode_ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "RoutingTable",
        "deployment": "t",
        "generation": generation,
        "connector": {"type": "nixl"},
        "prefill": [{"name": "p0", "url": "http://127.0.0.1:1", "dpSize": 2, "ready": True}],
        "decode": [{"name": "d0", "url": "http://127.0.0.1:2", "dpSize": 1, "ready": decode_ready}],
    }


def value(metrics: ProxyMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_plain_rewrite_is_picked_up(tmp_path: Path) -> None:
    path, watcher, served, metrics = loaded(tmp_path)
    assert served.current is not None and served.current.generation == 1
    assert not watcher.poll()  # unchanged
    path.write_text(json.dumps(table(2, decode_ready=False)))
    assert watcher.poll()
    assert served.current.generation == 2 and served.current.slots.decode == ()
    assert value(metrics, "pdserve_proxy_routing_generation") == 2
    assert value(metrics, "pdserve_proxy_routing_reloads_total") == 2


def test_configmap_data_symlink_swap(tmp_path: Path) -> None:
    """The kubelet's layout: routing.json -> ..data/routing.json, ..data -> ..<timestamp>/."""
    mount = tmp_path / "mount"
    mount.mkdir()

    def publish(version: str, content: dict[str, Any]) -> None:
        target = mount / f"..{version}"
        target.mkdir()
        (target / "routing.json").write_text(json.dumps(content))
        tmp_link = mount / "..data_tmp"
        tmp_link.symlink_to(target.name)
        os.replace(tmp_link, mount / "..data")  # the atomic swap

    publish("2026_01_01_v1", table(1))
    (mount / "routing.json").symlink_to("..data/routing.json")
    watcher, served = watch(mount / "routing.json")
    assert watcher.poll(confirm_errors=False) and served.current is not None
    assert served.current.generation == 1
    publish("2026_01_01_v2", table(2))
    assert watcher.poll()
    assert served.current.generation == 2


def test_invalid_file_keeps_the_last_good_table_and_is_counted_once(tmp_path: Path) -> None:
    path, watcher, served, metrics = loaded(tmp_path)
    bad = table(2)
    bad["decode"][0]["dpSize"] = "one"
    path.write_text(json.dumps(bad))
    assert not watcher.poll()  # first sighting: maybe a writer half-way through
    assert value(metrics, "pdserve_proxy_routing_reload_errors_total") == 0
    assert not watcher.poll()  # still bad on the next poll: an error
    assert not watcher.poll()  # and counted once, not once per poll
    assert value(metrics, "pdserve_proxy_routing_reload_errors_total") == 1
    assert served.current is not None and served.current.generation == 1
    assert served.last_error is not None and "decode[0].dpSize" in served.last_error
    path.write_text(json.dumps(table(3)))
    assert watcher.poll() and served.current.generation == 3 and served.last_error is None


def test_missing_file_at_start_is_not_ready_until_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "routing.json"
    watcher, served = watch(path)
    assert not watcher.poll(confirm_errors=False)
    assert served.current is None and served.last_error is not None and "routing.json" in served.last_error
    reason = served.not_ready_reason()
    assert reason is not None and reason.startswith(f"no routing table loaded yet from file {path}")
    path.write_text(json.dumps(table(4)))
    assert watcher.poll() and served.current is not None and served.current.generation == 4
    assert served.not_ready_reason() is None


def test_same_content_same_generation_is_not_a_reload(tmp_path: Path) -> None:
    path, watcher, _, metrics = loaded(tmp_path)
    path.write_text(json.dumps(table(1), indent=4))  # new bytes, same table
    assert not watcher.poll()
    assert value(metrics, "pdserve_proxy_routing_reloads_total") == 1
