"""The operator (``pdserve operator``): keeps every PDDeployment's pods, router and routing table in step.

Its parts, lowest first: ``metrics``; ``cluster/`` (the API client, the watch-fed caches, pods read
as the planner's inputs); ``dataplane/`` (what a pass asks the routers and engines over HTTP);
``reconcile/`` (one pass: read, plan, write, autoscale, and its record as spans); ``control/``
(kopf's watches, the coalescing controller, leader election); ``cli`` on top.
"""
