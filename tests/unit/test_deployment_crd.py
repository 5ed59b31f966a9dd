"""The CRD schema and the Python parser agree: same defaults, bounds and enums, and every field is described.

The parser is what the local mode and ``pdserve render`` use on files no API server checked;
if it drifted from the CRD, the same file would mean different things in and out of a cluster.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.deployment.spec.parse import SpecError, parse_spec
from pdserve.deployment.spec.pddeployment import API_VERSION, KIND, PLURAL

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "pddeployments.pdserve.io.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
ROOT = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = ROOT["properties"]["spec"]
BASE: dict[str, Any] = {"model": "m", "image": "vllm/vllm-openai:v0.11.0"}
#: The least spec.autoscaling there is (wide bounds, so any ratio bound within the CRD's is reachable).
AUTOSCALING: dict[str, Any] = {
    "prefill": {"maxInstances": 1024},
    "decode": {"maxInstances": 1024},
    "objectives": {"ttftMilliseconds": 2000, "itlMilliseconds": 50},
}
#: Optional sections with a required field: absent unless given, their defaults apply once given.
GIVEN_SECTIONS: dict[str, dict[str, Any]] = {
    "tracing": {"endpoint": "http://collector:4318/v1/traces"},
    "autoscaling": AUTOSCALING,
}


def walk(
    schema: dict[str, Any], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    for name, sub in schema.get("properties", {}).items():
        yield (*path, name), sub
        yield from walk(sub, (*path, name))
    if "items" in schema:
        yield from walk(schema["items"], (*path, "[]"))


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def attribute(spec: object, path: tuple[str, ...]) -> Any:
    value = spec
    for part in path:
        value = getattr(value, snake(part))
    return value


def with_value(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """BASE with ``spec.<path> = value``, plus what the rest of the spec needs for that field to be legal."""
    doc = copy.deepcopy(BASE)
    if path[0] in GIVEN_SECTIONS and path[-1] not in GIVEN_SECTIONS[path[0]]:
        doc[path[0]] = copy.deepcopy(GIVEN_SECTIONS[path[0]])
    if path[0] == "kvTransfer" and path[-1] == "transferMode":
        doc["kvTransfer"] = {"connector": "MoRIIOConnector"}
    node = doc
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    if path == ("kvTransfer", "connector") and value == "MoRIIOConnector":
        node["transferMode"] = "READ"
    if path == ("engine",) and value == "sim":
        doc.pop("image")
    return doc


LEAVES = [(p, s) for p, s in walk(SPEC_SCHEMA) if "[]" not in p and "properties" not in s]


def test_identity() -> None:
    assert CRD["metadata"]["name"] == f"{PLURAL}.pdserve.io"
    assert f"{CRD['spec']['group']}/{VERSION['name']}" == API_VERSION
    assert CRD["spec"]["names"]["kind"] == KIND
    assert CRD["spec"]["names"]["shortNames"] == ["pdd"]
    assert VERSION["served"] and VERSION["storage"]
    assert CRD["spec"]["scope"] == "Namespaced"


@pytest.mark.parametrize(
    ("path", "schema"), [(p, s) for p, s in LEAVES if "default" in s], ids=lambda v: str(v)
)
def test_parser_applies_the_crd_default(path: tuple[str, ...], schema: dict[str, Any]) -> None:
    doc = copy.deepcopy(BASE)
    if doc.pop(path[0], None) is not None and path[0] == "image":
        doc["engine"] = "sim"  # an empty image is legal only there
    if path[0] in GIVEN_SECTIONS:  # a section whose presence turns a feature on: its leaves default
        doc[path[0]] = copy.deepcopy(GIVEN_SECTIONS[path[0]])
    value = attribute(parse_spec(doc), path)
    default = schema["default"]
    if path[-1] == "policies":  # ScalingPolicy values as the CRD writes them
        value = [{"type": v.type, "value": v.value, "periodSeconds": v.period_seconds} for v in value]
    elif isinstance(default, list):
        value = list(value)
    elif isinstance(default, dict):
        value = dict(value)
    assert value == default


def test_every_section_defaults_to_an_object_so_its_defaults_apply() -> None:
    """Optional sections without defaults below them (modelCache, Secret references) stay absent,
    and so do those whose presence turns a feature on, with a required field (tracing, autoscaling)."""
    for name, sub in SPEC_SCHEMA["properties"].items():
        if name in GIVEN_SECTIONS:
            assert "default" not in sub and sub["required"], name
            continue
        if "properties" in sub and any("default" in s for _, s in walk(sub)):
            assert sub.get("default") == {}, name


@pytest.mark.parametrize(
    ("path", "schema"), [(p, s) for p, s in LEAVES if "minimum" in s], ids=lambda v: str(v)
)
def test_parser_enforces_the_crd_bounds(path: tuple[str, ...], schema: dict[str, Any]) -> None:
    low, high = schema["minimum"], schema.get("maximum")
    for value in [low, high]:
        if value is not None:
            assert attribute(parse_spec(with_value(path, value)), path) == value
    bad = [low - 1] + ([high + 1] if high is not None else [])
    for value in bad:
        with pytest.raises(SpecError) as info:
            parse_spec(with_value(path, value))
        assert info.value.path == "spec." + ".".join(path)


@pytest.mark.parametrize(("path", "schema"), [(p, s) for p, s in LEAVES if "enum" in s], ids=lambda v: str(v))
def test_parser_accepts_exactly_the_crd_enum(path: tuple[str, ...], schema: dict[str, Any]) -> None:
    for value in schema["enum"]:
        assert attribute(parse_spec(with_value(path, value)), path) == value
    with pytest.raises(SpecError) as info:
        parse_spec(with_value(path, "Bogus"))
    assert info.value.path == "spec." + ".".join(path)
    assert all(f'"{v}"' in info.value.reason for v in schema["enum"])


def test_parser_knows_every_crd_field() -> None:
    """A field the CRD accepts but the parser rejects would make files and clusters disagree."""
    sections = {"": SPEC_SCHEMA} | {k: v for k, v in SPEC_SCHEMA["properties"].items() if "properties" in v}
    for section, schema in sections.items():
        for name, sub in schema["properties"].items():
            if "properties" in sub:
                continue
            path = (section, name) if section else (name,)
            sample = sub.get("default", sub["enum"][0] if "enum" in sub else "x")
            try:
                parse_spec(with_value(path, sample))
            except SpecError as exc:
                assert "unknown field" not in exc.reason, exc
    with pytest.raises(SpecError, match="unknown field"):
        parse_spec({**BASE, "prefill": {"notAField": 1}})


def test_every_field_has_a_description() -> None:
    missing = [".".join(p) for p, s in walk(ROOT) if p != ("metadata",) and not s.get("description")]
    assert missing == []
    assert ROOT["description"]


def test_cel_rules_have_messages() -> None:
    rules = [r for _, s in walk(ROOT) for r in s.get("x-kubernetes-validations", [])]
    rules += ROOT.get("x-kubernetes-validations", []) + SPEC_SCHEMA.get("x-kubernetes-validations", [])
    assert len(rules) >= 6
    assert all(r["message"] and r["rule"] for r in rules)


def test_scale_subresource_targets_decode() -> None:
    scale = VERSION["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.decode.instances",
        "statusReplicasPath": ".status.decode.instances",
        "labelSelectorPath": ".status.decode.selector",
    }
    assert "status" in VERSION["subresources"]


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert list(columns)[:6] == ["Ready", "Prefill", "Decode", "P-Slots", "D-Slots", "Routers"]
    assert columns["Routers"]["jsonPath"] == ".status.routers.summary"  # current/ready
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["P-Slots"]["jsonPath"] == ".status.prefill.readySlots"
    assert columns["Age"]["type"] == "date"
