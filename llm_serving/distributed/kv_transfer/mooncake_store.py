"""Pool KV transfer on Mooncake's distributed store (``MooncakeDistributedStore``).

Any instance puts full KV blocks under a key made of their prefix hash (block_hash.py) and
any instance gets them: a producer/consumer pair needs no direct contact, and a second
instance serving a prompt the first has seen skips its prefill (a prefix cache shared across
instances). One key holds one block of one rank: the block's slice of every layer's key and
value array (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` move them
straight from and into the registered KV arrays, no staging copy).

The store needs its master (``mooncake_master``, started beside the instances; its address is
``kv_connector_extra_config.master_server_address``). The master is probed with a plain TCP
connect first: Mooncake's own ``setup`` retries for about 90 s when it is absent, and a
serving instance must say so at once. When the master goes away later, puts and gets fail
(status -900) after the client's retries, seconds later; callers treat that as a failed
transfer, and ``MasterWatch`` keeps them from asking again until the master is back.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Optional

import numpy as np

from llm_serving.distributed.kv_transfer.base import KVTransferError
from llm_serving.distributed.kv_transfer.layout import KVLayout

logger = logging.getLogger(__name__)


def check_master(address: str, timeout: float = 2.0) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        raise KVTransferError(f"the Mooncake master at {address} is unreachable ({e}); start "
                              f"it with `mooncake_master --rpc_port={port}` or fix "
                              "kv_connector_extra_config.master_server_address") from None


class MasterWatch:
    """Whether to ask the store now. After a failed call the store is not asked for
    ``backoff`` seconds, then only once its master accepts a connection: a master that is gone
    refuses at once, where the store's client retries for seconds (a producer puts in every
    prefill step, so each put would stall the step that long)."""

    def __init__(self, address: str, backoff: float = 5.0, probe_timeout: float = 0.5):
        self.address, self.backoff, self.probe_timeout = address, backoff, probe_timeout
        self._down_until: Optional[float] = None

    def failed(self) -> None:
        self._down_until = time.monotonic() + self.backoff

    def answered(self) -> None:
        self._down_until = None

    @property
    def down(self) -> bool:
        return self._down_until is not None

    def usable(self) -> bool:
        if self._down_until is None:
            return True
        if time.monotonic() < self._down_until:
            return False
        try:
            check_master(self.address, self.probe_timeout)
        except KVTransferError:
            self.failed()
            return False
        return True


class MooncakeStoreTransport:
    """One rank's store client with its KV arrays registered."""

    def __init__(self, kv_caches, master_server_address: str,
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", metadata_server: str = "P2PHANDSHAKE",
                 global_segment_size: int = 256 << 20, local_buffer_size: int = 16 << 20,
                 connect_timeout: float = 2.0):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise KVTransferError(f"Mooncake's store cannot be loaded ({e}); install it with "
                                  "pip install -e \".[pd]\"") from None
        self.layout = KVLayout.from_kv_caches(kv_caches)
        self._kv_caches = kv_caches
        self.master = master_server_address
        check_master(master_server_address, connect_timeout)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(local_hostname, metadata_server, int(global_segment_size),
                              int(local_buffer_size), protocol, device_name,
                              master_server_address)
        if rc != 0:
            raise KVTransferError(f"MooncakeDistributedStore.setup with master "
                                  f"{master_server_address} failed ({rc})")
        for addr in self.layout.base_addrs:
            rc = self.store.register_buffer(addr, self.layout.array_bytes)
            if rc != 0:
                raise KVTransferError(f"the store could not register the KV memory ({rc})")
        self._bases = np.asarray(self.layout.base_addrs, np.int64)

    def _buffers(self, block_ids):
        bb = self.layout.block_bytes
        blocks = np.asarray(block_ids, np.int64)
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= self.layout.num_blocks):
            raise KVTransferError("block id out of range")
        ptrs = (self._bases[None, :] + blocks[:, None] * bb).tolist()
        return ptrs, [[bb] * len(self._bases)] * len(blocks)

    def put_blocks(self, keys: list[str], block_ids) -> list[bool]:
        """Put each block under its key; per key, whether it is in the store now (a key
        already there is kept: the same prefix has the same KV)."""
        if not keys:
            return []
        ptrs, sizes = self._buffers(block_ids)
        rcs = self.store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        if len(rcs) != len(keys):
            raise KVTransferError(f"store put failed (master {self.master})")
        return [rc == 0 for rc in rcs]     # a key already stored answers 0 too

    def get_blocks(self, keys: list[str], block_ids) -> list[bool]:
        """Get each key into its block; per key, whether the block arrived whole."""
        if not keys:
            return []
        ptrs, sizes = self._buffers(block_ids)
        rcs = self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        want = self.layout.block_bytes * len(self._bases)
        if len(rcs) != len(keys):
            raise KVTransferError(f"store get failed (master {self.master})")
        return [rc == want for rc in rcs]

    def close(self) -> None:
        self.store.close()

