"""Wire formats that the proxy and the simulator both speak: OpenAI errors and requests,
vLLM's P/D ``kv_transfer_params`` per connector, and the header names.

Depends on nothing else in pdserve.
"""
