"""vLLM compatibility rules: what vLLM accepts between a prefill and a decode (engine ``vllm``).

Each :class:`~pdserve.kv.base.Rule` is read from the vLLM version pdserve targets (0.32) and names
its source; the rules of one connector live in its module (pdserve.kv), the ones every connector
shares here, with each connector's source.
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

from pdserve import kv
from pdserve.deployment.spec.pddeployment import PDDeploymentSpec, RoleSpec
from pdserve.kv.base import Pair, Rule, Side

__all__ = ["RULES", "Rule", "problems"]

TP_RATIO = Rule(
    "tp-ratio",
    "prefill.tensorParallel, decode.tensorParallel",
    "the larger tensorParallel is a multiple of the smaller (either role may be larger)",
    "; ".join(kv.rule_sources("tp-ratio")),
    "prefill.tensorParallel and decode.tensorParallel: the larger must be a multiple of the smaller "
    "(vLLM maps KV between TP ranks by their ratio)",
    cel=True,
)
SAME_FLAGS = Rule(
    "same-cache-dtype",
    "prefill.args, decode.args: --kv-cache-dtype, --dtype",
    "both roles run the same --kv-cache-dtype and --dtype (unset counts as auto)",
    "; ".join(kv.rule_sources("same-cache-dtype")),
)
#: Every rule, in the order docs/reference.md lists them: the shared ones around each
#: connector's own (checked only for the connector the spec names).
RULES = (TP_RATIO, *(r.rule for c in kv.CONNECTORS for r in c.render.rules), SAME_FLAGS)

#: Flags whose values must agree between prefill and decode (vLLM's default when unset).
MATCHING_FLAGS = (("--kv-cache-dtype", "auto"), ("--dtype", "auto"))


def problems(spec: PDDeploymentSpec) -> list[str]:
    if spec.engine != "vllm":
        return []
    p, d = _side(spec.prefill), _side(spec.decode)
    found = []
    big, small = max(p.tensor_parallel, d.tensor_parallel), min(p.tensor_parallel, d.tensor_parallel)
    if big % small:
        found.append(f"spec.{TP_RATIO.message}")
    pair = Pair(p, d, spec.gpu_resource)
    found += [message for rule in spec.kv_transfer.kv.render.rules for message in rule.problems(pair)]
    for flag, default in MATCHING_FLAGS:
        pv, dv = p.flag(flag) or default, d.flag(flag) or default
        if pv != dv:
            found.append(
                f"spec.prefill.args, spec.decode.args: {flag} is {pv} on prefill and {dv} on decode; "
                f"set the same on both (vLLM's KV handshake refuses a mismatch)"
            )
    return found


def _side(rs: RoleSpec) -> Side:
    return Side(rs.data_parallel, rs.tensor_parallel, tuple(rs.args))
