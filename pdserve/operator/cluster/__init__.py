"""The API server as the operator reaches it (kube) and sees it: watch-fed caches, pods as views."""
