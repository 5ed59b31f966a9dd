"""The watch-fed cache: out-of-order events, LIST seeding and drift, deletion marks."""

from __future__ import annotations

from typing import Any

from pdserve.operator.cluster.cache import ClusterCache

KEY = ("ns", "r1")


def pod(name: str, version: int | str, uid: str = "u1", ready: bool = True, **meta: Any) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid,
            "resourceVersion": str(version),
            "labels": {"pdserve.io/deployment": "r1", "pdserve.io/role": "decode"},
            **meta,
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pdd(version: int, generation: int = 1, **meta: Any) -> dict[str, Any]:
    return {
        "kind": "PDDeployment",
        "metadata": {
            "name": "r1",
            "namespace": "ns",
            "resourceVersion": str(version),
            "generation": generation,
        }
        | meta,
    }


def router(version: int, available: int) -> dict[str, Any]:
    return {
        "kind": "Deployment",
        "metadata": {
            "name": "r1-router",
            "namespace": "ns",
            "resourceVersion": str(version),
            "labels": {"pdserve.io/deployment": "r1"},
        },
        "status": {"availableReplicas": available},
    }


def names_and_versions(cache: ClusterCache) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["resourceVersion"] for p in cache.pods(KEY) or []}


def seeded(*items: dict[str, Any], version: int = 1) -> ClusterCache:
    cache = ClusterCache()
    cache.replace_pods(KEY, list(items), version)
    return cache


def test_pods_are_unknown_until_a_list_seeds_them() -> None:
    cache = ClusterCache()
    assert cache.pod_event("ADDED", pod("r1-decode-0", 5)) == KEY
    assert cache.pods(KEY) is None  # events alone never prove the set complete
    cache.replace_pods(KEY, [pod("r1-decode-0", 5), pod("r1-decode-1", 6)], 7)
    assert names_and_versions(cache) == {"r1-decode-0": "5", "r1-decode-1": "6"}


def test_an_older_version_arriving_late_never_overwrites_a_newer_one() -> None:
    cache = seeded()
    cache.pod_event("MODIFIED", pod("r1-decode-0", 12, ready=True))
    cache.pod_event("MODIFIED", pod("r1-decode-0", 11, ready=False))  # out of order
    (body,) = cache.pods(KEY) or []
    assert body["metadata"]["resourceVersion"] == "12"
    assert body["status"]["conditions"][0]["status"] == "True"
    # Equal versions are the same object (a write's response, then its watch event).
    cache.pod_event("MODIFIED", pod("r1-decode-0", 12, ready=False))
    assert (cache.pods(KEY) or [])[0]["status"]["conditions"][0]["status"] == "True"


def test_a_deleted_pod_is_not_resurrected_by_a_late_event_but_a_new_one_of_that_name_is_kept() -> None:
    cache = seeded(pod("r1-decode-0", 5))
    cache.pod_event("DELETED", pod("r1-decode-0", 20))
    cache.pod_event("MODIFIED", pod("r1-decode-0", 19))
    assert cache.pods(KEY) == []
    cache.pod_event("ADDED", pod("r1-decode-0", 21, uid="u2"))
    assert [p["metadata"]["uid"] for p in cache.pods(KEY) or []] == ["u2"]


def test_a_list_corrects_drift_without_losing_newer_events() -> None:
    cache = seeded(pod("r1-decode-0", 5), pod("r1-decode-1", 6), pod("r1-decode-2", 7))
    # Events while the LIST (served at version 30) was in flight:
    cache.pod_event("MODIFIED", pod("r1-decode-0", 31, ready=False))  # newer than the LIST
    cache.pod_event("ADDED", pod("r1-decode-3", 32))  # created after the LIST
    cache.pod_event("DELETED", pod("r1-decode-4", 33))  # never listed, deleted after it
    # decode-2's deletion event was missed (a watch reconnect): the LIST no longer has it.
    cache.replace_pods(KEY, [pod("r1-decode-0", 25), pod("r1-decode-1", 26)], 30)
    assert names_and_versions(cache) == {"r1-decode-0": "31", "r1-decode-1": "26", "r1-decode-3": "32"}
    # After the LIST, an event older than it is already reflected in it.
    cache.pod_event("ADDED", pod("r1-decode-2", 7))
    cache.pod_event("MODIFIED", pod("r1-decode-4", 29))
    assert sorted(names_and_versions(cache)) == ["r1-decode-0", "r1-decode-1", "r1-decode-3"]


def test_a_list_keeps_a_newer_deletion() -> None:
    cache = seeded(pod("r1-decode-0", 5))
    cache.pod_event("DELETED", pod("r1-decode-0", 40))
    cache.replace_pods(KEY, [pod("r1-decode-0", 35)], 38)  # served before the deletion
    assert cache.pods(KEY) == []
    cache.pod_event("MODIFIED", pod("r1-decode-0", 39))  # between the LIST and the deletion
    assert cache.pods(KEY) == []


def test_unparseable_versions_count_as_newest() -> None:
    cache = seeded(pod("r1-decode-0", 50))
    cache.pod_event("MODIFIED", pod("r1-decode-0", "opaque", ready=False))
    assert (cache.pods(KEY) or [])[0]["metadata"]["resourceVersion"] == "opaque"


def test_pods_of_other_deployments_are_kept_apart() -> None:
    cache = seeded()
    other = pod("r2-decode-0", 5)
    other["metadata"]["labels"]["pdserve.io/deployment"] = "r2"
    assert cache.pod_event("ADDED", other) == ("ns", "r2")
    unlabelled = pod("x", 5)
    unlabelled["metadata"]["labels"] = {}
    assert cache.pod_event("ADDED", unlabelled) is None
    assert cache.pods(KEY) == []


def test_deployment_deletion_marks_stick_against_late_events() -> None:
    cache = ClusterCache()
    assert cache.deployment(KEY) is None and not cache.deleted(KEY)
    cache.deployment_event("ADDED", pdd(10))
    assert cache.deployment(KEY) == pdd(10)
    cache.deployment_event("DELETED", pdd(15))
    cache.deployment_event("MODIFIED", pdd(14))  # e.g. our own status write's echo, late
    assert cache.deleted(KEY) and cache.deployment(KEY) is None
    cache.forget(KEY)
    assert cache.deleted(KEY)  # the mark outlives the rest
    cache.deployment_event("ADDED", pdd(16))  # created again under the same name
    assert not cache.deleted(KEY) and cache.deployment(KEY) == pdd(16)


def test_a_deletion_timestamp_is_a_deletion() -> None:
    cache = ClusterCache()
    cache.deployment_event("ADDED", pdd(10))
    cache.deployment_event("MODIFIED", pdd(11, deletionTimestamp="2026-01-01T00:00:00Z"))
    assert cache.deleted(KEY)
    cache.deployment_event("MODIFIED", pdd(10))
    assert cache.deleted(KEY)


def test_a_404_marks_the_deployment_gone_over_older_events() -> None:
    cache = ClusterCache()
    cache.deployment_event("ADDED", pdd(10))
    cache.deployment_absent(KEY)
    cache.deployment_event("MODIFIED", pdd(9))
    assert cache.deleted(KEY)


def test_router_availability_follows_the_newest_version() -> None:
    cache = ClusterCache()
    assert cache.router_available(KEY) is None
    cache.router_event("MODIFIED", router(20, 1))
    cache.router_event("MODIFIED", router(19, 0))
    assert cache.router_available(KEY) == 1
    cache.router_event("DELETED", router(21, 1))
    assert cache.router_available(KEY) is None
