"""The simulator as a process: its sockets, signals, and its place in a multi-node group (the
leader's RPC port where the other nodes join, or a node's join of its leader).

A broken group ends the process as vLLM's API server ends (pdserve.sim.group).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from aiohttp import web

from pdserve.sim.group import describe
from pdserve.sim.server import Simulator


async def serve(sim: Simulator, host: str, port: int, backlog: int = 4096) -> int | None:
    """Serve until SIGTERM or SIGINT, or the group breaks; requests still hanging are cut after a
    short grace period. The signal that stopped it, if one did."""
    runner = web.AppRunner(
        sim.app(),
        access_log=None,
        handler_cancellation=True,  # a client disconnect cancels the request, as in vLLM
        keepalive_timeout=600,
        shutdown_timeout=2.0,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=backlog, reuse_address=True)
    await site.start()
    runners = [runner]
    group = sim.group_config
    joining: asyncio.Task[None] | None = None
    stop = sim.stopping
    if group.leader:
        rpc = web.AppRunner(sim.group_app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await rpc.setup()
        await web.TCPSite(rpc, group.address or host, group.rpc_port, reuse_address=True).start()
        runners.insert(0, rpc)
    elif group.multi_node:
        engine_url = f"http://{host}:{port}" if group.headless and group.nnodes == 1 else None
        joining = asyncio.create_task(sim.group.keep_joined(engine_url, stop))
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    c = sim.config
    faults = ", ".join(f.spec() for f in sim.generation.faults) or "none"
    where = f"group={describe(group)} " if group.multi_node else ""
    if c.engine is not None:
        e = c.engine.config
        where += (
            f"profile={c.engine.profile.name} (max_num_seqs={e.max_num_seqs} max_num_batched_tokens="
            f"{e.max_num_batched_tokens} block_size={e.block_size} num_gpu_blocks={e.num_gpu_blocks} "
            f"prefix_caching={'on' if e.enable_prefix_caching else 'off'}) "
        )
    print(
        f"pdserve sim: role={c.role} dp_size={c.dp_size} model={c.identity.model} "
        f"instance={c.identity.instance_name} faults={faults} {where}listening on http://{host}:{port}",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        if joining is not None:
            joining.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await joining
        await sim.close()
        for each in runners:
            await each.cleanup()
        if sim.tracer is not None:  # what is still buffered goes out before the process ends
            await asyncio.to_thread(sim.tracer.shutdown)
    return received[0] if received else None
