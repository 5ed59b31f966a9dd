"""The routing table this router serves, and its two sources: a watched file, or the ConfigMap
through the API server (with the kubeconfig or service-account credentials that reach it).
"""
