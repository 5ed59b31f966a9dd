"""Volumes of a runner pod: host directories that each container bind-mounts in its own mount namespace.

ConfigMap, Secret, downwardAPI and projected volumes are written the kubelet's way (files under
``..<timestamp>/``, a ``..data`` symlink swapped atomically, top-level symlinks into it), so a
directory mount sees updates and a process watching the file sees one rename. They are rewritten
when their content changes (the pod worker calls :func:`refresh` every few seconds).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .spec import ConfigError, field_value, resource_value

CONTENT_KINDS = ("configMap", "secret", "downwardAPI", "projected")
SHM_ROOT = Path("/dev/shm/pdserve-runner")


class Source(Protocol):
    """What volumes read from the API (pods.Kube implements it)."""

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None: ...
    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None: ...
    def token(self, pod: Mapping[str, Any], audience: str | None, seconds: int) -> str: ...


@dataclass
class PodVolumes:
    pod: Mapping[str, Any]
    root: Path  # .cluster/runner/pods/<uid>
    pod_ip: str
    host_ip: str
    allocatable: Mapping[str, str]
    paths: dict[str, Path] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    tokens: dict[tuple[str | None, int], tuple[str, float]] = field(default_factory=dict)

    def setup(self, source: Source) -> None:
        """Create every volume; raises ConfigError (the kubelet's FailedMount) to be retried."""
        uid = self.pod["metadata"]["uid"]
        for volume in self.pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "emptyDir" in volume:
                medium = (volume["emptyDir"] or {}).get("medium")
                base = SHM_ROOT / uid if medium == "Memory" else self.root / "volumes"
                path = base / name
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o777)
                self.paths[name] = path
            elif "hostPath" in volume:
                self.paths[name] = _host_path(volume["hostPath"], name)
        self.refresh(source)

    def refresh(self, source: Source) -> None:
        for volume in self.pod["spec"].get("volumes") or []:
            kind = next((k for k in CONTENT_KINDS if k in volume), None)
            if kind is None:
                continue
            files = self._files(volume, kind, source)
            if files is None:
                continue
            digest = hashlib.sha256(
                repr(sorted((k, v[0], v[1]) for k, v in files.items())).encode()
            ).hexdigest()
            path = self.root / "volumes" / volume["name"]
            if self.digests.get(volume["name"]) != digest:
                write_atomic(path, files)
                self.digests[volume["name"]] = digest
            self.paths[volume["name"]] = path

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(SHM_ROOT / self.pod["metadata"]["uid"], ignore_errors=True)

    # ------------------------------------------------------------------ file contents

    def _files(
        self, volume: Mapping[str, Any], kind: str, source: Source
    ) -> dict[str, tuple[bytes, int]] | None:
        spec = volume[kind] or {}
        mode = int(spec.get("defaultMode", 0o644))
        if kind == "projected":
            files: dict[str, tuple[bytes, int]] = {}
            for src in spec.get("sources") or []:
                skind = next(iter(src))
                files.update(self._projection(skind, src[skind] or {}, mode, source))
            return files
        return self._projection(kind, spec, mode, source)

    def _projection(
        self, kind: str, spec: Mapping[str, Any], mode: int, source: Source
    ) -> dict[str, tuple[bytes, int]]:
        ns = self.pod["metadata"]["namespace"]
        if kind in ("configMap", "secret"):
            name = str(spec.get("name") if kind == "configMap" else spec.get("secretName", spec.get("name")))
            data = source.config_map(ns, name) if kind == "configMap" else source.secret(ns, name)
            if data is None:
                if spec.get("optional"):
                    return {}
                raise ConfigError(f'{kind.lower()} "{name}" not found')
            items = spec.get("items")
            if not items:
                return {key: (value, mode) for key, value in data.items()}
            out = {}
            for item in items:
                if item["key"] not in data:
                    if spec.get("optional"):
                        continue
                    raise ConfigError(f'{kind.lower()} "{name}": key {item["key"]} not found')
                out[item["path"]] = (data[item["key"]], int(item.get("mode", mode)))
            return out
        if kind == "downwardAPI":
            out = {}
            for item in spec.get("items") or []:
                if "fieldRef" in item:
                    value = field_value(self.pod, item["fieldRef"]["fieldPath"], self.pod_ip, self.host_ip)
                else:
                    ref = item["resourceFieldRef"]
                    container = next(
                        c for c in self.pod["spec"]["containers"] if c["name"] == ref["containerName"]
                    )
                    value = resource_value(container, ref["resource"], ref.get("divisor"), self.allocatable)
                out[item["path"]] = (value.encode(), int(item.get("mode", mode)))
            return out
        if kind == "serviceAccountToken":
            audience = spec.get("audience") or None
            seconds = int(spec.get("expirationSeconds", 3600))
            cached = self.tokens.get((audience, seconds))
            if cached is None or time.time() > cached[1]:
                token = source.token(self.pod, audience, seconds)
                cached = (token, time.time() + 0.8 * seconds)
                self.tokens[(audience, seconds)] = cached
            return {spec["path"]: (cached[0].encode(), mode)}
        raise ConfigError(f"unsupported projection {kind}")


def _host_path(spec: Mapping[str, Any], name: str) -> Path:
    path = Path(spec["path"])
    kind = spec.get("type") or ""
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    elif kind == "Directory" and not path.is_dir():
        raise ConfigError(f"hostPath volume {name}: {path} is not a directory")
    elif kind == "File" and not path.is_file():
        raise ConfigError(f"hostPath volume {name}: {path} is not a file")
    elif kind in ("Socket", "CharDevice", "BlockDevice") and not path.exists():
        raise ConfigError(f"hostPath volume {name}: {path} does not exist")
    return path


def write_atomic(directory: Path, files: Mapping[str, tuple[bytes, int]]) -> None:
    """The kubelet's AtomicWriter, simplified: new ``..<ts>`` dir, swap ``..data``, fix symlinks."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{os.getpid()}{time.monotonic_ns()}"
    stamp.mkdir()
    for rel, (content, mode) in files.items():
        target = stamp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    data = directory / "..data"
    old = os.readlink(data) if data.is_symlink() else None
    tmp = directory / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(stamp.name)
    tmp.replace(data)
    top = {rel.split("/")[0] for rel in files}
    for entry in directory.iterdir():
        if entry.name.startswith(".."):
            continue
        if entry.name not in top:
            entry.unlink()
    for name in top:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    if old:
        shutil.rmtree(directory / old, ignore_errors=True)


def decode_data(obj: Mapping[str, Any], secret: bool) -> dict[str, bytes]:
    """ConfigMap data/binaryData or Secret data (base64) as bytes."""
    out: dict[str, bytes] = {}
    if secret:
        for key, value in (obj.get("data") or {}).items():
            out[key] = base64.b64decode(value)
        for key, value in (obj.get("stringData") or {}).items():
            out[key] = value.encode()
        return out
    for key, value in (obj.get("data") or {}).items():
        out[key] = value.encode()
    for key, value in (obj.get("binaryData") or {}).items():
        out[key] = base64.b64decode(value)
    return out
