"""vLLM compatibility rules: what vLLM accepts between a prefill and a decode (engine ``vllm``).

Each :class:`Rule` is read from the vLLM version pdserve targets (0.32) and names its source.
Rules a CEL expression can state are in the CRD too, with exactly :attr:`Rule.message` as the
CEL message (tests/unit/test_vllm_compat.py compares them), so ``kubectl apply`` refuses them;
:func:`problems` checks every rule for the operator (``Degraded``, reason ``InvalidSpec``, and a
Warning Event) and for ``pdserve render``, as ``spec.<message>`` for the CEL ones. Rules on
engine flags in ``args`` (block size, dtypes) are checked here only: CEL does not parse flags.
docs/reference.md lists them all (docgen renders :data:`RULES`).

Earlier vLLM releases were stricter (a NIXL decode TP larger than the prefill's was refused
before heterogeneous TP landed): check the version an image carries before relying on these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.deployment.spec.pddeployment import PDDeploymentSpec, RoleSpec

NIXL = "NixlConnector"
MORIIO = "MoRIIOConnector"


@dataclass(frozen=True)
class Rule:
    id: str
    where: str  # the fields, relative to spec
    rule: str  # in words
    source: str  # the vLLM source it comes from
    message: str = ""  # CEL rules: the CEL message, and the operator's after "spec."
    cel: bool = False

    @property
    def enforced_by(self) -> str:
        return "API server (CEL), operator, pdserve render" if self.cel else "operator, pdserve render"


TP_RATIO = Rule(
    "tp-ratio",
    "prefill.tensorParallel, decode.tensorParallel",
    "the larger tensorParallel is a multiple of the smaller (either role may be larger)",
    "vllm/distributed/kv_transfer/kv_connector/utils.py TpKVTopology.tp_ratio (NIXL: asserts "
    "divisibility at the first transfer); kv_connector/v1/moriio/moriio_connector.py "
    "get_moriio_remote_tp_rank (MoRIIO: raises ValueError)",
    "prefill.tensorParallel and decode.tensorParallel: the larger must be a multiple of the smaller "
    "(vLLM maps KV between TP ranks by their ratio)",
    cel=True,
)
MORIIO_AMD = Rule(
    "moriio-amd",
    "kvTransfer.connector, gpuResource",
    "MoRIIOConnector only with gpuResource amd.com/gpu",
    "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py (imports mori.io, AMD's "
    "MoRI on ROCm; CUDA builds have no MoRI)",
    "kvTransfer.connector: MoRIIOConnector moves KV between AMD GPUs (ROCm): set gpuResource to "
    "amd.com/gpu, or use NixlConnector",
    cel=True,
)
MORIIO_DP_TP = Rule(
    "moriio-dp-and-tp",
    "prefill/decode dataParallel, tensorParallel",
    "with MoRIIOConnector, no instance has both dataParallel > 1 and tensorParallel > 1",
    "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_common.py MoRIIOConfig.from_vllm_config: "
    "notify_port = base + get_port_offset(dp_rank, tp_rank) without tp_size, so ranks (0,1) and (1,0) "
    "bind the same port",
    "prefill and decode: with MoRIIOConnector an instance cannot have both dataParallel > 1 and "
    "tensorParallel > 1 (vLLM gives those ranks colliding notify ports)",
    cel=True,
)
BLOCK_SIZE = Rule(
    "block-size",
    "prefill.args --block-size, decode.args --block-size",
    "NixlConnector: when both roles set --block-size, the prefill's is at most the decode's and divides it",
    "vllm/distributed/kv_transfer/kv_connector/utils.py block_size_ratio; "
    "docs/features/nixl_connector_compatibility.md (only P block size < D block size)",
)
SAME_FLAGS = Rule(
    "same-cache-dtype",
    "prefill.args, decode.args: --kv-cache-dtype, --dtype",
    "both roles run the same --kv-cache-dtype and --dtype (unset counts as auto)",
    "docs/features/nixl_connector_compatibility.md, 'What must match between P and D' (the handshake's "
    "compatibility hash covers dtype and cache_dtype); MoRIIO copies raw KV blocks",
)
#: Every rule, in the order docs/reference.md lists them.
RULES = (TP_RATIO, MORIIO_AMD, MORIIO_DP_TP, BLOCK_SIZE, SAME_FLAGS)

#: Flags whose values must agree between prefill and decode (vLLM's default when unset).
MATCHING_FLAGS = (("--kv-cache-dtype", "auto"), ("--dtype", "auto"))


def problems(spec: PDDeploymentSpec) -> list[str]:
    if spec.engine != "vllm":
        return []
    connector = spec.kv_transfer.connector
    p, d = spec.prefill, spec.decode
    found = []
    big, small = max(p.tensor_parallel, d.tensor_parallel), min(p.tensor_parallel, d.tensor_parallel)
    if big % small:
        found.append(f"spec.{TP_RATIO.message}")
    if connector == MORIIO and spec.gpu_resource != "amd.com/gpu":
        found.append(f"spec.{MORIIO_AMD.message}")
    if connector == MORIIO and any(r.data_parallel > 1 and r.tensor_parallel > 1 for r in (p, d)):
        found.append(f"spec.{MORIIO_DP_TP.message}")
    if connector == NIXL:
        found += _block_sizes(p, d)
    for flag, default in MATCHING_FLAGS:
        pv, dv = last_value(p.args, flag) or default, last_value(d.args, flag) or default
        if pv != dv:
            found.append(
                f"spec.prefill.args, spec.decode.args: {flag} is {pv} on prefill and {dv} on decode; "
                f"set the same on both (vLLM's KV handshake refuses a mismatch)"
            )
    return found


def _block_sizes(prefill: RoleSpec, decode: RoleSpec) -> list[str]:
    p, d = last_value(prefill.args, "--block-size"), last_value(decode.args, "--block-size")
    if p is None or d is None or not (p.isdigit() and d.isdigit()) or int(p) == 0:
        return []
    if int(p) <= int(d) and int(d) % int(p) == 0:
        return []
    return [
        f"spec.prefill.args, spec.decode.args: --block-size {p} on prefill and {d} on decode; with "
        "NixlConnector the prefill's block size must be at most the decode's and divide it"
    ]


def last_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` (``--flag v`` or ``--flag=v``), as vLLM's parser keeps the last."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
