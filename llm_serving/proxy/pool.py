"""The instances behind the proxy: which are up, and which one takes the next request.

Each instance is checked with ``GET /ready`` every ``interval`` seconds, each check bounded
by a timeout: 200 only when it takes new requests (503 while it loads, restarts its model or
drains for a shutdown; its ``/health`` stays 200 while draining, which is liveness, not
routing). One that answers anything but 200, or whose connection is refused (at a check or a
request), leaves the rotation until a check passes again; a draining one never comes back.
A check that times out may only mean a busy instance: it counts as a failure after
``TIMEOUTS_GONE`` in a row. An instance that is gone (connection refused, or that many
timeouts) also has its ``down`` event set, so the requests waiting on it end at once with a
clear error instead of waiting for their read timeout.

Policies: ``round-robin`` (in turn, over the healthy ones) and ``least-loaded`` (fewest
requests in flight through this proxy; ties in turn).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

logger = logging.getLogger("llm_serving.proxy")
POLICIES = ("round-robin", "least-loaded")
TIMEOUTS_GONE = 3


@dataclass(eq=False)
class Instance:
    url: str
    role: str                   # "prefill" | "decode"
    healthy: bool = False
    reason: str = "not checked yet"
    inflight: int = 0
    checked_at: float = 0.0
    timeouts: int = 0           # health checks timed out in a row
    down: asyncio.Event = field(default_factory=asyncio.Event)

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("%s instance %s is up", self.role, self.url)
        self.healthy, self.reason = True, "ok"
        if self.down.is_set():
            self.down = asyncio.Event()

    def mark_unhealthy(self, reason: str, gone: bool) -> None:
        """Out of rotation; ``gone``: it does not answer at all (its requests are ended)."""
        if self.healthy:
            logger.warning("%s instance %s out of rotation: %s", self.role, self.url, reason)
        self.healthy, self.reason = False, reason
        if gone:
            self.down.set()


class Pool:
    """The instances of one role."""

    def __init__(self, role: str, urls: Iterable[str], policy: str):
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
        self.role = role
        self.instances = [Instance(u.rstrip("/"), role) for u in urls]
        if not self.instances:
            raise ValueError(f"--{role}: at least one URL is needed")
        self.policy = policy
        self._turn = itertools.count()

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def pick(self, exclude: set = frozenset()) -> Optional[Instance]:
        """The instance for the next request (None: none is healthy)."""
        ready = [i for i in self.instances if i.healthy and i not in exclude]
        if not ready:
            return None
        start = next(self._turn) % len(ready)
        ordered = ready[start:] + ready[:start]
        if self.policy == "least-loaded":
            return min(ordered, key=lambda i: i.inflight)
        return ordered[0]

    def describe(self) -> str:
        return "; ".join(f"{i.url}: {i.reason}" for i in self.instances)


async def check(client, inst: Instance, timeout: float) -> None:
    """One health check of ``inst`` (``client``: an httpx AsyncClient)."""
    import httpx2 as httpx
    try:
        r = await client.get(inst.url + "/ready", timeout=timeout)
    except httpx.TimeoutException:
        inst.timeouts += 1
        if inst.timeouts >= TIMEOUTS_GONE or not inst.healthy:
            inst.mark_unhealthy(f"/ready did not answer within {timeout:g} s, "
                                f"{inst.timeouts} times in a row", gone=True)
    except httpx.HTTPError as e:
        inst.mark_unhealthy(f"unreachable ({type(e).__name__}: {e})", gone=True)
    else:
        inst.timeouts = 0
        if r.status_code == 200:
            inst.mark_up()
        else:
            inst.mark_unhealthy(f"/ready answered {r.status_code}{_reason(r)}", gone=False)
    inst.checked_at = time.monotonic()


def _reason(resp) -> str:
    """The instance's own reason for a 503 (``{"ready": false, "reason": ...}``), if any."""
    try:
        reason = resp.json().get("reason")
    except (ValueError, AttributeError):
        return ""
    return f" ({reason})" if isinstance(reason, str) and reason else ""


async def check_all(client, pools: Iterable[Pool], timeout: float) -> None:
    await asyncio.gather(*(check(client, i, timeout) for p in pools for i in p.instances))


async def keep_checking(client, pools: list[Pool], interval: float, timeout: float) -> None:
    """Checks every instance every ``interval`` seconds, until cancelled."""
    while True:
        await asyncio.sleep(interval)
        try:
            await check_all(client, pools, timeout)
        except Exception:   # noqa: BLE001 - a bug here must not stop the checks
            logger.exception("health checks failed")
