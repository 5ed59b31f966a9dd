"""The prefill engines' KV capacity, read from their metrics, to size the prefix index per slot.

vLLM publishes ``vllm:cache_config_info`` with its KV pool as labels (``num_gpu_blocks``,
``block_size``; one sample per engine core). A rank holds ``num_gpu_blocks x block_size`` tokens
of KV, and the prefix-affinity policy sizes each slot's index to about as much prompt text
(pdserve.proxy.policies.prefix_affinity.PrefixAffinity.engine_capacity). Each API server is
asked once, when its slots first appear in the table; one that does not answer (or publishes no
such metric) is asked again later and keeps the default size meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable

import aiohttp

from pdserve.proxy.policies import PrefixAffinity
from pdserve.proxy.table.served import ServedTable
from pdserve.routing import Slot

log = logging.getLogger("pdserve.proxy.prefix")

POLL_S = 2.0
RETRY_S = 30.0
FETCH_TIMEOUT_S = 5.0

_SAMPLE = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_tokens(metrics_text: str) -> int | None:
    """Tokens of KV per engine rank from a vLLM /metrics text (the smallest of its engines'), or
    None when it publishes no usable ``vllm:cache_config_info``."""
    found: list[int] = []
    for match in _SAMPLE.finditer(metrics_text):
        labels = dict(_LABEL.findall(match.group(1)))
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if blocks > 0 and size > 0:
            found.append(blocks * size)
    return min(found) if found else None


def by_url(slots: Iterable[Slot]) -> dict[str, list[str]]:
    """Slot keys per API server (a multi-node instance has one per node)."""
    out: dict[str, list[str]] = {}
    for slot in slots:
        out.setdefault(slot.url, []).append(slot.key)
    return out


async def watch_kv_capacity(
    served: ServedTable,
    policy: PrefixAffinity,
    session: Callable[[], aiohttp.ClientSession],
    headers: dict[str, str],
) -> None:
    """Size the index of every prefill slot from its engine, as slots appear (runs until cancelled)."""
    loop = asyncio.get_running_loop()
    known: dict[str, tuple[str, ...]] = {}  # url -> the slot keys sized from it
    next_try: dict[str, float] = {}
    while True:
        state = served.current
        if state is not None:
            for url, keys in by_url(state.slots.prefill).items():
                if known.get(url) == tuple(keys) or next_try.get(url, 0.0) > loop.time():
                    continue
                tokens = await _fetch(session(), url, headers)
                if tokens is None:
                    next_try[url] = loop.time() + RETRY_S
                    continue
                policy.engine_capacity(keys, tokens)
                known[url] = tuple(keys)
                log.info(
                    "prefix index of %s sized from its engine's KV: %d tokens per rank -> %d chunks",
                    ", ".join(keys),
                    tokens,
                    policy.options.chunks_for(tokens),
                )
        await asyncio.sleep(POLL_S)


async def _fetch(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> int | None:
    try:
        async with asyncio.timeout(FETCH_TIMEOUT_S):
            async with session.get(url + "/metrics", headers=headers) as resp:
                if resp.status != 200:
                    return None
                return kv_tokens(await resp.text())
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as exc:
        log.debug("reading the KV capacity of %s failed: %s", url, exc)
        return None
