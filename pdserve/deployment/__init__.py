"""PDDeployment: the spec, its rendering and rollout planning, pure.

The functional core shared by the operator (pdserve.operator) and the local mode (pdserve.local):
``spec/`` (the resource and its parser), ``plan/`` (rollout, drain, groups, revisions, status),
``render/`` (manifests as dicts, the routing table from observed instances), ``validate``
(the rules that need the rendered pods), and ``pdserve render`` (``cli``) and the reference
generator (``docgen``) on top. What a KV connector needs of a pod is its module's (pdserve.kv).
"""
