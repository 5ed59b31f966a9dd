"""What each pod of a multi-node instance (a group) runs: its engine flags, and the LWS wrapper.

Pure and below :mod:`pdserve.deployment.render.engine_pod` and :mod:`pdserve.deployment.render.groups`,
which render the pods (:func:`~pdserve.deployment.render.groups.group_pods`,
:func:`~pdserve.deployment.render.groups.instance_lws`).
The flags follow vLLM 0.32 (spec/multinode.py cites the source):

* data parallelism over nodes (a rank fits a node), every node::

      --data-parallel-size N --data-parallel-size-local L --data-parallel-address A
      --data-parallel-rpc-port P

  ``apiServers: perNode`` adds ``--data-parallel-start-rank k --data-parallel-hybrid-lb`` on every
  node (each runs an API server for its ranks k..k+L-1). ``leader`` gives node >= 1
  ``--headless --data-parallel-start-rank k`` and the leader no start rank (vLLM would switch a
  non-headless node with a start rank to hybrid LB).
* a rank spanning nodes (multi-node TP/PP): ``--nnodes n --node-rank r --master-addr A
  --master-port P``, and ``--headless`` on node >= 1.

``A`` is the leader's address: on the leader its own pod IP, on the workers
``$(PDSERVE_LEADER_ADDRESS)`` (pods backend: an env var holding the leader pod's IP, or its DNS
name in the engines' headless Service) or ``$(LWS_LEADER_ADDRESS)`` (set by the LWS controller).
The simulator gets the same flags (``--dp-size`` is its ``--data-parallel-size``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from pdserve.deployment.spec.multinode import API_PER_NODE, GroupShape

#: Env var of a pods-backend worker holding its leader's address (the operator sets the leader's IP).
LEADER_ADDRESS_ENV = "PDSERVE_LEADER_ADDRESS"
#: Env vars the LWS controller sets in every pod of a group.
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
#: Labels the LWS controller puts on the pods of a group: the set, and the pod's node rank.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
#: A failed pod of a group takes the whole group down and up again (vLLM cannot lose a member).
LWS_RESTART_POLICY = "RecreateGroupOnPodRestart"

#: Flags of the group pdserve sets (validate.py refuses them in a role's args).
GROUP_FLAGS = (
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-address",
    "-dpa",
    "--data-parallel-rpc-port",
    "-dpp",
    "--data-parallel-hybrid-lb",
    "-dph",
    "--headless",
    "--nnodes",
    "-n",
    "--node-rank",
    "-r",
    "--master-addr",
    "--master-port",
)


@dataclass(frozen=True)
class GroupMember:
    """One pod of a group: its node index, and how its args name the leader's address.

    ``start_rank`` overrides the rendered ``first_rank(node)`` with an expression (an LWS worker
    template serves every worker, so its start rank is computed by the shell from its index).
    """

    shape: GroupShape
    node: int
    rpc_port: int
    leader_address: str  # an address or a $(VAR) reference
    start_rank: str | None = None
    node_rank: str | None = None

    @property
    def headless(self) -> bool:
        return not self.shape.serves_api(self.node)

    @property
    def dp_local(self) -> int:
        """DP ranks whose engines run in this pod (1 when a rank spans nodes)."""
        return self.shape.dp_local


def group_flags(member: GroupMember) -> list[str]:
    """The flags after ``--data-parallel-size``/``--tensor-parallel-size`` for this pod."""
    shape, node = member.shape, member.node
    if not shape.multi_node:
        return []
    if shape.spans_rank:
        flags = [
            "--nnodes",
            str(shape.nodes),
            "--node-rank",
            member.node_rank or str(node),
            "--master-addr",
            member.leader_address,
            "--master-port",
            str(member.rpc_port),
        ]
        return [*flags, "--headless"] if node > 0 else flags
    flags = ["--data-parallel-size-local", str(shape.dp_local)]
    start = member.start_rank or str(shape.first_rank(node))
    if shape.api_servers == API_PER_NODE or node > 0:
        flags += ["--data-parallel-start-rank", start]
    flags += ["--data-parallel-address", member.leader_address]
    flags += ["--data-parallel-rpc-port", str(member.rpc_port)]
    if shape.api_servers == API_PER_NODE:
        flags.append("--data-parallel-hybrid-lb")
    elif node > 0:
        flags.append("--headless")
    return flags


def shell_command(command: list[str], args: list[str]) -> tuple[list[str], list[str]]:
    """``command args`` run by ``sh -c`` so ``$$((...))`` arithmetic in args is evaluated.

    Kubernetes expands ``$(VAR)`` first (``$$`` escapes to ``$``), then the shell computes the
    arithmetic; every other word is quoted so it reaches the engine unchanged.
    """
    words = [_word(w) for w in [*command, *args]]
    return ["/bin/sh", "-c"], ["exec " + " ".join(words)]


def _word(word: str) -> str:
    if word.startswith("$$((") and word.endswith("))"):
        return f'"{word}"'
    return shlex.quote(word)


def lws_object(
    metadata: dict[str, Any],
    size: int,
    leader: dict[str, Any],
    worker: dict[str, Any],
) -> dict[str, Any]:
    """A LeaderWorkerSet of one group from its leader and worker pod templates ({metadata, spec})."""
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": LWS_RESTART_POLICY,
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
