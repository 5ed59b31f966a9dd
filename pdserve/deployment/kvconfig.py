"""vLLM's ``--kv-transfer-config`` per connector, and the MoRIIO KV address in the routing table.

Field names and semantics follow vLLM's connectors
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`` and ``.../moriio/``):

* NixlConnector: ``kv_role`` kv_producer (prefill) / kv_consumer (decode). vLLM 0.32 warns that
  ``kv_both`` with NixlConnector is deprecated and will be removed. Older images need no
  ``kv_both`` choice: ``KVTransferConfig`` has accepted all three roles since connectors exist,
  and NixlConnector before 0.32 never read the role (which side sends is decided per request by
  ``kv_transfer_params``); 0.32 reads it only for prefill context parallelism, which pdserve does
  not render. The side channel is advertised at ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (set to the pod
  IP by the renderer).
* MoRIIOConnector: ``kv_role`` kv_producer (prefill) / kv_consumer (decode); vLLM sets its
  producer/consumer role from it. Its ``kv_connector_extra_config`` must carry
  ``handshake_port``, ``notify_port``, ``http_port``, ``proxy_ip`` and ``proxy_ping_port``
  (read with ``[]``), and ``read_mode`` selects READ (true) or WRITE (false). ``proxy_ip`` is
  left empty: vLLM then starts no discovery heartbeat, because pdserve's router learns
  instances from the routing table, not from pings. The router puts each instance's
  ``host:<ip>,handshake:<port>,notify:<port>`` address (the format vLLM parses from the
  request id) into the request id; ``notify`` is the base port, vLLM adds the rank offset.

``kvTransfer.extraConfig`` is merged last, so a user can set any documented key (for example
MoRIIO's ``backend`` or ``qp_per_transfer``); validate.py refuses values that would
contradict the spec (``read_mode`` against ``transferMode``, ports that are not ports).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.deployment.spec.pddeployment import ENGINE_PORT, KVTransferSpec
from pdserve.routing import Role

#: vLLM's MoRIIOConstants.DEFAULT_HANDSHAKE_PORT / DEFAULT_NOTIFY_PORT.
MORIIO_HANDSHAKE_PORT = 6301
MORIIO_NOTIFY_PORT = 61005
#: Must parse as an int in vLLM even though no heartbeat is sent (``proxy_ip`` is empty).
MORIIO_PROXY_PING_PORT = 36367

NIXL = "NixlConnector"
MORIIO = "MoRIIOConnector"


def kv_role(kv: KVTransferSpec, role: Role) -> str:
    """The same for every connector pdserve renders: the prefill produces KV, the decode consumes it."""
    return "kv_producer" if role is Role.PREFILL else "kv_consumer"


def kv_transfer_config(kv: KVTransferSpec, role: Role) -> dict[str, Any]:
    """The value of ``vllm serve --kv-transfer-config`` for an instance of ``role``."""
    config: dict[str, Any] = {"kv_connector": kv.connector, "kv_role": kv_role(kv, role)}
    extra: dict[str, Any] = {}
    if kv.connector == MORIIO:
        extra = {
            "handshake_port": MORIIO_HANDSHAKE_PORT,
            "notify_port": MORIIO_NOTIFY_PORT,
            "http_port": ENGINE_PORT,
            "proxy_ip": "",
            "proxy_ping_port": MORIIO_PROXY_PING_PORT,
            "read_mode": kv.transfer_mode == "READ",
        }
    extra.update(kv.extra_config)
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def kv_transfer_config_json(kv: KVTransferSpec, role: Role) -> str:
    """Compact, key-ordered JSON: equal specs give byte-equal pod args (and template hashes)."""
    return json.dumps(kv_transfer_config(kv, role), separators=(",", ":"))


def moriio_ports(kv: KVTransferSpec) -> tuple[int, int]:
    """(handshake, notify) base ports in effect, after ``extraConfig`` overrides."""
    extra = kv.extra_config
    return (
        int(extra.get("handshake_port") or MORIIO_HANDSHAKE_PORT),
        int(extra.get("notify_port") or MORIIO_NOTIFY_PORT),
    )


def kv_address(kv: KVTransferSpec, host: str) -> str | None:
    """The routing table's ``kvAddress`` of an instance at ``host``; None for NIXL (not needed)."""
    if kv.connector != MORIIO:
        return None
    handshake, notify = moriio_ports(kv)
    return f"host:{host},handshake:{handshake},notify:{notify}"
