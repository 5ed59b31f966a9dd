"""Rendering, pure: a PDDeployment's Kubernetes objects as dicts (pods, groups, Services, the
router; the decode and client sidecars; keys and pod defaults), and the routing table built
from the instances observed.
"""
