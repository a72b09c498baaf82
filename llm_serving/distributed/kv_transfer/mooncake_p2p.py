"""P2P KV transfer on Mooncake's TransferEngine: the consumer reads the producer's blocks.

Each rank starts one TransferEngine in ``P2PHANDSHAKE`` mode (no metadata server: peers are
named ``host:rpc_port`` and exchange their segment descriptors on first contact), over TCP on
CPU (RDMA, or the Ascend build, on devices), and registers its KV arrays.

Producer (prefill side): ``describe`` is what a reader needs once (the engine's address, the
KV layout, where the notification slots are). Per finished prompt, ``SlotPool.offer`` (on the
scheduler side) gives a transfer id, the block ids, a notification slot, a one-time token and
``expires_at`` (this host's clock; the reader gets ``ttl``); ``expect`` tells the rank to
watch that slot. ``poll_sent`` reports the transfers whose reader said it is done, and those
that expired unread: only then may the blocks be freed.

Consumer (decode side): ``start_read`` submits the asynchronous reads of every array's block
runs (``batch_transfer_async_read``, from a small thread pool: the first contact with a peer
does a handshake that blocks for about a minute when the peer accepts and stays silent, and
the step loop must not); ``poll_reads`` reports reads that finished, failed (peer gone, bad
status) or passed their deadline. At most ``MAX_REGIONS_IN_FLIGHT_PER_PEER`` regions are in
flight to one peer over all reads (Mooncake's TCP transport fails transfers beyond its
per-peer queue); the rest are submitted as earlier ones resolve, when the reads are polled.
Each region is its own Mooncake batch: the binding's
``transfer_check_status(batch_id)`` reports the state of the batch's *first* request only, so
a batch of several regions reads as done while the others are still in flight, or failed
(measured: about half of the 8-region reads from a live peer "done" with regions missing; with
a producer killed mid-read, D decoded from partly unwritten blocks). A read is done only once
every region is and a last 8-byte read of the producer's word for the slot says the transfer
was still held: the producer writes the transfer's token there when its workers take the
offer and the negated token when they release it (read or expired), before its blocks can
be freed, so a read that overlapped a release (an offer that expired while read, whatever the
hosts' clocks say) is failed, never used. A read that failed or timed out while some regions
are still in flight may still write into its destination blocks, so it is reported once more,
as released, when Mooncake resolves every region; the blocks must not be reused before.
After a good read the consumer writes the token into the producer's notification slot (an
8-byte ``transfer_sync_write``), which is how the producer learns it may free the blocks; no
other channel is needed. A consumer that will not read an offer writes it at once
(``decline``).
"""
from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from llm_serving.distributed.kv_transfer.base import KVTransferError
from llm_serving.distributed.kv_transfer.layout import KVLayout, regions

logger = logging.getLogger(__name__)

_PENDING, _DONE, _FAILED = 0, 1, -1       # TransferEngine.transfer_check_status
_QUEUED = 2                                # a region not submitted yet (the window is full)
_UNSENT = 3                                # ... and never to be: the read failed or timed out
# Regions (Mooncake batches) in flight to one peer, over every read. Mooncake's TCP transport
# queues a bounded number of transfers per peer and fails the rest ("TCP lane queue-full
# rejection"): a long prompt on a fragmented pool is thousands of regions (2616 for 1750
# tokens: 109 single-block runs x 24 arrays), and submitting them all at once failed 9 of 127
# loads in bench_pd at 200 prompts, with them the small reads submitted at the same moment.
MAX_REGIONS_IN_FLIGHT_PER_PEER = 64


def import_transfer_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:      # the package, or its Debian runtime libraries, are missing
        raise KVTransferError(f"Mooncake's transfer engine cannot be loaded ({e}); install "
                              "it with pip install -e \".[pd]\" and the Debian packages "
                              "libibverbs1 libnl-3-200 libnl-route-3-200") from None
    return TransferEngine


@dataclass
class _Held:
    slot: int
    token: int
    expires_at: float


@dataclass
class _Read:
    deadline: float
    peer: str
    notify_addr: int
    token: int
    local: list                             # per region: local address, remote address, bytes
    remote: list
    lengths: list
    valid_addr: Optional[int] = None        # the producer's word to check (None: no check)
    check: Optional[int] = None             # the check's batch id, once the data is in
    check_status: Optional[int] = None      # ... and its outcome, once resolved
    batch_ids: Optional[np.ndarray] = None  # per region: Mooncake's batch id (0: none)
    states: Optional[np.ndarray] = None     # per region: _QUEUED, _PENDING, _DONE, _FAILED
                                            # or _UNSENT
    next_region: int = 0                    # regions [0, next_region) were handed to the pool
    submitting: Optional[Future] = None     # a window being submitted (may block: handshake)
    abandoned: bool = field(default=False)  # reported failed; released once all resolved

    def __post_init__(self):
        n = len(self.lengths)
        self.batch_ids = np.zeros(n, np.int64)
        self.states = np.full(n, _QUEUED, np.int8)


class MooncakeP2PTransport:
    """One rank's TransferEngine with its KV arrays registered; producer and consumer calls."""

    def __init__(self, kv_caches, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", max_transfers: int = 4096):
        TransferEngine = import_transfer_engine()
        self.layout = KVLayout.from_kv_caches(kv_caches)
        self._kv_caches = kv_caches                    # keep the registered memory alive
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise KVTransferError(f"Mooncake TransferEngine.initialize({hostname!r}, "
                                  f"P2PHANDSHAKE, {protocol!r}) failed ({rc})")
        # Notification slots: readers write a transfer's token into its slot when done.
        self._notify = np.zeros(max_transfers, np.int64)
        # Per slot, the token of the transfer this rank holds there, or its negation once
        # the transfer is released (read or expired): what a reader checks after its read.
        self._valid = np.zeros(max_transfers, np.int64)
        # What this side writes from and reads the check into (one word each per read in
        # flight; the read's index).
        self._outbox = np.zeros(max_transfers, np.int64)
        self._inbox = np.zeros(max_transfers, np.int64)
        words = (self._notify, self._valid, self._outbox, self._inbox)
        addrs = [*self.layout.base_addrs, *(w.ctypes.data for w in words)]
        sizes = [self.layout.array_bytes] * len(self.layout.base_addrs) + [
            w.nbytes for w in words]
        rc = self.engine.batch_register_memory(addrs, sizes)
        if rc != 0:
            raise KVTransferError(f"Mooncake could not register the KV memory ({rc})")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self._held: dict[str, _Held] = {}
        self._reads: dict[str, _Read] = {}
        self._free_out = list(range(max_transfers - 1, -1, -1))
        self._returned_out: collections.deque = collections.deque()   # from the pool threads
        self._out_slot: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-p2p")
        self._in_flight: dict[str, int] = collections.defaultdict(int)   # regions, per peer
        # A pump thread polls the reads' regions and refills their windows every millisecond
        # while any is in flight (a long read is tens of windows; waiting for the engine's
        # step to poll would add a step per window). One lock for the reads' state: each
        # Mooncake batch must be asked for its status by one caller (the answer frees it).
        self._lock = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._pump, name="kv-p2p-pump", daemon=True).start()

    # ---- producer ------------------------------------------------------------------------

    def describe(self) -> dict:
        """What a reader needs to know about this rank once (JSON-able)."""
        return {"engine": self.session, "layout": self.layout.to_dict(),
                "notify_base": int(self._notify.ctypes.data),
                "valid_base": int(self._valid.ctypes.data),
                "num_slots": len(self._notify)}

    def expect(self, transfer_id: str, slot: int, token: int, expires_at: float) -> None:
        """A reader will fetch this transfer's blocks and then write ``token`` into
        notification ``slot`` (the caller picks both: see ``offer``); until then, or until
        ``expires_at``, the blocks stay allocated."""
        if transfer_id in self._held:
            raise KVTransferError(f"transfer {transfer_id!r} is already held")
        if not 0 <= slot < len(self._notify):
            raise KVTransferError(f"notification slot {slot} out of range")
        # The slot is not cleared here: a fast reader may have written its token already
        # (the parameters reach it before this step runs). Tokens are random, so a stale
        # value left by an earlier transfer never matches.
        self._held[transfer_id] = _Held(slot, token, expires_at)
        self._valid[slot] = token

    def poll_sent(self, now: Optional[float] = None) -> tuple[list[str], list[str]]:
        """(transfers the reader finished, transfers that expired unread): both released."""
        if not self._held:
            return [], []
        now = time.time() if now is None else now
        done, expired = [], []
        for tid, h in self._held.items():
            if self._notify[h.slot] == h.token:
                done.append(tid)
            elif now >= h.expires_at:
                expired.append(tid)
        for tid in done + expired:
            h = self._held.pop(tid)
            self._valid[h.slot] = -h.token      # before the blocks can be freed
        if expired:
            logger.warning("KV transfer(s) %s expired unread; their blocks are freed", expired)
        return done, expired

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- consumer ------------------------------------------------------------------------

    def start_read(self, transfer_id: str, params: dict, local_block_ids,
                   timeout: float) -> None:
        """Submit the read of a producer's blocks into ``local_block_ids``. ``params``: the
        producer rank's ``describe()`` as "remote", and the transfer's "remote_block_ids",
        "slot", "token", "expires_at" (see ``offer``). Raises KVTransferError if it cannot
        even start."""
        if transfer_id in self._reads:
            raise KVTransferError(f"transfer {transfer_id!r} is already being read")
        try:
            desc = params["remote"]
            remote = KVLayout.from_dict(desc["layout"])
            remote_blocks = params["remote_block_ids"]
            peer, slot = str(desc["engine"]), int(params["slot"])
            if not 0 <= slot < int(desc["num_slots"]):
                raise ValueError(f"slot {slot} out of range")
            notify_addr = int(desc["notify_base"]) + 8 * slot
            valid_addr = (int(desc["valid_base"]) + 8 * slot if "valid_base" in desc
                          else None)
            token, expires_at = int(params["token"]), float(params["expires_at"])
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"kv_transfer_params are incomplete or malformed ({e!r})") \
                from None
        if len(remote_blocks) != len(local_block_ids):
            raise KVTransferError(f"the producer offers {len(remote_blocks)} blocks, this "
                                  f"side allocated {len(local_block_ids)}")
        now = time.time()
        deadline = min(now + timeout, expires_at)
        if deadline <= now:
            raise KVTransferError(f"transfer {transfer_id!r} expired before it was read")
        try:
            local, remote_addrs, lengths = regions(self.layout, remote, local_block_ids,
                                                   remote_blocks)
        except ValueError as e:
            raise KVTransferError(str(e)) from None
        if not self._free_out:
            raise KVTransferError(f"{len(self._outbox)} reads already in flight (the bound)")
        with self._lock:
            self._out_slot[transfer_id] = self._free_out.pop()
            r = _Read(deadline, peer, notify_addr, token, local, remote_addrs, lengths,
                      valid_addr)
            self._reads[transfer_id] = r
            self._submit_window(r)
            self._wake.set()

    def _pump(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                busy = False
                try:
                    for r in list(self._reads.values()):
                        if r.check is None:     # the data phase (poll_reads does the rest)
                            busy = self._read_state(r)[0] > 0 or busy
                except Exception:  # noqa: BLE001 - the engine's polls still drive the reads
                    logger.exception("KV read pump: polling the reads failed")
                if not busy:
                    self._wake.clear()      # start_read sets it again, under the lock
            if busy:
                time.sleep(0.001)

    def _submit_window(self, r: _Read) -> None:
        """Hand the read's next regions to the pool, as many as the peer's window has room
        for. Submitting does the first contact's handshake, which blocks while the peer does
        not answer (about a minute when it accepts and stays silent): off the step thread."""
        room = MAX_REGIONS_IN_FLIGHT_PER_PEER - self._in_flight[r.peer]
        if room <= 0 or r.submitting is not None or r.next_region >= len(r.lengths):
            return
        lo, hi = r.next_region, min(len(r.lengths), r.next_region + room)
        r.next_region = hi
        r.states[lo:hi] = _PENDING
        self._in_flight[r.peer] += hi - lo
        r.submitting = self._pool.submit(self._submit_regions, r.peer, r.local[lo:hi],
                                         r.remote[lo:hi], r.lengths[lo:hi], lo)

    def _submit_regions(self, peer: str, local, remote, lengths, first: int):
        """One Mooncake batch per region (see the module docstring: the status of a batch is
        its first request's); 0 for a region that could not be submitted. Never raises.
        Returns (the first region's index, the batch ids)."""
        ids = []
        for args in zip(local, remote, lengths):
            try:
                ids.append(int(self.engine.batch_transfer_async_read(
                    peer, [args[0]], [args[1]], [args[2]])))
            except Exception as e:  # noqa: BLE001 - a region that never started has failed
                logger.warning("Mooncake read from %s could not be submitted (%s)", peer, e)
                ids.append(0)
        return first, ids

    def _read_state(self, r: _Read) -> tuple[int, int]:
        """(regions still in flight or to submit, regions failed), polling the unresolved
        ones and submitting the next window while the read goes well."""
        if r.submitting is not None:
            if not r.submitting.done():
                return 1, int((r.states == _FAILED).sum())
            first, ids = r.submitting.result()
            r.submitting = None
            r.batch_ids[first:first + len(ids)] = ids
        for i in np.flatnonzero(r.states == _PENDING):
            batch_id = r.batch_ids[i]
            # transfer_check_status frees the batch once it is resolved: ask no more after.
            status = _FAILED if batch_id <= 0 else self.engine.transfer_check_status(batch_id)
            if status != _PENDING:
                r.states[i] = _DONE if status == _DONE else _FAILED
                self._in_flight[r.peer] -= 1
        failed = int((r.states == _FAILED).sum())
        if failed or r.abandoned or time.time() >= r.deadline:
            r.states[r.states == _QUEUED] = _UNSENT     # never submitted: nothing will write
        else:
            self._submit_window(r)
        pending = int((r.states == _PENDING).sum()) + int((r.states == _QUEUED).sum())
        return pending, failed

    def poll_reads(self, now: Optional[float] = None
                   ) -> tuple[list[str], list[tuple[str, str]], list[str]]:
        """(reads done, reads failed with the reason, abandoned reads now resolved). The
        destination blocks of a done read, or of a failed read reported here for the first
        time and absent from ``_reads`` afterwards, are free to use; a failed read still in
        flight (a region pending, or the deadline passed) frees its blocks only once it
        appears in the third list."""
        with self._lock:
            return self._poll_reads(time.time() if now is None else now)

    def _poll_reads(self, now: float):
        done, failed, released = [], [], []
        for tid, r in list(self._reads.items()):
            pending, bad = self._read_state(r)
            if r.abandoned:
                if not pending and self._check_settled(r):
                    released.append(tid)
                    self._forget(tid)
                continue
            if bad:
                failed.append((tid, f"Mooncake read from {r.peer} failed ({bad} of "
                                    f"{len(r.states)} regions): the producer is gone or "
                                    "refused it"))
                if pending:
                    r.abandoned = True
                else:
                    self._forget(tid)
                continue
            # regions never sent (the deadline passed first): reported as timed out below
            verdict = None if pending or (r.states == _UNSENT).any() else self._check(tid, r)
            if verdict == "":
                done.append(tid)
                self._notify_peer(tid, r)
                self._forget(tid)
            elif verdict:
                failed.append((tid, verdict))
                self._forget(tid)
            elif now >= r.deadline:
                failed.append((tid, f"KV transfer from {r.peer} timed out"))
                r.abandoned = True
        return done, failed, released

    def _check(self, tid: str, r: _Read) -> Optional[str]:
        """After the data: read the producer's word for the slot. "" when the blocks were
        still held (the word is not the transfer's negated token: P negates it when it
        releases the transfer, before its blocks can be reused), the reason when not, None
        while the check is in flight."""
        if r.valid_addr is None:
            return ""
        idx = self._out_slot[tid]
        if r.check is None:
            self._inbox[idx] = 0
            try:
                r.check = int(self.engine.batch_transfer_async_read(
                    r.peer, [int(self._inbox.ctypes.data + 8 * idx)], [r.valid_addr], [8]))
            except Exception:  # noqa: BLE001 - as a failed check
                r.check = 0
            if r.check <= 0:
                return f"Mooncake read from {r.peer} failed (the check could not start)"
        if not self._check_settled(r):
            return None
        if r.check_status != _DONE:
            return (f"Mooncake read from {r.peer} failed (check status {r.check_status}): "
                    "the producer is gone")
        if int(self._inbox[idx]) == -r.token:
            return (f"the producer at {r.peer} released transfer {tid} while it was read (the "
                    "offer expired, or a reader declined it): its blocks may have been reused")
        return ""

    def _check_settled(self, r: _Read) -> bool:
        """The check's read is not in flight (never started, or resolved)."""
        if r.check is None or r.check <= 0 or r.check_status is not None:
            return True
        status = self.engine.transfer_check_status(r.check)    # frees the batch once resolved
        if status == _PENDING:
            return False
        r.check_status = status
        return True

    def _notify_peer(self, tid: str, r: _Read) -> None:
        self._write_token(tid, r.peer, r.notify_addr, r.token, self._out_slot.pop(tid))

    def decline(self, transfer_id: str, remote: dict, slot, token) -> None:
        """Tell a producer that its offer will not be read (as a reader does once done): it
        frees the blocks now. ``remote``: the producer rank's ``describe()``."""
        try:
            peer, slot, token = str(remote["engine"]), int(slot), int(token)
            if not 0 <= slot < int(remote["num_slots"]):
                raise ValueError(f"slot {slot} out of range")
            notify_addr = int(remote["notify_base"]) + 8 * slot
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"kv_transfer_params are incomplete or malformed ({e!r})") \
                from None
        while self._returned_out:       # (the outbox words are the step thread's)
            self._free_out.append(self._returned_out.popleft())
        if not self._free_out:
            raise KVTransferError(f"{len(self._outbox)} writes already in flight (the bound)")
        self._write_token(transfer_id, peer, notify_addr, token, self._free_out.pop())

    def _write_token(self, tid: str, peer: str, notify_addr: int, token: int, out: int) -> None:
        """Write ``token`` into the producer's slot from outbox word ``out``, off the step
        thread (a producer that died meanwhile would block the write); the word is reused
        once it is sent."""
        self._outbox[out] = token

        def write():
            try:
                rc = self.engine.transfer_sync_write(
                    peer, int(self._outbox.ctypes.data + 8 * out), notify_addr, 8)
                if rc != 0:       # the producer frees the blocks at expiry instead
                    logger.warning("could not tell %s that transfer %s is done (%s)",
                                   peer, tid, rc)
            finally:
                self._returned_out.append(out)
        self._pool.submit(write)

    def _forget(self, tid: str) -> None:
        self._reads.pop(tid)
        slot = self._out_slot.pop(tid, None)
        if slot is not None:
            self._free_out.append(slot)
        while self._returned_out:       # words whose notification was sent
            self._free_out.append(self._returned_out.popleft())

    @property
    def num_reading(self) -> int:
        return len(self._reads)

    def wait_read(self, transfer_id: str, poll: float = 0.0005) -> None:
        """Block until one read ends; raise KVTransferError if it failed or timed out."""
        while True:
            done, failed, _ = self.poll_reads()
            if transfer_id in done:
                return
            for tid, why in failed:
                if tid == transfer_id:
                    raise KVTransferError(why)
            if transfer_id not in self._reads:
                raise KVTransferError(f"no read {transfer_id!r} in flight")
            time.sleep(poll)


class SlotPool:
    """Notification slots of one producer and the tokens that prove a reader is done: the
    producer's scheduler side hands them out (so it can return the transfer parameters at
    once), its workers watch them. Bounded: ``offer`` fails when every slot is taken."""

    def __init__(self, num_slots: int = 4096):
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: dict[str, int] = {}

    def offer(self, transfer_id: str, block_ids, timeout: float) -> dict:
        if not self._free:
            raise KVTransferError(f"{len(self._used)} transfers are already held (the bound)")
        slot = self._free.pop()
        self._used[transfer_id] = slot
        return {"transfer_id": transfer_id, "remote_block_ids": [int(b) for b in block_ids],
                "slot": slot, "token": secrets.randbits(62) + 1,
                "expires_at": time.time() + timeout}

    def release(self, transfer_id: str) -> None:
        slot = self._used.pop(transfer_id, None)
        if slot is not None:
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self._used)
