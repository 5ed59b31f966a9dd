"""`make e2e-vllm`: real vLLM (the CPU build) behind `pdserve up`, and the fixtures recorded from it.

Opt-in, never part of `make test`: it installs several GB into a cached virtualenv. What it
checks and how to run it: docs/testing.md, "Real vLLM (make e2e-vllm)". Modules named
``vllm_*.py`` and ``make_model.py`` run with the vLLM virtualenv's interpreter; the rest run
with pdserve's.
"""
