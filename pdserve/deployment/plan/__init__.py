"""Rollout planning, pure: the pairing revision, which pods to create, drain or delete now, when
a draining pod may go, multi-node groups as one unit, scheduling gates, and the status that
says where a deployment stands.
"""
