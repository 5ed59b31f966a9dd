"""HTTP header names of vLLM's P/D protocol."""

DP_RANK = "X-data-parallel-rank"
REQUEST_ID = "X-Request-Id"
AUTHORIZATION = "Authorization"
