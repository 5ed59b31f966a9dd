"""The Prometheus text exposition format: a metric family as data, and what is written of it.

The router and the operator count with prometheus_client, which writes their text; the simulator
writes vLLM's text itself (its figures live in its engines). All three declare their families as
tables of :class:`Family` (name, type, help, labels: what dashboards and docs name, written once),
and every ``# HELP``/``# TYPE`` pdserve writes by hand comes from :meth:`Family.header`.

prometheus_client is imported by :func:`register` only, not by this module: the router's worker
set-up must set PROMETHEUS_MULTIPROC_DIR before prometheus_client loads
(pdserve.proxy.serving.workers), and the simulator never needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

Kind = Literal["counter", "gauge", "histogram"]
#: How the gauge values of the router's worker processes combine into one (prometheus_client's
#: ``multiprocess_mode``; the ``live`` ones forget the processes that ended).
Combine = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent", "livemostrecent"
]


@dataclass(frozen=True)
class Family:
    """One metric family. ``name`` is the family's: a counter's samples (and, as prometheus_client
    writes them, its HELP and TYPE) add ``_total``."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    #: A histogram's upper bounds (``+Inf`` comes on top); empty: prometheus_client's default.
    buckets: tuple[float, ...] = ()
    #: A gauge's, with the router's worker processes (a single process ignores it).
    combine: Combine = "all"

    def header(self) -> tuple[str, str]:
        """The HELP and TYPE lines that introduce the family's samples."""
        name = f"{self.name}_total" if self.kind == "counter" else self.name
        text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return f"# HELP {name} {text}", f"# TYPE {name} {self.kind}"


def register(families: Mapping[str, Family], registry: CollectorRegistry) -> dict[str, Any]:
    """The families' prometheus_client metrics in ``registry``, under the table's keys."""
    from prometheus_client import Counter, Gauge, Histogram

    metrics: dict[str, Any] = {}
    for key, f in families.items():
        if f.kind == "counter":
            metrics[key] = Counter(f.name, f.help, f.labels, registry=registry)
        elif f.kind == "gauge":
            metrics[key] = Gauge(f.name, f.help, f.labels, registry=registry, multiprocess_mode=f.combine)
        else:
            buckets = f.buckets or Histogram.DEFAULT_BUCKETS
            metrics[key] = Histogram(f.name, f.help, f.labels, registry=registry, buckets=buckets)
    return metrics
