"""HTTP header names of vLLM's P/D protocol, and pdserve's own."""

DP_RANK = "X-data-parallel-rank"
REQUEST_ID = "X-Request-Id"
AUTHORIZATION = "Authorization"
#: The router's reason for an error it answered itself (no_decode_slot, bad_kv_handoff, ...).
ERROR_REASON = "X-PDServe-Error"
#: ``pdserve up`` with placement decode-sidecar: the decode instance whose sidecar served the request.
SIDECAR = "X-PDServe-Sidecar"
