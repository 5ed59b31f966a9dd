"""PDDeployment: typed spec and parser, validation, pure manifest rendering, routing-table building.

The functional core shared by the operator (pdserve.operator) and the local mode (pdserve.local):
``spec`` (parse), ``validate`` (rules beyond the CRD schema), ``objects`` (manifests as dicts),
``routing`` (observed instances → routing table), ``kvconfig`` (vLLM's --kv-transfer-config).
"""
