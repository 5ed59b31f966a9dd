"""Tracing's configuration, all pure: what an endpoint URL means (to pdserve and to vLLM),
``spec.tracing`` parsed and rendered into the router's and the engines' flags and variables,
what local mode runs with it, and the router's and the simulator's flags."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import pytest
import yaml

from pdserve.argtypes import SettingsError
from pdserve.deployment.render.engine_pod import instance_pod, template_hash
from pdserve.deployment.render.router import router_deployment
from pdserve.deployment.spec.parse import SpecError, parse_pddeployment
from pdserve.deployment.spec.tracing import TracingSpec, with_endpoint
from pdserve.deployment.validate import problems
from pdserve.local.plan import SimTimings, plan_local_run
from pdserve.proxy import cli as proxy_cli
from pdserve.proxy.settings import TracingSettings
from pdserve.routing import Role
from pdserve.sim import vllm_cli
from pdserve.tracing.context import trace_id_of, traceparent
from pdserve.tracing.endpoint import (
    GRPC,
    HTTP_PROTOBUF,
    EndpointError,
    OtlpEndpoint,
    parse_endpoint,
    vllm_endpoint,
    vllm_settings,
)
from tests.support.specs import pdd_of, sim_manifest
from tests.unit.test_deployment_crd import CRD_PATH

HTTP = "http://collector.obs:4318/v1/traces"
TRACING = {"endpoint": HTTP, "samplingRatio": 0.25}

# --- endpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (HTTP, OtlpEndpoint(HTTP_PROTOBUF, HTTP, insecure=True)),
        ("http://c:4318", OtlpEndpoint(HTTP_PROTOBUF, "http://c:4318/v1/traces", insecure=True)),
        (
            "https://c.example/otlp/v1/traces",
            OtlpEndpoint(HTTP_PROTOBUF, "https://c.example/otlp/v1/traces", False),
        ),
        ("grpc://c:4317", OtlpEndpoint(GRPC, "grpc://c:4317", insecure=True)),
        ("grpcs://c:4317/", OtlpEndpoint(GRPC, "grpcs://c:4317", insecure=False)),
        ("grpc://[::1]:4317", OtlpEndpoint(GRPC, "grpc://[::1]:4317", insecure=True)),
    ],
)
def test_the_scheme_says_the_protocol(text: str, expected: OtlpEndpoint) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("collector:4317", "expected http(s)://HOST:PORT/v1/traces"),
        ("ftp://c:21", "expected http(s)://HOST:PORT/v1/traces"),
        ("grpc://c", "give the collector's gRPC port"),
        ("grpc://c:4317/v1/traces", "HOST:PORT only"),
        ("http://c:99999/v1/traces", "the port is not a number"),
        ("http:///v1/traces", "expected http(s)://"),
    ],
)
def test_an_unusable_endpoint_says_what_is_expected(text: str, problem: str) -> None:
    with pytest.raises(EndpointError, match=re.escape(problem)):
        parse_endpoint(text)


def test_the_crd_pattern_and_the_parser_agree() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pattern = re.compile(spec["properties"]["tracing"]["properties"]["endpoint"]["pattern"])
    samples = [
        HTTP,
        "http://c:4318",
        "https://c/x",
        "grpc://c:4317",
        "grpcs://c:4317/",
        "grpc://c",
        "ftp://c:1",
    ]
    samples += ["grpc://c:4317/v1/traces", "collector:4317", "http://c:4318/v1/traces with space"]
    for text in samples:
        try:
            parse_endpoint(text)
            parsed = True
        except EndpointError:
            parsed = False
        assert bool(pattern.match(text)) == parsed, text


def test_vllm_is_told_the_protocol_by_its_variable() -> None:
    """vLLM 0.32 sends gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf, and its
    gRPC exporter is insecure unless the URL's scheme is https."""
    protocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    assert vllm_settings(parse_endpoint("http://c:4318")) == (
        "http://c:4318/v1/traces",
        {protocol: HTTP_PROTOBUF},
    )
    assert vllm_settings(parse_endpoint("grpc://c:4317")) == ("http://c:4317", {protocol: GRPC})
    assert vllm_settings(parse_endpoint("grpcs://c:4317")) == ("https://c:4317", {protocol: GRPC})


def test_the_simulator_reads_the_flag_as_vllm_does() -> None:
    assert vllm_endpoint("http://c:4317", None) == OtlpEndpoint(GRPC, "http://c:4317", insecure=True)
    assert vllm_endpoint("https://c:4317", "grpc") == OtlpEndpoint(GRPC, "https://c:4317", insecure=False)
    assert vllm_endpoint(HTTP, "http/protobuf").protocol == HTTP_PROTOBUF
    with pytest.raises(EndpointError, match="Unsupported OTLP protocol 'http/json' is configured"):
        vllm_endpoint(HTTP, "http/json")


def test_traceparent_text() -> None:
    header = traceparent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)
    assert header == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_id_of(header) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id_of("00-" + "0" * 32 + "-00f067aa0ba902b7-01") is None  # the invalid all-zero id
    assert trace_id_of("garbage") is None and trace_id_of(None) is None


# --- spec.tracing ------------------------------------------------------------------------------


def test_spec_tracing_is_parsed_with_its_defaults() -> None:
    assert pdd_of().spec.tracing is None
    assert pdd_of(tracing={"endpoint": HTTP}).spec.tracing == TracingSpec(HTTP, 1.0, ())
    spec = pdd_of(tracing={**TRACING, "collectDetailedTraces": ["model", "worker"]}).spec
    assert spec.tracing == TracingSpec(HTTP, 0.25, ("model", "worker"))


@pytest.mark.parametrize(
    ("tracing", "path", "reason"),
    [
        ({}, "spec.tracing.endpoint", "required field is missing"),
        ({"endpoint": "collector:4317"}, "spec.tracing.endpoint", "expected http(s)://"),
        ({"endpoint": HTTP, "samplingRatio": 2}, "spec.tracing.samplingRatio", "from 0 to 1"),
        ({"endpoint": HTTP, "samplingRatio": True}, "spec.tracing.samplingRatio", "from 0 to 1"),
        (
            {"endpoint": HTTP, "collectDetailedTraces": ["gpu"]},
            "spec.tracing.collectDetailedTraces[0]",
            '"model"',
        ),
        (
            {"endpoint": HTTP, "collectDetailedTraces": ["all", "all"]},
            "spec.tracing.collectDetailedTraces",
            "once",
        ),
        ({"endpoint": HTTP, "ratio": 1}, "spec.tracing.ratio", "unknown field"),
    ],
)
def test_a_bad_tracing_section_names_the_field(tracing: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        pdd_of(tracing=tracing)
    assert info.value.path == path
    assert reason in info.value.reason


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in container.get("env", [])}


def _names(container: dict[str, Any]) -> list[str]:
    return [v["name"] for v in container.get("env", [])]


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _flag(args: list[str], flag: str) -> list[str]:
    """The values after ``flag`` up to the next flag."""
    i = args.index(flag) + 1
    out = []
    while i < len(args) and not args[i].startswith("--"):
        out.append(args[i])
        i += 1
    return out


def test_the_router_gets_the_endpoint_the_ratio_and_a_service_name() -> None:
    pdd = pdd_of("llama", tracing=TRACING)
    router = _container(router_deployment(pdd)["spec"]["template"]["spec"], "router")
    assert _flag(router["args"], "--otlp-traces-endpoint") == [HTTP]
    assert _flag(router["args"], "--trace-sampling-ratio") == ["0.25"]
    env = _env(router)
    assert env["OTEL_SERVICE_NAME"] == "llama-router"
    attributes = "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),pdserve.deployment=llama"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == attributes
    names = _names(router)  # Kubernetes expands $(VAR) only for variables defined before
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert names.index("POD_NAMESPACE") < names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_the_decode_sidecar_router_traces_too() -> None:
    pdd = pdd_of("llama", tracing=TRACING, router={"placement": "decode-sidecar"})
    pod = instance_pod(pdd, Role.DECODE, 0)["spec"]
    router = _container(pod, "router")
    assert _flag(router["args"], "--otlp-traces-endpoint") == [HTTP]
    assert _env(router)["OTEL_SERVICE_NAME"] == "llama-router"
    assert _env(_container(pod, "engine"))["OTEL_SERVICE_NAME"] == "llama-decode"
    assert len(_names(router)) == len(set(_names(router)))


@pytest.mark.parametrize(
    ("endpoint", "vllm_url", "protocol"),
    [(HTTP, HTTP, "http/protobuf"), ("grpc://collector.obs:4317", "http://collector.obs:4317", "grpc")],
)
def test_vllm_engines_get_the_flag_and_the_protocol_as_vllm_reads_them(
    endpoint: str, vllm_url: str, protocol: str
) -> None:
    pdd = pdd_of(
        "llama", tracing={"endpoint": endpoint, "samplingRatio": 0.25, "collectDetailedTraces": ["all"]}
    )
    for role in (Role.PREFILL, Role.DECODE):
        engine = _container(instance_pod(pdd, role, 0)["spec"], "engine")
        assert _flag(engine["args"], "--otlp-traces-endpoint") == [vllm_url]
        assert _flag(engine["args"], "--collect-detailed-traces") == ["all"]
        env = _env(engine)
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == protocol
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
        assert env["OTEL_SERVICE_NAME"] == f"llama-{role.value}"
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        # The simulator's stand-in for `vllm serve` takes exactly these flags (it refuses unknown ones).
        serve = vllm_cli.parse(engine["args"])
        assert "--otlp-traces-endpoint" in serve.tracing_args


def test_a_role_env_overrides_the_tracing_defaults() -> None:
    pdd = pdd_of(tracing=TRACING, prefill={"env": [{"name": "OTEL_SERVICE_NAME", "value": "mine"}]})
    engine = _container(instance_pod(pdd, Role.PREFILL, 0)["spec"], "engine")
    assert _names(engine).count("OTEL_SERVICE_NAME") == 1
    assert _env(engine)["OTEL_SERVICE_NAME"] == "mine"


def test_simulated_engines_get_the_flags_too() -> None:
    pdd = parse_pddeployment(sim_manifest("s", tracing={"endpoint": "grpc://c:4317"}))
    engine = _container(instance_pod(pdd, Role.PREFILL, 0)["spec"], "engine")
    assert engine["command"] == ["pdserve", "sim"]
    assert _flag(engine["args"], "--otlp-traces-endpoint") == ["http://c:4317"]
    assert _env(engine)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"


def test_without_tracing_nothing_is_rendered() -> None:
    pdd = pdd_of(router={"placement": "decode-sidecar"})
    text = str([instance_pod(pdd, r, 0) for r in (Role.PREFILL, Role.DECODE)])
    text += str(router_deployment(pdd_of()))
    assert "OTEL_" not in text and "otlp" not in text and "trace" not in text


def test_turning_tracing_on_restarts_the_engines() -> None:
    """vLLM reads its flags at start: the template hash (what rollouts compare) changes."""
    off, on = pdd_of(), pdd_of(tracing=TRACING)
    assert template_hash(off, Role.PREFILL) != template_hash(on, Role.PREFILL)


def test_tracing_flags_in_a_role_args_are_refused_when_spec_tracing_sets_them() -> None:
    args = {"args": ["--otlp-traces-endpoint=http://elsewhere:4318"]}
    assert any(
        "spec.prefill.args[0]: --otlp-traces-endpoint is set by pdserve (set spec.tracing)" in p
        for p in problems(pdd_of(tracing=TRACING, prefill=args), None)
    )
    assert not problems(pdd_of(prefill=args), None)  # without spec.tracing the role's own flag stands


# --- local mode --------------------------------------------------------------------------------


def test_local_mode_passes_the_endpoint_to_every_process() -> None:
    pdd = parse_pddeployment(sim_manifest("s", tracing={"endpoint": HTTP, "samplingRatio": 0.5}))
    pdd = dataclasses.replace(
        pdd,
        spec=dataclasses.replace(pdd.spec, tracing=with_endpoint(pdd.spec.tracing, "grpc://127.0.0.1:4317")),
    )
    assert pdd.spec.tracing == TracingSpec("grpc://127.0.0.1:4317", 0.5, ())
    plan = plan_local_run(
        pdd, "sim", [9001, 9002], 8000, "/run/routing.json", SimTimings(), "/usr/bin/python3"
    )
    for engine in plan.engines:
        assert "--otlp-traces-endpoint" in engine.argv
        assert engine.env["OTEL_SERVICE_NAME"] == f"s-{engine.role.value}"
        assert (
            engine.env["OTEL_RESOURCE_ATTRIBUTES"]
            == f"k8s.namespace.name=default,k8s.pod.name={engine.name},pdserve.deployment=s"
        )
    (router,) = plan.routers
    assert list(router.argv[router.argv.index("--otlp-traces-endpoint") :][:2]) == [
        "--otlp-traces-endpoint",
        "grpc://127.0.0.1:4317",
    ]
    assert router.env["OTEL_SERVICE_NAME"] == "s-router"
    assert "$(" not in str(router.env)
    assert any(note.startswith("tracing: the router and every engine send") for note in plan.notes)


def test_local_mode_refuses_an_unusable_endpoint() -> None:
    with pytest.raises(SpecError) as info:
        with_endpoint(None, "collector:4317")
    assert info.value.path == "--otlp-traces-endpoint"


# --- the router's and the simulator's flags ----------------------------------------------------


def _proxy_settings(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    proxy_cli.configure(parser)
    return proxy_cli.settings_from_args(parser.parse_args(["--routing-file", "/t.json", *argv]))


def test_the_router_flags() -> None:
    assert _proxy_settings().tracing == TracingSettings()
    assert TracingSettings().otlp is None
    settings = _proxy_settings("--otlp-traces-endpoint", "grpc://c:4317", "--trace-sampling-ratio", "0.1")
    assert settings.tracing.otlp == OtlpEndpoint(GRPC, "grpc://c:4317")
    assert settings.tracing.sampling_ratio == 0.1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--trace-sampling-ratio", "1.5"), "--trace-sampling-ratio: expected a value from 0 to 1, got 1.5"),
        (("--trace-sampling-ratio", "-1"), "--trace-sampling-ratio: expected a value >= 0"),
        (("--otlp-traces-endpoint", "c:4317"), "--otlp-traces-endpoint: expected http(s)://"),
    ],
)
def test_bad_router_tracing_flags_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(proxy_cli.UsageError, match=re.escape(message)):
        _proxy_settings(*argv)
    with pytest.raises(SettingsError):
        TracingSettings(endpoint="c:4317")


def test_the_router_reads_its_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PROXY_OTLP_TRACES_ENDPOINT", HTTP)
    assert _proxy_settings().tracing.endpoint == HTTP


def test_the_vllm_stand_in_refuses_detailed_traces_without_an_endpoint() -> None:
    with pytest.raises(vllm_cli.Refused, match="collect_detailed_traces requires `--otlp-traces-endpoint`"):
        vllm_cli.parse(["m", "--collect-detailed-traces", "all"])
    serve = vllm_cli.parse(
        ["m", "--otlp-traces-endpoint", HTTP, "--collect-detailed-traces", "model", "worker"]
    )
    argv = vllm_cli.sim_argv(serve, {})
    assert argv[argv.index("--otlp-traces-endpoint") :][:5] == [
        "--otlp-traces-endpoint",
        HTTP,
        "--collect-detailed-traces",
        "model",
        "worker",
    ]
