"""Model storage and credentials of engine pods: the Hugging Face cache, ``pvc://`` models, HF_TOKEN.

* ``spec.modelCache`` is one volume source (an existing PVC, an ephemeral volume claim
  template, a hostPath or an emptyDir) mounted at :data:`HF_CACHE` in every engine pod, with
  ``HF_HOME`` pointing there. That is where the official ``vllm/vllm-openai`` image (which runs
  as root) keeps the cache: vLLM's Docker guide mounts ``~/.cache/huggingface`` at
  ``/root/.cache/huggingface``. Setting ``HF_HOME`` too makes the path hold for an image that
  runs as another user. A PVC or hostPath is shared by prefill and decode (one download); an
  ephemeral claim or an emptyDir is per pod.
* ``spec.hfTokenSecretRef`` becomes ``HF_TOKEN`` from a ``secretKeyRef``: the kubelet reads the
  Secret, pdserve never does, so the token never passes through the operator.
* ``spec.model: pvc://<claim>/<path>`` (KServe's convention) mounts the claim read-only at
  :data:`MODEL_MOUNT` and serves ``/mnt/models/<path>``; such a model, and a model given as an
  absolute path, is served with ``HF_HUB_OFFLINE=1``: nothing is downloaded, and a missing file
  fails at once instead of reaching out to the Hub.

Engine ``sim`` loads no model: it gets none of this (and its pods run anywhere).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployment.spec.owned import Reserved
from pdserve.deployment.spec.readers import (
    SecretKeyRef,
    SpecError,
    no_unknown,
    plain,
    read_boolean,
    read_object,
    read_string,
    show,
)

HF_CACHE = "/root/.cache/huggingface"
MODEL_MOUNT = "/mnt/models"
CACHE_VOLUME = "model-cache"
MODEL_VOLUME = "model-pvc"
PVC_SCHEME = "pvc://"
CACHE_KINDS = ("persistentVolumeClaim", "ephemeral", "hostPath", "emptyDir")

_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_PVC_MODEL = re.compile(r"^pvc://([a-z0-9]([-a-z0-9.]*[a-z0-9])?)(/(.*))?$")
_PARENT = re.compile(r"(^|/)\.\.(/|$)")


@dataclass(frozen=True)
class ModelCache:
    """One volume source, as Kubernetes spells it (``kind`` is its key in a Volume)."""

    kind: str
    source: Mapping[str, Any] = field(default_factory=dict)

    @property
    def shared(self) -> bool:
        """Whether prefill and decode pods see the same files (one download for all)."""
        return self.kind in ("persistentVolumeClaim", "hostPath")


@dataclass(frozen=True)
class PvcModel:
    claim: str
    path: str  # inside the claim, "" for its root

    @property
    def local_path(self) -> str:
        return f"{MODEL_MOUNT}/{self.path}" if self.path else MODEL_MOUNT


# --- parsing -----------------------------------------------------------------------------------


def parse_model(value: str, path: str) -> str:
    """The model as written; a ``pvc://`` one must name a claim and a path without ``..``."""
    if value.startswith(PVC_SCHEME) and (_PVC_MODEL.match(value) is None or _PARENT.search(value)):
        raise SpecError(
            path,
            f"expected pvc://<claim>/<path inside the claim> (a PVC name, no '..'), got {show(value)}",
        )
    return value


def pvc_model(model: str) -> PvcModel | None:
    match = _PVC_MODEL.match(model)
    if match is None:
        return None
    return PvcModel(match.group(1), (match.group(4) or "").strip("/"))


def parse_model_cache(value: object, path: str) -> ModelCache | None:
    if value is None:
        return None
    doc = read_object(value, path)
    no_unknown(doc, path, CACHE_KINDS)
    given = [k for k in CACHE_KINDS if doc.get(k) is not None]
    if len(given) != 1:
        raise SpecError(
            path,
            "set exactly one of persistentVolumeClaim, ephemeral, hostPath, emptyDir"
            + (f" (got {', '.join(given)})" if given else ""),
        )
    kind = given[0]
    here = f"{path}.{kind}"
    source = read_object(doc[kind], here)
    if kind == "persistentVolumeClaim":
        no_unknown(source, here, ("claimName", "readOnly"))
        claim = read_string(source, "claimName", here, required=True)
        if len(claim) > 253 or not _DNS_1123_SUBDOMAIN.match(claim):
            raise SpecError(f"{here}.claimName", f"expected a PersistentVolumeClaim name, got {show(claim)}")
        read_boolean(source, "readOnly", here, False)
    elif kind == "hostPath":
        no_unknown(source, here, ("path", "type"))
        where = read_string(source, "path", here, required=True)
        if not where.startswith("/"):
            raise SpecError(f"{here}.path", f"expected an absolute path on the node, got {show(where)}")
        read_string(source, "type", here)
    elif kind == "emptyDir":
        no_unknown(source, here, ("medium", "sizeLimit"))
        read_string(source, "medium", here)
    else:
        no_unknown(source, here, ("volumeClaimTemplate",))
        template = read_object(source.get("volumeClaimTemplate"), f"{here}.volumeClaimTemplate")
        read_object(template.get("spec"), f"{here}.volumeClaimTemplate.spec")
    return ModelCache(kind, plain(source, here))


# --- rendering ---------------------------------------------------------------------------------


def storage_volumes(model: str, cache: ModelCache | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if cache is not None:
        out.append({"name": CACHE_VOLUME, cache.kind: plain(cache.source, "modelCache")})
    pvc = pvc_model(model)
    if pvc is not None:
        out.append(
            {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": pvc.claim, "readOnly": True}}
        )
    return out


def storage_mounts(model: str, cache: ModelCache | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if cache is not None:
        read_only = bool(cache.source.get("readOnly")) if cache.kind == "persistentVolumeClaim" else False
        mount: dict[str, Any] = {"name": CACHE_VOLUME, "mountPath": HF_CACHE}
        if read_only:
            mount["readOnly"] = True
        out.append(mount)
    if pvc_model(model) is not None:
        out.append({"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True})
    return out


def storage_env(model: str, cache: ModelCache | None, hf_token: SecretKeyRef | None) -> list[dict[str, Any]]:
    """HF_HOME for the cache, HF_TOKEN from its Secret, HF_HUB_OFFLINE for a model on disk."""
    out: list[dict[str, Any]] = []
    if cache is not None:
        out.append({"name": "HF_HOME", "value": HF_CACHE})
    if hf_token is not None:
        out.append({"name": "HF_TOKEN", "valueFrom": hf_token.env_source()})
    if served_from_disk(model):
        out.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    return out


def served_from_disk(model: str) -> bool:
    return model.startswith("/") or pvc_model(model) is not None


def model_argument(model: str) -> str:
    """What ``vllm serve`` is given: the mounted path for a ``pvc://`` model, else the model itself."""
    pvc = pvc_model(model)
    return pvc.local_path if pvc is not None else model


def reserved(model: str, cache: ModelCache | None, hf_token: SecretKeyRef | None) -> Reserved:
    """The volumes, mount paths and variables that the fields above make pdserve's."""
    volumes, mounts, env = {}, {}, {}
    if cache is not None:
        volumes[CACHE_VOLUME] = "is pdserve's volume for spec.modelCache"
        mounts[HF_CACHE] = "is where pdserve mounts spec.modelCache (the Hugging Face cache)"
        env["HF_HOME"] = f"is set by pdserve to {HF_CACHE}, where spec.modelCache is mounted"
    if pvc_model(model) is not None:
        volumes[MODEL_VOLUME] = "is pdserve's volume for a pvc:// spec.model"
        mounts[MODEL_MOUNT] = "is where pdserve mounts a pvc:// spec.model"
    if hf_token is not None:
        env["HF_TOKEN"] = "is set by pdserve from spec.hfTokenSecretRef"
    return Reserved(volumes=volumes, mounts=mounts, env=env)
