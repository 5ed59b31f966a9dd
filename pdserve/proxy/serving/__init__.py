"""HTTP serving: the generation endpoints as plain ASGI (the hot path), the two ports, uvicorn or
Hypercorn, and the worker processes that serve one router (with the views they share).
"""
