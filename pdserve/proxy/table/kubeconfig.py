"""Credentials for the Kubernetes API, without the Kubernetes client: a kubeconfig's current
context, or the pod's in-cluster service account.

The router needs exactly one thing from the API server (its routing ConfigMap), so this reads
what kubectl and client-go read for that: the server URL, the CA (data or file), a client
certificate and key (data or file) or a bearer token (inline, or a file re-read periodically,
since projected service-account tokens rotate). Parsing is pure (:func:`parse_kubeconfig`,
:func:`in_cluster`); files are read when the TLS context or a token is needed. Credential
plugins (``exec``, ``auth-provider``) and basic auth are refused with a message that says what
to use instead, never silently ignored.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_S = 60.0  # client-go re-reads a token file about once a minute
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class CredentialsError(ValueError):
    """Credentials that cannot be used; the message says which field of which file and what to do."""


@dataclass(frozen=True)
class PemSource:
    """PEM bytes given inline (``*-data``, base64-decoded) or as a file path."""

    data: bytes | None = field(default=None, repr=False)
    path: Path | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        try:
            return self.path.read_bytes()
        except OSError as exc:
            raise CredentialsError(f"cannot read {self.path}: {exc.strerror or exc}") from None

    def describe(self) -> str:
        return "inline data" if self.data is not None else str(self.path)


@dataclass(frozen=True)
class ApiCredentials:
    """How to reach and authenticate to one API server. Never printed with its secrets."""

    server: str  # https://host:port, no trailing slash
    origin: str  # where these came from, for messages: "kubeconfig <path> (context <name>)"
    ca: PemSource | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    client_cert: PemSource | None = None
    client_key: PemSource | None = None
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    namespace: str | None = None  # the context's namespace, or the service account's

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context (None for a plain-http server, e.g. a local proxy)."""
        if not self.server.startswith("https://"):
            return None
        ctx = ssl.create_default_context(cadata=self.ca.read().decode() if self.ca else None)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.client_cert is not None and self.client_key is not None:
            _load_client_pair(ctx, self.client_cert, self.client_key)
        return ctx


def _load_client_pair(ctx: ssl.SSLContext, cert: PemSource, key: PemSource) -> None:
    """ssl loads a certificate chain from files only: inline data goes through a private temp dir."""
    if cert.path is not None and key.path is not None:
        try:
            ctx.load_cert_chain(cert.path, key.path)
        except (OSError, ssl.SSLError) as exc:
            raise CredentialsError(f"client certificate {cert.path} / key {key.path}: {exc}") from None
        return
    with tempfile.TemporaryDirectory(prefix="pdserve-kube-") as tmp:  # mode 0700
        cert_path, key_path = Path(tmp, "client.crt"), Path(tmp, "client.key")
        cert_path.write_bytes(cert.read())
        key_path.touch(mode=0o600)
        key_path.write_bytes(key.read())
        try:
            ctx.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as exc:
            raise CredentialsError(
                f"client certificate ({cert.describe()}) / key ({key.describe()}): {exc}"
            ) from None


class TokenSource:
    """The bearer token to send: inline, or a file re-read every ``reread_s`` (and on demand
    after a 401), because projected service-account tokens are rotated by the kubelet."""

    def __init__(
        self,
        creds: ApiCredentials,
        reread_s: float = TOKEN_REREAD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._creds = creds
        self._reread_s = reread_s
        self._clock = clock
        self._token: str | None = creds.token
        self._read_at: float | None = None

    def token(self, force: bool = False) -> str | None:
        path = self._creds.token_file
        if path is None:
            return self._token
        now = self._clock()
        if force or self._read_at is None or now - self._read_at >= self._reread_s:
            try:
                self._token = path.read_text().strip() or None
            except OSError as exc:
                if self._token is None:
                    raise CredentialsError(f"cannot read token file {path}: {exc.strerror or exc}") from None
                # keep the last token; the next read may succeed (a rotation in progress)
            self._read_at = now
        return self._token

    def subject(self) -> str | None:
        """The token's ``sub`` claim (e.g. system:serviceaccount:ns:name), unverified: for messages only."""
        try:
            token = self.token()
        except CredentialsError:
            return None
        return token_subject(token) if token else None


def token_subject(token: str) -> str | None:
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, UnicodeDecodeError):
        return None
    sub = payload.get("sub") if isinstance(payload, dict) else None
    return sub if isinstance(sub, str) else None


# --- in cluster ---------------------------------------------------------------------------------


def in_cluster(env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR) -> ApiCredentials:
    """The pod's service account, as client-go's InClusterConfig finds it."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise CredentialsError(
            "not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not "
            "set): pass --kubeconfig (or set KUBECONFIG) to reach the API server from outside"
        )
    token_file = sa_dir / "token"
    if not token_file.is_file():
        raise CredentialsError(
            f"no service-account token at {token_file}: give the router pod a service account with "
            "automountServiceAccountToken: true, or pass --kubeconfig"
        )
    ca_file = sa_dir / "ca.crt"
    namespace_file = sa_dir / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
    return ApiCredentials(
        server=f"https://{_host_port(host, port)}",
        origin=f"in-cluster service account ({sa_dir})",
        ca=PemSource(path=ca_file) if ca_file.is_file() else None,
        token_file=token_file,
        namespace=namespace or None,
    )


def _host_port(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- kubeconfig ---------------------------------------------------------------------------------


def load_kubeconfig(paths: Sequence[Path], context: str | None = None) -> ApiCredentials:
    """Read and merge kubeconfig files (KUBECONFIG may list several, first wins), pick the context."""
    import yaml  # only this source needs YAML; the file source never loads it

    docs: list[tuple[Path, Mapping[str, Any]]] = []
    for path in paths:
        try:
            text = path.read_text()
        except OSError as exc:
            raise CredentialsError(f"cannot read kubeconfig {path}: {exc.strerror or exc}") from None
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise CredentialsError(f"kubeconfig {path} is not valid YAML: {exc}") from None
        if not isinstance(doc, Mapping):
            raise CredentialsError(f"kubeconfig {path}: expected a mapping at the top level")
        docs.append((path, doc))
    if not docs:
        raise CredentialsError("no kubeconfig file given")
    return parse_kubeconfig(docs, context)


def parse_kubeconfig(
    docs: Sequence[tuple[Path, Mapping[str, Any]]], context: str | None = None
) -> ApiCredentials:
    """Pure: the credentials of ``context`` (else current-context) in these parsed kubeconfigs.

    Relative file paths resolve against the directory of the file that names them, as kubectl does.
    """
    named: dict[str, dict[str, tuple[Path, Mapping[str, Any]]]] = {
        "clusters": {},
        "users": {},
        "contexts": {},
    }
    current: str | None = None
    for path, doc in docs:
        current = current or _opt_str(doc, "current-context", path)
        for section, inner in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            entries = doc.get(section) or []
            if not isinstance(entries, list):
                raise CredentialsError(f"kubeconfig {path}: {section} must be a list")
            for i, entry in enumerate(entries):
                where = f"kubeconfig {path}: {section}[{i}]"
                if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                    raise CredentialsError(f"{where}: expected an entry with a name")
                body = entry.get(inner) or {}
                if not isinstance(body, Mapping):
                    raise CredentialsError(f"{where}.{inner}: expected a mapping")
                named[section].setdefault(entry["name"], (path, body))
    files = ", ".join(str(p) for p, _ in docs)
    context_name = context or current
    if not context_name:
        raise CredentialsError(
            f"kubeconfig {files} has no current-context; set one (kubectl config use-context)"
        )
    if context_name not in named["contexts"]:
        raise CredentialsError(f"kubeconfig {files} has no context {context_name!r}")
    ctx_path, ctx = named["contexts"][context_name]
    cluster_name = _opt_str(ctx, "cluster", ctx_path)
    user_name = _opt_str(ctx, "user", ctx_path)
    if not cluster_name or cluster_name not in named["clusters"]:
        raise CredentialsError(
            f"kubeconfig {files}: context {context_name!r} names no known cluster ({cluster_name!r})"
        )
    cluster_path, cluster = named["clusters"][cluster_name]
    server = _opt_str(cluster, "server", cluster_path)
    if not server or not server.startswith(("https://", "http://")):
        raise CredentialsError(
            f"kubeconfig {cluster_path}: cluster {cluster_name!r} needs a server URL (https://host:port), "
            f"got {server!r}"
        )
    if cluster.get("proxy-url"):
        raise CredentialsError(
            f"kubeconfig {cluster_path}: cluster {cluster_name!r}: proxy-url is not supported by the router"
        )
    user: Mapping[str, Any] = {}
    user_path = cluster_path
    if user_name:
        if user_name not in named["users"]:
            raise CredentialsError(
                f"kubeconfig {files}: context {context_name!r} names no known user ({user_name!r})"
            )
        user_path, user = named["users"][user_name]
    for unsupported, instead in (
        ("exec", "an exec credential plugin"),
        ("auth-provider", "an auth-provider plugin"),
    ):
        if user.get(unsupported):
            raise CredentialsError(
                f"kubeconfig {user_path}: user {user_name!r} uses {instead}, which the router does not run; "
                "give it a ServiceAccount token (token or tokenFile) or a client certificate"
            )
    if user.get("username") or user.get("password"):
        raise CredentialsError(
            f"kubeconfig {user_path}: user {user_name!r} uses basic auth (username/password), which API "
            "servers no longer accept; use a token or a client certificate"
        )
    client_cert = _pem(user, "client-certificate", user_path)
    client_key = _pem(user, "client-key", user_path)
    if (client_cert is None) != (client_key is None):
        raise CredentialsError(
            f"kubeconfig {user_path}: user {user_name!r} needs both client-certificate and client-key"
        )
    token_file = _opt_str(user, "tokenFile", user_path)
    return ApiCredentials(
        server=server.rstrip("/"),
        origin=f"kubeconfig {files} (context {context_name})",
        ca=_pem(cluster, "certificate-authority", cluster_path),
        insecure=cluster.get("insecure-skip-tls-verify") is True,
        tls_server_name=_opt_str(cluster, "tls-server-name", cluster_path),
        client_cert=client_cert,
        client_key=client_key,
        token=_opt_str(user, "token", user_path),
        token_file=_resolve(user_path, token_file) if token_file else None,
        namespace=_opt_str(ctx, "namespace", ctx_path),
    )


def _opt_str(doc: Mapping[str, Any], key: str, path: Path) -> str | None:
    value = doc.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise CredentialsError(f"kubeconfig {path}: {key} must be a string")
    return value


def _resolve(base: Path, name: str) -> Path:
    p = Path(name).expanduser()
    return p if p.is_absolute() else base.parent / p


def _pem(doc: Mapping[str, Any], key: str, path: Path) -> PemSource | None:
    data = _opt_str(doc, f"{key}-data", path)
    if data is not None:
        try:
            return PemSource(data=base64.b64decode(data, validate=True))
        except ValueError:
            raise CredentialsError(f"kubeconfig {path}: {key}-data is not valid base64") from None
    name = _opt_str(doc, key, path)
    return PemSource(path=_resolve(path, name)) if name else None


def kubeconfig_paths(value: str) -> list[Path]:
    """KUBECONFIG's list (``:``-separated); missing files are skipped as kubectl does, unless all are."""
    paths = [Path(p).expanduser() for p in value.split(os.pathsep) if p]
    existing = [p for p in paths if p.exists()]
    return existing or paths


def token_kubeconfig(
    server: str, ca_pem: bytes, token: str, namespace: str, name: str = "router"
) -> dict[str, Any]:
    """A minimal kubeconfig for a bearer token (what a router outside the cluster is given)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
        "current-context": name,
    }


# --- which ConfigMap ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigMapRef:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def parse_configmap_ref(value: str, default_namespace: Callable[[], str | None]) -> ConfigMapRef:
    """``NAMESPACE/NAME`` or ``NAME`` (namespace from ``default_namespace()``), validated."""
    namespace, sep, name = value.strip().rpartition("/")
    if not sep:
        namespace = default_namespace() or ""
        if not namespace:
            raise CredentialsError(
                f"--routing-configmap {value!r} gives no namespace and none is known: write NAMESPACE/NAME, "
                "or set POD_NAMESPACE (the downward API's metadata.namespace)"
            )
    if not DNS_LABEL.match(namespace):
        raise CredentialsError(f"--routing-configmap {value!r}: {namespace!r} is not a valid namespace name")
    if not DNS_SUBDOMAIN.match(name):
        raise CredentialsError(
            f"--routing-configmap {value!r}: {name!r} is not a valid ConfigMap name "
            "(lower-case letters, digits, '-' and '.')"
        )
    return ConfigMapRef(namespace, name)


def default_namespace(
    env: Mapping[str, str], sa_dir: Path = SERVICE_ACCOUNT_DIR, creds: ApiCredentials | None = None
) -> str | None:
    """POD_NAMESPACE, else the service account's namespace file, else the kubeconfig context's."""
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    namespace_file = sa_dir / "namespace"
    try:
        found = namespace_file.read_text().strip()
    except OSError:
        found = ""
    return found or (creds.namespace if creds else None)
