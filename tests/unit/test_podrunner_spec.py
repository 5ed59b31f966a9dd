"""The pod runner's kubelet rules (hack/cluster/runner/spec.py): expansion, addresses, back-off, refusals."""

from __future__ import annotations

from fractions import Fraction

import pytest

from hack.cluster.runner import spec as rs


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)-$(B)", "1-two"),
        ("$$(A)", "$(A)"),  # escaped
        ("$(MISSING)", "$(MISSING)"),  # unknown stays
        ("$(A", "$(A"),  # incomplete
        ("$A $", "$A $"),
        ("a$$b", "a$b"),
    ],
)
def test_expand_like_the_kubelet(text: str, expected: str) -> None:
    assert rs.expand(text, {"A": "1", "B": "two"}.get) == expected


def test_env_values_see_only_earlier_variables() -> None:
    pod = {"metadata": {"name": "p", "namespace": "n"}, "spec": {"containers": []}}
    container = {
        "name": "c",
        "env": [
            {"name": "X", "value": "$(Y)"},
            {"name": "Y", "value": "y"},
            {"name": "Z", "value": "$(Y)$(X)"},
        ],
    }
    lookups = rs.Lookups(config_map=lambda _: None, secret=lambda _: None)
    env = rs.container_env(pod, container, lookups, "127.128.128.1", "127.0.0.1", {}, {})
    assert env == {"X": "$(Y)", "Y": "y", "Z": "y$(Y)"}


def test_missing_required_key_is_a_config_error_and_optional_is_skipped() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": []}}
    lookups = rs.Lookups(config_map=lambda _: {"a": "1"}, secret=lambda _: None)
    optional = {
        "name": "c",
        "env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": True}}}],
    }
    assert rs.container_env(pod, optional, lookups, "ip", "h", {}, {}) == {}
    required = {
        "name": "c",
        "env": [{"name": "C", "valueFrom": {"configMapKeyRef": {"name": "m", "key": "b"}}}],
    }
    with pytest.raises(rs.ConfigError, match="couldn't find key b in configmap m"):
        rs.container_env(pod, required, lookups, "ip", "h", {}, {})


def test_any_address_becomes_the_pod_ip() -> None:
    args = ["--host", "0.0.0.0", "--bind=0.0.0.0", "--other=10.0.0.0", "0.0.0.0:80"]
    assert rs.with_pod_address(args, "127.128.128.7") == [
        "--host",
        "127.128.128.7",
        "--bind=127.128.128.7",
        "--other=10.0.0.0",
        "0.0.0.0:80",
    ]


def test_quantities_and_resource_field_refs() -> None:
    assert rs.quantity("500m") == Fraction(1, 2)
    assert rs.quantity("1Gi") == 2**30
    assert rs.quantity("1e3") == 1000
    container = {"resources": {"requests": {"cpu": "250m", "memory": "64Mi"}}}
    assert rs.resource_value(container, "requests.cpu", None, {}) == "1"  # cpu rounds up to a core
    assert rs.resource_value(container, "requests.memory", "1Mi", {}) == "64"
    assert rs.resource_value(container, "limits.memory", "1Gi", {"memory": "256Gi"}) == "256"


def test_back_off_is_immediate_then_doubles_to_five_minutes() -> None:
    assert [rs.backoff_delay(n) for n in range(1, 9)] == [0, 10, 20, 40, 80, 160, 300, 300]


def test_unsupported_fields_are_named() -> None:
    pod = {
        "spec": {
            "hostNetwork": True,
            "volumes": [
                {"name": "ok", "emptyDir": {}},
                {"name": "claim", "persistentVolumeClaim": {"claimName": "c"}},
                {"name": "proj", "projected": {"sources": [{"clusterTrustBundle": {}}]}},
            ],
            "containers": [
                {"name": "a", "readinessProbe": {"grpc": {"port": 1}}, "command": ["x"]},
                {"name": "b"},
            ],
        }
    }
    found = rs.unsupported(pod)
    assert "spec.hostNetwork" in found
    assert "spec.volumes[1].persistentVolumeClaim (volume claim)" in found
    assert "spec.volumes[2].projected.sources[0].clusterTrustBundle" in found
    assert "spec.containers[0].readinessProbe.grpc" in found
    assert any(f.startswith("spec.containers[1].command") for f in found)
    assert not any("emptyDir" in f for f in found)
