"""The pod runner's parts (hack/cluster/podrunner.py is its entry): ``spec`` (the pure kubelet
rules), ``volumes``, ``probes``, ``pod`` (one thread per pod), ``container_entry`` (a container's
entry: mounts, then exec) and ``kube`` (API calls, pid files).

A package beside the entry script: ``python hack/cluster/podrunner.py`` finds it on its own
directory, and tests import it as ``hack.cluster.runner``; nobody edits ``sys.path``.
"""
