"""Every example parses with the operator's own parser and is the shape its file name says.

File names spell the RFC's shapes: ``2p-dp8ep-3d-dp8ep`` is two prefill instances of DP8 with
expert parallelism and three decode instances of the same; TP8 is one engine over 8 GPUs.
The connector comes from the folder. (Validity against the CRD on a real API server is
checked in tests/integration/test_chart_install.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdserve.deployment.spec.parse import load_manifest_file
from pdserve.deployment.spec.pddeployment import PDDeployment, RoleSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHAPES = ("1p-tp8-1d-tp8", "2p-tp8-1d-dp8ep", "2p-tp8-2d-tp8", "2p-dp8ep-3d-dp8ep", "2p-dp8ep-4d-tp8")
CONNECTORS = {
    "nixl": ("NixlConnector", None),
    "moriio-read": ("MoRIIOConnector", "READ"),
    "moriio-write": ("MoRIIOConnector", "WRITE"),
    "mooncake": ("MooncakeConnector", None),
}
SHAPE = re.compile(r"^(\d+)p-(tp8|dp8ep)-(\d+)d-(tp8|dp8ep)$")

ALL_EXAMPLES = sorted(EXAMPLES.rglob("*.yaml"))


def _load(path: Path) -> PDDeployment:
    return load_manifest_file(path)


def _check_role(role: RoleSpec, instances: int, kind: str) -> None:
    assert role.instances == instances
    if kind == "tp8":
        assert (role.data_parallel, role.tensor_parallel, role.expert_parallel) == (1, 8, False)
    else:
        assert (role.data_parallel, role.tensor_parallel, role.expert_parallel) == (8, 1, True)


def test_every_connector_has_the_five_shapes() -> None:
    for folder in CONNECTORS:
        names = sorted(p.stem for p in (EXAMPLES / folder).glob("*.yaml"))
        assert names == sorted(SHAPES), folder


@pytest.mark.parametrize("path", ALL_EXAMPLES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_parses(path: Path) -> None:
    pdd = _load(path)
    assert pdd.spec.prefill.instances >= 1
    assert pdd.spec.decode.instances >= 1


@pytest.mark.parametrize(
    ("folder", "shape"), [(f, s) for f in CONNECTORS for s in SHAPES], ids=lambda v: str(v)
)
def test_example_is_the_shape_its_name_says(folder: str, shape: str) -> None:
    pdd = _load(EXAMPLES / folder / f"{shape}.yaml")
    match = SHAPE.match(shape)
    assert match is not None
    prefill_count, prefill_kind, decode_count, decode_kind = match.groups()
    _check_role(pdd.spec.prefill, int(prefill_count), prefill_kind)
    _check_role(pdd.spec.decode, int(decode_count), decode_kind)
    connector, mode = CONNECTORS[folder]
    assert pdd.spec.kv_transfer.connector == connector
    assert pdd.spec.kv_transfer.transfer_mode == mode
    assert pdd.spec.engine == "vllm"
    assert pdd.spec.image, "GPU examples must name a vLLM image"


def test_example_names_are_unique() -> None:
    """Except an ``engine: sim`` variant (``NAME-sim.yaml``), which is its GPU twin's deployment."""
    names = [_load(p).name for p in ALL_EXAMPLES if not p.stem.endswith("-sim")]
    assert len(names) == len(set(names))
    for variant in (p for p in ALL_EXAMPLES if p.stem.endswith("-sim")):
        assert _load(variant).name == _load(variant.with_name(variant.stem[: -len("-sim")] + ".yaml")).name


def test_quickstart_runs_without_gpus() -> None:
    pdd = _load(EXAMPLES / "sim" / "quickstart.yaml")
    assert pdd.spec.engine == "sim"
    # Small enough for a laptop: a handful of simulator processes.
    assert pdd.spec.prefill.instances + pdd.spec.decode.instances <= 4


STORAGE = {
    "pvc-cache-gated-model": ("persistentVolumeClaim", True, False),
    "ephemeral-cache": ("ephemeral", False, False),
    "hostpath-cache": ("hostPath", False, False),
    "emptydir-cache": ("emptyDir", False, False),
    "pvc-model": (None, False, True),
    "local-path-model": (None, False, True),
}


@pytest.mark.parametrize("name", sorted(STORAGE))
def test_storage_examples_show_what_their_name_says(name: str) -> None:
    from pdserve.deployment.spec.storage import served_from_disk

    pdd = _load(EXAMPLES / "storage" / f"{name}.yaml")
    cache, token, on_disk = STORAGE[name]
    assert (pdd.spec.model_cache.kind if pdd.spec.model_cache else None) == cache
    assert (pdd.spec.hf_token_secret_ref is not None) == token
    assert served_from_disk(pdd.spec.model) == on_disk
    assert pdd.spec.engine == "vllm"


def test_every_storage_example_is_listed() -> None:
    assert sorted(p.stem for p in (EXAMPLES / "storage").glob("*.yaml")) == sorted(STORAGE)


def test_the_multi_node_example_is_the_deepseek_shape() -> None:
    from pdserve.routing import Role

    spec = _load(EXAMPLES / "multinode" / "deepseek-r1.yaml").spec
    assert spec.gpus_per_node == 8
    prefill, decode = spec.group_shape(Role.PREFILL), spec.group_shape(Role.DECODE)
    assert (spec.prefill.data_parallel, spec.prefill.expert_parallel, prefill.nodes, prefill.dp_local) == (
        16,
        True,
        2,
        8,
    )
    assert (spec.decode.data_parallel, decode.nodes, decode.dp_local) == (32, 4, 8)


# --- what a GPU example asks of a cluster, said in its header (issue 29) --------------------------

#: Hugging Face orgs whose models need an accepted license and a token.
GATED = ("meta-llama/",)


def _header(path: Path) -> str:
    """The comment lines before the manifest."""
    return path.read_text().split("\napiVersion:", 1)[0]


def _gpu_examples() -> list[Path]:
    from pdserve.wire import vllm

    return [
        p for p in ALL_EXAMPLES if _load(p).spec.engine == "vllm" and _load(p).spec.image != vllm.CPU_IMAGE
    ]


def test_the_scan_sees_the_gpu_examples() -> None:
    stems = {str(p.relative_to(EXAMPLES)) for p in _gpu_examples()}
    assert {"first/qwen3-8b.yaml", "nixl/1p-tp8-1d-tp8.yaml", "multinode/deepseek-r1.yaml"} <= stems
    assert "first/qwen3-8b-sim.yaml" not in stems and "cpu/nixl-1p-1d-dp2.yaml" not in stems


@pytest.mark.parametrize("path", _gpu_examples(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_a_gpu_example_caches_its_model_and_says_its_gpus_and_memory(path: Path) -> None:
    from pdserve.deployment.spec.storage import served_from_disk

    pdd = _load(path)
    assert pdd.spec.model_cache is not None or served_from_disk(pdd.spec.model), (
        f"{path.name}: set spec.modelCache (every pod downloads the weights again otherwise)"
    )
    header = _header(path)
    match = re.search(r"^# GPUs: (\d+)\b(.*(?:\n#  .*)*)", header, re.MULTILINE)
    assert match is not None, f"{path.name}: no '# GPUs: N ...' line in the header"
    total = sum(role.instances * role.gpus_per_instance for role in (pdd.spec.prefill, pdd.spec.decode))
    assert int(match.group(1)) == total, (
        f"{path.name}: the header says {match.group(1)} GPUs, the spec {total}"
    )
    assert re.search(r"\d+ GB", match.group(2)), f"{path.name}: the GPUs line says no memory"
    assert "Model cache:" in header and "Token:" in header


@pytest.mark.parametrize("path", ALL_EXAMPLES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_a_gated_model_needs_the_token_secret_and_says_so(path: Path) -> None:
    pdd = _load(path)
    gated = pdd.spec.model.startswith(GATED)
    if pdd.spec.engine != "vllm" or not gated:
        return
    ref = pdd.spec.hf_token_secret_ref
    assert ref is not None and (ref.name, ref.key) == ("hf-token", "token"), path.name
    assert "kubectl create secret generic hf-token --from-literal=token=hf_" in _header(path), path.name


def test_the_first_example_and_its_sim_variant_are_one_deployment() -> None:
    """README's cluster path on a cluster without GPUs: the same file but for engine and image."""
    gpu = yaml.safe_load((EXAMPLES / "first" / "qwen3-8b.yaml").read_text())
    sim = yaml.safe_load((EXAMPLES / "first" / "qwen3-8b-sim.yaml").read_text())
    assert sim["spec"].pop("engine") == "sim" and gpu["spec"].pop("engine") == "vllm"
    gpu["spec"].pop("image")
    assert sim == gpu
    spec = _load(EXAMPLES / "first" / "qwen3-8b.yaml").spec
    assert [(r.instances, r.gpus_per_instance) for r in (spec.prefill, spec.decode)] == [(1, 1), (1, 1)]
    assert spec.hf_token_secret_ref is None and not spec.model.startswith(GATED)


def test_the_rdma_example_gives_both_roles_the_hcas_and_ucx_settings() -> None:
    from pdserve.deployment.render.groups import render_all

    pdd = _load(EXAMPLES / "rdma" / "nixl-ib-1p-tp8-1d-tp8.yaml")
    pods = [o for o in render_all(pdd) if o["kind"] == "Pod"]
    assert {p["metadata"]["labels"]["pdserve.io/role"] for p in pods} == {"prefill", "decode"}
    for pod in pods:
        (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == "engine"]
        assert engine["resources"]["limits"]["rdma/ib"] == "8"
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["UCX_NET_DEVICES"].startswith("mlx5_0:1,") and "tcp" not in env["UCX_TLS"]
        assert [e["name"] for e in engine["env"]].count("UCX_TLS") == 1  # replaces pdserve's default
        assert "IPC_LOCK" in engine["securityContext"]["capabilities"]["add"]
