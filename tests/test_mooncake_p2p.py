"""The P2P transport alone (mooncake_p2p.py): a consumer reading a producer's KV blocks over
Mooncake's TransferEngine, the producer in its own process (as P is). What D relies on: a
read reported done has every byte of every region, and a read from a producer that dies
mid-read is failed, never done with blocks left unwritten (before the fix, Mooncake's
``transfer_check_status`` reported a multi-region batch done when its first region was)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llm_serving.distributed.kv_transfer.base import KVTransferError
from llm_serving.distributed.kv_transfer.mooncake_p2p import MooncakeP2PTransport

ROOT = Path(__file__).resolve().parents[1]
LAYERS, BLOCKS, BLOCK_FLOATS = 4, 64, 2048     # 8 arrays of 512 KiB: 8 regions a read

PRODUCER = f"""
import json, sys, time
import numpy as np
from llm_serving.distributed.kv_transfer.base import KVTransferError
from llm_serving.distributed.kv_transfer.mooncake_p2p import MooncakeP2PTransport
kv = [tuple(np.arange({BLOCKS} * {BLOCK_FLOATS}, dtype=np.float32).reshape({BLOCKS}, -1)
            + 1 + 1e6 * (2 * layer + side) for side in (0, 1)) for layer in range({LAYERS})]
t = MooncakeP2PTransport(kv)
t.expect("held", 6, 777, time.time() + 120)           # held for a reader
t.expect("gone", 5, 555, time.time() - 1)             # expired: released at once
assert t.poll_sent() == ([], ["gone"])
print(json.dumps(t.describe()), flush=True)
time.sleep(120)
"""


def expected():
    base = np.arange(BLOCKS * BLOCK_FLOATS, dtype=np.float32).reshape(BLOCKS, -1) + 1
    return [base + 1e6 * i for i in range(2 * LAYERS)]


@pytest.fixture
def producer():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    try:
        yield proc, json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def consumer():
    kv = [tuple(np.zeros((BLOCKS, BLOCK_FLOATS), np.float32) for _ in range(2))
          for _ in range(LAYERS)]
    return MooncakeP2PTransport(kv), [a for pair in kv for a in pair]


def read(consumer, desc, tid, slot, blocks, token=7):
    t, arrays = consumer
    for a in arrays:
        a[:] = 0
    t.start_read(tid, {"remote": desc, "remote_block_ids": blocks, "slot": slot,
                       "token": token, "expires_at": time.time() + 30}, blocks, 30)


def test_a_read_reported_done_has_every_byte_of_every_region(producer, consumer):
    _, desc = producer
    t, arrays = consumer
    blocks, want = list(range(BLOCKS)), expected()
    for i in range(10):
        read(consumer, desc, f"live-{i}", i, blocks)
        t.wait_read(f"live-{i}", poll=0.0001)
        # At once, the last float of every region (the last to arrive): nothing may still be
        # arriving once the read says done. Then every byte.
        assert [a[-1, -1] for a in arrays] == [w[-1, -1] for w in want], f"read {i}"
        for got, w in zip(arrays, want):
            np.testing.assert_array_equal(got, w)


def test_a_producer_killed_mid_read_fails_the_read_and_releases_it(producer, consumer):
    proc, desc = producer
    t, arrays = consumer
    blocks = list(range(BLOCKS))
    read(consumer, desc, "warm", 0, blocks)          # the handshake, so the kill hits data
    t.wait_read("warm")
    read(consumer, desc, "dying", 1, blocks)
    os.kill(proc.pid, signal.SIGKILL)
    outcome, deadline = None, time.monotonic() + 30
    while t.num_reading and time.monotonic() < deadline:
        done, failed, _ = t.poll_reads()
        if done:
            outcome = "done"
        if failed:
            outcome = "failed"
        time.sleep(0.001)
    assert t.num_reading == 0, "the read was never resolved"
    if outcome == "done":        # the kill came after the last byte: then every byte is there
        for got, want in zip(arrays, expected()):
            np.testing.assert_array_equal(got, want)
    else:
        assert outcome == "failed"


def test_a_read_of_a_transfer_the_producer_released_is_not_used(producer, consumer):
    """After the data, the reader checks the producer's word for the slot: a transfer the
    producer released meanwhile (expired: its blocks may hold another prompt's KV by now)
    fails, even though every byte arrived; one it still holds is done."""
    _, desc = producer
    t, _ = consumer
    blocks = list(range(8))
    read(consumer, desc, "released", 5, blocks, token=555)
    with pytest.raises(KVTransferError, match="released transfer released"):
        t.wait_read("released")
    read(consumer, desc, "held", 6, blocks, token=777)
    t.wait_read("held")
    assert t.num_reading == 0


def test_reads_of_thousands_of_regions_complete_intact(producer, consumer):
    """A long prompt on a fragmented KV pool is one region per block per array, thousands at
    once (bench_pd: 2616 for a 1750-token prompt). Mooncake's TCP transport queues a bounded
    number of transfers per peer and fails the rest, which failed such loads and the small
    reads submitted next to them; the consumer keeps a window of regions in flight per peer,
    so every read completes with every byte."""
    _, desc = producer
    t, arrays = consumer
    blocks = list(range(BLOCKS - 2, -1, -2))            # no two adjacent: a region per block
    want = expected()
    for a in arrays:
        a[:] = 0
    tids = [f"frag-{i}" for i in range(12)]            # 12 reads x 32 blocks x 8 arrays
    for i, tid in enumerate(tids):
        t.start_read(tid, {"remote": desc, "remote_block_ids": blocks, "slot": 6,
                           "token": 777, "expires_at": time.time() + 60}, blocks, 60)
    done, deadline = set(), time.monotonic() + 60
    while len(done) < len(tids) and time.monotonic() < deadline:
        ok, failed, _ = t.poll_reads()
        assert not failed, failed
        done.update(ok)
        time.sleep(0.001)
    assert done == set(tids)
    for got, w in zip(arrays, want):
        np.testing.assert_array_equal(got[blocks], w[blocks])
        assert not got[[b + 1 for b in blocks]].any()
