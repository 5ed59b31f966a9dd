"""pdserve: Kubernetes-native prefill/decode disaggregated serving for vLLM."""

__version__ = "0.1.0"
