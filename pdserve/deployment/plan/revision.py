"""The pairing revision: a hash of what a prefill and a decode must agree on to exchange KV.

A decode can use a prefill's KV only when both run the same weights and tokenizer (the decode
re-tokenizes the request and expects the handoff's ``remote_num_tokens`` to match), lay the KV
cache out the same way (dtype, block size, attention backend, KV layout), and speak the same
connector. During a rollout of any of these, old and new instances coexist; the routing table
carries each instance's revision and the router pairs a prefill only with decodes of its own.

What is hashed, per role (so a prefill and a decode that disagree get different revisions and
are never paired, rather than silently corrupting each other's KV):

* ``model``, ``servedModelName``, the engine image, ``engine``;
* ``kvTransfer``: connector, transfer mode, extra config (not ``kv_role``, which differs by
  role by design);
* the role's ``args`` among :data:`KV_FLAGS` (weights, tokenizer, KV layout), in either
  ``--flag value`` or ``--flag=value`` form, order-independent;
* the role's ``env`` among :data:`KV_ENV`;
* both roles' ``--block-size``, as a pair and in both revisions: NIXL pairs a prefill whose block
  size divides the decode's (spec/vllm_compat.py checks the pair), so the sizes need not be equal, but
  a change of either is a change of what the two sides agree on and rolls them as one.

Everything else (DP/TP sizes, scheduling flags such as ``--max-num-seqs``, resources) may
differ between prefill and decode and between revisions of one role: NIXL handles
heterogeneous TP, and DP only multiplies slots.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from pdserve.deployment.spec.pddeployment import PDDeployment
from pdserve.kv.base import last_value
from pdserve.routing import Role

#: vLLM flags whose value must be equal on both sides of a KV handoff.
KV_FLAGS = frozenset(
    {
        # weights and their numerics
        "--revision",
        "--code-revision",
        "--dtype",
        "--quantization",
        "-q",
        "--hf-overrides",
        "--hf-config-path",
        "--trust-remote-code",
        # tokenization: the decode re-tokenizes the prompt the prefill computed
        "--tokenizer",
        "--tokenizer-mode",
        "--tokenizer-revision",
        "--chat-template",
        # the KV cache's layout
        "--kv-cache-dtype",
        "--calculate-kv-scales",
        "--attention-backend",
        "--mamba-ssm-cache-dtype",
    }
)
#: Environment variables that change the KV layout (vLLM reads them at start-up).
KV_ENV = frozenset({"VLLM_KV_CACHE_LAYOUT", "VLLM_ATTENTION_BACKEND"})

#: KV-layout flags that may differ between the roles within a rule: hashed as a pair.
PAIR_FLAGS = ("--block-size",)

REVISION_LENGTH = 12


def pairing_revision(pdd: PDDeployment, role: Role) -> str:
    """The revision an instance of ``role`` rendered from ``pdd`` runs (12 hex characters)."""
    spec = pdd.spec
    rs = spec.role(role)
    kv = spec.kv_transfer
    factors: dict[str, object] = {
        "model": spec.model,
        "servedModelName": spec.served_model_name,
        "image": spec.engine_image,
        "engine": spec.engine,
        "kvTransfer": {
            "connector": kv.connector,
            "transferMode": kv.transfer_mode,
            "extraConfig": dict(kv.extra_config),
        },
        "args": kv_args(rs.args),
        "env": sorted(
            (str(e.get("name")), json.dumps(e, sort_keys=True)) for e in rs.env if e.get("name") in KV_ENV
        ),
    }
    pairs = {
        flag: [last_value(spec.role(r).args, flag) for r in (Role.PREFILL, Role.DECODE)]
        for flag in PAIR_FLAGS
    }
    factors.update({flag: pair for flag, pair in pairs.items() if pair != [None, None]})
    text = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:REVISION_LENGTH]


def kv_args(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """The (flag, value) pairs of ``argv`` among :data:`KV_FLAGS`, sorted; value None for a bare flag."""
    found: list[tuple[str, str | None]] = []
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag not in KV_FLAGS:
            continue
        if sep:
            found.append((flag, value))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            found.append((flag, argv[i + 1]))
        else:
            found.append((flag, None))
    return sorted(found, key=lambda pair: (pair[0], pair[1] or ""))
