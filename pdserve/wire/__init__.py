"""Wire formats that the proxy and the simulator both speak: OpenAI errors and requests, and the
header names (each connector's ``kv_transfer_params`` are its module's, pdserve.kv).

Depends on nothing else in pdserve.
"""
