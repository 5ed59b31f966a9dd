"""The simulator's step-based engine (``pdserve sim --profile``): vLLM V1's scheduler, KV block
pool and prefix cache per DP rank, timed by a performance profile. See docs/simulator.md.

Modules, ground up: ``profile`` (step and transfer costs), ``blocks`` (block pool, hash chain,
LRU free queue), ``request``, ``kvcache`` (per-request blocks, lookups), ``scheduler`` (one step,
a pure function of state and time), ``metrics``, ``loop`` (a rank in time), ``pull`` (the
decode's notice to the prefill), ``runtime`` (a process's ranks), ``flags`` (the CLI).
"""
