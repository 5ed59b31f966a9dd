"""``pdserve bench``: load generators that measure a deployment from the outside, as a client does.

A client of any OpenAI-compatible server (pdserve's router, vLLM, another router): it speaks
HTTP and reads ``/metrics``, and imports nothing of the router, operator or local mode. Pure
parts (trace, prompts, schedule, results, cache model) are plain functions over dataclasses;
``client.py`` and ``engines.py`` hold the HTTP, ``report.py`` the files.
"""
