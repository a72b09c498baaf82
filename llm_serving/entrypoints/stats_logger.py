"""The server's periodic stats line, as vLLM prints it (``--disable-log-stats`` turns it off,
``--log-stats-interval`` sets the period, 10 s by default):

    Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 301.0 tokens/s,
    Running: 128 reqs, Waiting: 72 reqs, Swapped: 0 reqs, KV cache usage: 13.2%,
    Prefix cache hit rate: 0.0%

Throughputs and the prefix-cache hit rate are over the period; a line is written for every
period with work in it, and one more when the engine goes idle. With --enable-mfu-metrics a
second line, vLLM's, gives the period's estimated compute and memory traffic per device (a
tensor-parallel rank), when the model ran in it:

    MFU: 0.4 TF/s/device 3.1 GB/s/device
"""
from __future__ import annotations

import asyncio
import logging
import time

from llm_serving.engine.metrics import EngineStats
from llm_serving.entrypoints.http_common import ServerState

logger = logging.getLogger("llm_serving.stats")


class StatsLogger:
    def __init__(self):
        self._last: EngineStats | None = None
        self._last_time = 0.0
        self._was_busy = False

    def lines(self, s: EngineStats, now: float) -> list[str]:
        """The lines for the period ending now (none when there is nothing to say)."""
        last, dt = self._last, now - self._last_time
        self._last, self._last_time = s, now
        if last is None or dt <= 0:
            return []
        prompt = s.num_prefill_tokens - last.num_prefill_tokens
        gen = s.num_generation_tokens - last.num_generation_tokens
        queries = s.prefix_cache_queries - last.prefix_cache_queries
        hits = s.prefix_cache_hits - last.prefix_cache_hits
        busy = bool(prompt or gen or s.num_running or s.num_waiting or s.num_swapped)
        if not busy and not self._was_busy:
            return []
        self._was_busy = busy
        text = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: "
                f"{gen / dt:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: "
                f"{s.num_waiting} reqs, Swapped: {s.num_swapped} reqs, KV cache usage: "
                f"{100 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: "
                f"{100 * hits / queries if queries else 0.0:.1f}%")
        preempted = s.num_preemptions - last.num_preemptions
        if preempted:
            text += f", Preemptions: {preempted}"
        flops = s.estimated_flops - last.estimated_flops
        moved = (s.estimated_read_bytes + s.estimated_write_bytes
                 - last.estimated_read_bytes - last.estimated_write_bytes)
        if flops or moved:
            return [text, f"MFU: {flops / dt / 1e12:.1f} TF/s/device "
                          f"{moved / dt / 1e9:.1f} GB/s/device"]
        return [text]

    async def run(self, state: ServerState, interval: float) -> None:
        """Until cancelled: every ``interval`` seconds, a line while the engine serves."""
        while state.engine is None or not state.engine.is_running:   # the model loads
            await asyncio.sleep(0.2)
        # The first period starts when serving starts, from the counters' zeros (they count
        # since the engine started): a read here could come after the first requests ran,
        # and their tokens would be missing from every line.
        self._last, self._last_time = EngineStats(), time.monotonic()
        while True:
            await asyncio.sleep(interval)
            engine = state.engine
            if engine is None or not engine.is_running or state.draining:
                continue
            try:
                lines = self.lines(await state.stats(), time.monotonic())
            except Exception:       # noqa: BLE001 - a stats read must not end the logger
                logger.debug("stats read failed", exc_info=True)
                continue
            for text in lines:
                logger.info(text)
