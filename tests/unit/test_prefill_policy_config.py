"""spec.router.prefillPolicy and the router's --prefill-policy / --prefix-* flags: parsed, refused
when unknown or out of range, and rendered (one router keeps exact shares for unmatched prompts;
several agree by rendezvous hashing)."""

from __future__ import annotations

import argparse
import re

import pytest

from pdserve.deployment.render.groups import render_all
from pdserve.deployment.render.router import router_deployment
from pdserve.deployment.spec.parse import SpecError
from pdserve.proxy.cli import UsageError, configure, settings_from_args
from pdserve.proxy.settings import ProxySettings
from tests.unit.test_deployment_objects import pdd_of
from tests.unit.test_deployment_sidecar import render


def router_args(**router: object) -> list[str]:
    return list(router_deployment(pdd_of(router=router))["spec"]["template"]["spec"]["containers"][0]["args"])


def test_unset_leaves_the_flags_as_they_were() -> None:
    args = router_args()
    assert "--prefill-policy" not in args and "--prefix-unmatched" not in args
    assert pdd_of().spec.router.prefill_policy is None


def test_one_router_keeps_exact_shares_for_unmatched_prompts() -> None:
    args = router_args(prefillPolicy="prefix-affinity")
    assert args[args.index("--prefill-policy") + 1] == "prefix-affinity"
    assert "--prefix-unmatched" not in args


def test_several_routers_agree_by_rendezvous() -> None:
    args = router_args(prefillPolicy="prefix-affinity", replicas=2)
    assert args[args.index("--prefix-unmatched") + 1] == "rendezvous"
    sidecar = render(prefillPolicy="prefix-affinity")
    pod = next(o for o in sidecar if o["kind"] == "Pod" and "decode" in o["metadata"]["name"])
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "router")
    assert container["args"][container["args"].index("--prefix-unmatched") + 1] == "rendezvous"
    assert "--prefix-unmatched" not in router_args(prefillPolicy="flat-interleaved", replicas=2)


def test_the_rendered_flags_start_a_router() -> None:
    policy_args = pdd_of(router={"prefillPolicy": "prefix-affinity", "replicas": 3}).spec.router.policy_args()
    assert " ".join(policy_args) in " ".join(router_args(prefillPolicy="prefix-affinity", replicas=3))
    parser = argparse.ArgumentParser()
    configure(parser)
    settings = settings_from_args(parser.parse_args(["--routing-file", "routing.json", *policy_args]))
    assert (settings.prefill_policy, settings.prefix.unmatched) == ("prefix-affinity", "rendezvous")


def test_an_unknown_prefill_policy_is_refused() -> None:
    with pytest.raises(SpecError, match=r'spec\.router\.prefillPolicy.*expected one of "flat-interleaved"'):
        pdd_of(router={"prefillPolicy": "cache_aware"})
    assert render_all(pdd_of(router={"prefillPolicy": "flat-interleaved"}))


def parse(*flags: str) -> ProxySettings:
    parser = argparse.ArgumentParser()
    configure(parser)
    return settings_from_args(parser.parse_args(["--routing-file", "routing.json", *flags]))


def test_the_router_refuses_what_it_cannot_route_with(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--prefill-policy", "cache_aware")
    assert "invalid choice: 'cache_aware'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--prefill-policy", "prefix-affinity", "--prefix-unmatched", "random")
    for flags, message in (
        (("--prefix-balance", "-0.5"), "--prefix-balance: expected a value >= 0, got -0.5"),
        (("--prefix-balance", "1000"), "--prefix-balance: expected a value from 0 to 100, got 1000.0"),
        (("--prefix-chunk-chars", "0"), "--prefix-chunk-chars: expected a value >= 1, got 0"),
        (("--prefix-index-chunks", "-1"), "--prefix-index-chunks: expected a value >= 0, got -1"),
        (("--prefix-chars-per-token", "0"), "--prefix-chars-per-token: expected a value >= 0.01, got 0.0"),
    ):
        with pytest.raises(UsageError, match=re.escape(message)):
            parse("--prefill-policy", "prefix-affinity", *flags)


def test_the_environment_cannot_sneak_in_an_unknown_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PROXY_PREFILL_POLICY", "cache_aware")
    with pytest.raises(
        UsageError, match="--prefill-policy: expected one of flat-interleaved, prefix-affinity"
    ):
        parse()


def test_defaults() -> None:
    settings = parse()
    assert settings.prefill_policy is None
    assert (settings.prefix.balance, settings.prefix.unmatched, settings.prefix.index_chunks) == (
        0.25,
        "flat",
        0,
    )


def test_every_prefill_policy_is_known_to_the_spec_parser_and_the_crd() -> None:
    from pathlib import Path

    import yaml

    from pdserve.deployment.spec import pddeployment
    from pdserve.proxy.policies import PREFILL_POLICIES

    crd = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "crds" / "pddeployments.pdserve.io.yaml").read_text()
    )
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    enum = spec["properties"]["router"]["properties"]["prefillPolicy"]["enum"]
    assert set(PREFILL_POLICIES) == set(pddeployment.PREFILL_POLICIES) == set(enum)
