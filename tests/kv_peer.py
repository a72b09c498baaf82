"""A KV-transfer peer in its own process, for tests/test_kv_transport.py: it holds KV arrays
laid out like the CPU backend's cache (per layer a key and a value array of shape
[num_blocks, block_size, num_kv_heads, head_dim], float32), filled from a seeded RNG, and
answers one JSON command per stdin line with one JSON line on stdout."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 2, 64


def make_kv(num_layers: int, num_blocks: int, seed: int | None):
    """The arrays; seed None gives zeros (a receiver's empty cache)."""
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32))
                for _ in range(num_layers)]
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32))
            for _ in range(num_layers)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["p2p", "store"], required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--master", default=None)
    a = ap.parse_args()
    kv = make_kv(a.layers, a.num_blocks, a.seed)
    if a.mode == "p2p":
        from llm_serving.distributed.kv_transfer.mooncake_p2p import MooncakeP2PTransport
        t = MooncakeP2PTransport(kv)
    else:
        from llm_serving.distributed.kv_transfer.mooncake_store import MooncakeStoreTransport
        t = MooncakeStoreTransport(kv, a.master)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "describe":
            out = t.describe()
        elif op == "expect":
            t.expect(cmd["transfer_id"], cmd["slot"], cmd["token"], cmd["expires_at"])
            out = {"ok": True}
        elif op == "poll_sent":
            done, expired = t.poll_sent()
            out = {"done": done, "expired": expired, "held": t.num_held}
        elif op == "put":
            out = {"stored": t.put_blocks(cmd["keys"], cmd["blocks"])}
        else:
            out = {"error": f"unknown op {op}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
