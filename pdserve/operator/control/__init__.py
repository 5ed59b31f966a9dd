"""The control loop: kopf watches request reconciles, coalesced, serialized, run only by the leader."""
