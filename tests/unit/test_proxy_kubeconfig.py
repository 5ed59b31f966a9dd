"""The router's Kubernetes credentials: kubeconfig contexts, in-cluster service accounts, token
rotation, ConfigMap references, and the TLS context built from real PEM files."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.proxy.table.kubeconfig import (
    ConfigMapRef,
    CredentialsError,
    PemSource,
    TokenSource,
    default_namespace,
    in_cluster,
    kubeconfig_paths,
    load_kubeconfig,
    parse_configmap_ref,
    parse_kubeconfig,
    token_kubeconfig,
    token_subject,
)

CA_PEM = b"-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def config(user: dict[str, Any], cluster: dict[str, Any] | None = None, **ctx: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://127.0.0.1:6443/"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", **ctx}}],
        "current-context": "ctx",
    }


def parse(doc: dict[str, Any], base: Path = Path("/etc/kube/config"), context: str | None = None) -> Any:
    return parse_kubeconfig([(base, doc)], context)


def fake_jwt(claims: dict[str, Any]) -> str:
    part = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJSUzI1NiJ9.{part}.c2ln"


# --- kubeconfig -----------------------------------------------------------------------------------


def test_token_user_with_ca_data_and_namespace() -> None:
    cluster = {"server": "https://10.0.0.1:6443/", "certificate-authority-data": b64(CA_PEM)}
    creds = parse(config({"token": "s3cret"}, cluster, namespace="team-a"))
    assert creds.server == "https://10.0.0.1:6443"
    assert creds.ca is not None and creds.ca.read() == CA_PEM
    assert creds.token == "s3cret" and creds.namespace == "team-a"
    assert creds.origin == "kubeconfig /etc/kube/config (context ctx)"
    assert "s3cret" not in repr(creds)  # never printed


def test_relative_files_resolve_against_the_kubeconfig_directory() -> None:
    cluster = {"server": "https://h:1", "certificate-authority": "pki/ca.crt"}
    user = {"client-certificate": "pki/me.crt", "client-key": "/abs/me.key", "tokenFile": "tok"}
    creds = parse(config(user, cluster), base=Path("/home/me/.kube/config"))
    assert creds.ca == PemSource(path=Path("/home/me/.kube/pki/ca.crt"))
    assert creds.client_cert == PemSource(path=Path("/home/me/.kube/pki/me.crt"))
    assert creds.client_key == PemSource(path=Path("/abs/me.key"))
    assert creds.token_file == Path("/home/me/.kube/tok")


def test_explicit_context_and_merge_first_wins() -> None:
    first = config({"token": "one"})
    second = config({"token": "two"})
    second["contexts"].append({"name": "other", "context": {"cluster": "c", "user": "u", "namespace": "x"}})
    second["current-context"] = "other"
    merged = parse_kubeconfig([(Path("/a"), first), (Path("/b"), second)])
    assert merged.token == "one" and merged.namespace is None  # first file's current-context and user
    other = parse_kubeconfig([(Path("/a"), first), (Path("/b"), second)], context="other")
    assert other.namespace == "x" and other.token == "one"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("current-context"), "has no current-context"),
        (lambda d: d.update({"current-context": "nope"}), "has no context 'nope'"),
        (lambda d: d["contexts"][0]["context"].update(cluster="gone"), "names no known cluster ('gone')"),
        (lambda d: d["contexts"][0]["context"].update(user="gone"), "names no known user ('gone')"),
        (lambda d: d["clusters"][0]["cluster"].pop("server"), "needs a server URL"),
        (lambda d: d["clusters"][0]["cluster"].update(server="10.0.0.1:6443"), "needs a server URL"),
        (lambda d: d["users"][0]["user"].update(exec={"command": "aws"}), "exec credential plugin"),
        (lambda d: d["users"][0]["user"].update({"auth-provider": {"name": "gcp"}}), "auth-provider plugin"),
        (lambda d: d["users"][0]["user"].update(username="admin", password="pw"), "basic auth"),
        (lambda d: d["users"][0]["user"].update({"client-certificate-data": b64(b"x")}), "needs both"),
        (lambda d: d["users"][0]["user"].update({"client-key-data": "%%%"}), "not valid base64"),
        (lambda d: d.update(users={"u": {}}), "users must be a list"),
    ],
)
def test_unusable_kubeconfigs_are_refused_with_the_reason(mutate: Any, message: str) -> None:
    doc = config({"token": "t"})
    mutate(doc)
    with pytest.raises(CredentialsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(doc)


def test_load_kubeconfig_reads_yaml_and_reports_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(config({"token": "t"})))
    assert load_kubeconfig([path]).token == "t"
    path.write_text("clusters: [\n")
    with pytest.raises(CredentialsError, match="is not valid YAML"):
        load_kubeconfig([path])
    with pytest.raises(CredentialsError, match="cannot read kubeconfig"):
        load_kubeconfig([tmp_path / "missing"])


def test_kubeconfig_env_list_skips_missing_files(tmp_path: Path) -> None:
    present = tmp_path / "b"
    present.write_text("")
    assert kubeconfig_paths(f"{tmp_path / 'a'}:{present}") == [present]
    assert kubeconfig_paths(str(tmp_path / "a")) == [tmp_path / "a"]  # all missing: reported on read


def test_token_kubeconfig_round_trips() -> None:
    doc = token_kubeconfig("https://127.0.0.1:6443", CA_PEM, "tok", "ns1")
    creds = parse(yaml.safe_load(yaml.safe_dump(doc)))
    assert (creds.server, creds.token, creds.namespace) == ("https://127.0.0.1:6443", "tok", "ns1")
    assert creds.ca is not None and creds.ca.read() == CA_PEM


# --- in cluster -----------------------------------------------------------------------------------


def service_account(tmp_path: Path, token: str = "t1", namespace: str = "ns1") -> Path:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token)
    (sa / "ca.crt").write_bytes(CA_PEM)
    (sa / "namespace").write_text(namespace + "\n")
    return sa


def test_in_cluster_reads_the_service_account(tmp_path: Path) -> None:
    sa = service_account(tmp_path)
    creds = in_cluster({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, sa)
    assert creds.server == "https://10.96.0.1:443" and creds.namespace == "ns1"
    assert creds.token_file == sa / "token" and creds.ca == PemSource(path=sa / "ca.crt")
    v6 = in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, sa)
    assert v6.server == "https://[fd00::1]:443"


def test_in_cluster_outside_a_pod_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="pass --kubeconfig"):
        in_cluster({}, tmp_path)
    with pytest.raises(CredentialsError, match="automountServiceAccountToken"):
        in_cluster({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"}, tmp_path / "none")


def test_token_file_is_reread_periodically_and_on_demand(tmp_path: Path) -> None:
    sa = service_account(tmp_path, token="first\n")
    now = [0.0]
    creds = in_cluster({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"}, sa)
    tokens = TokenSource(creds, reread_s=60, clock=lambda: now[0])
    assert tokens.token() == "first"
    (sa / "token").write_text("second")  # the kubelet rotated it
    now[0] = 59.0
    assert tokens.token() == "first"  # cached
    now[0] = 60.0
    assert tokens.token() == "second"
    (sa / "token").write_text("third")
    assert tokens.token(force=True) == "third"  # after a 401
    (sa / "token").unlink()
    now[0] = 500.0
    assert tokens.token() == "third"  # a rotation caught half-way keeps the last token
    fresh = TokenSource(creds)
    with pytest.raises(CredentialsError, match="cannot read token file"):
        fresh.token()


def test_token_subject_names_the_service_account() -> None:
    token = fake_jwt({"sub": "system:serviceaccount:ns1:llama-router", "aud": ["x"]})
    assert token_subject(token) == "system:serviceaccount:ns1:llama-router"
    assert token_subject("opaque-static-token") is None
    assert token_subject("a.%%%.c") is None


# --- which ConfigMap ------------------------------------------------------------------------------


def test_configmap_ref_with_and_without_namespace() -> None:
    assert parse_configmap_ref("ns1/llama-routing", lambda: None) == ConfigMapRef("ns1", "llama-routing")
    assert parse_configmap_ref("llama-routing", lambda: "pod-ns") == ConfigMapRef("pod-ns", "llama-routing")
    assert str(ConfigMapRef("a", "b")) == "a/b"
    with pytest.raises(CredentialsError, match="set POD_NAMESPACE"):
        parse_configmap_ref("llama-routing", lambda: None)
    with pytest.raises(CredentialsError, match="not a valid namespace name"):
        parse_configmap_ref("Bad_NS/x", lambda: None)
    with pytest.raises(CredentialsError, match="not a valid ConfigMap name"):
        parse_configmap_ref("ns/Routing!", lambda: None)


def test_default_namespace_order(tmp_path: Path) -> None:
    sa = service_account(tmp_path, namespace="from-sa")
    creds = parse(config({"token": "t"}, namespace="from-context"))
    assert default_namespace({"POD_NAMESPACE": "from-env"}, sa, creds) == "from-env"
    assert default_namespace({}, sa, creds) == "from-sa"
    assert default_namespace({}, tmp_path / "none", creds) == "from-context"
    assert default_namespace({}, tmp_path / "none", None) is None


# --- TLS from real PEM files ----------------------------------------------------------------------


def make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
            "-keyout",
            key,
            "-out",
            crt,
        ],
        check=True,
        capture_output=True,
    )
    return crt, key


def test_ssl_context_loads_ca_and_client_pair_from_data_or_files(tmp_path: Path) -> None:
    ca_crt, _ = make_cert(tmp_path, "ca")
    crt, key = make_cert(tmp_path, "client")
    cluster = {"server": "https://127.0.0.1:6443", "certificate-authority-data": b64(ca_crt.read_bytes())}
    inline = {"client-certificate-data": b64(crt.read_bytes()), "client-key-data": b64(key.read_bytes())}
    ctx = parse(config(inline, cluster)).ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1
    files = {"client-certificate": str(crt), "client-key": str(key)}
    assert parse(config(files, cluster)).ssl_context() is not None
    mismatched = {"client-certificate": str(crt), "client-key": str(make_cert(tmp_path, "other")[1])}
    with pytest.raises(CredentialsError, match="client certificate"):
        parse(config(mismatched, cluster)).ssl_context()
    insecure = parse(config({"token": "t"}, {"server": "https://h:1", "insecure-skip-tls-verify": True}))
    ctx = insecure.ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE
    assert parse(config({"token": "t"}, {"server": "http://127.0.0.1:8001"})).ssl_context() is None
    missing_ca = {"server": "https://h:1", "certificate-authority": str(tmp_path / "nope.crt")}
    with pytest.raises(CredentialsError, match="cannot read"):
        parse(config({"token": "t"}, missing_ca)).ssl_context()
