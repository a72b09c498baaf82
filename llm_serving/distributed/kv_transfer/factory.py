"""Builds the connector a ``KVTransferConfig`` names, in one role (scheduler or worker)."""
from __future__ import annotations

import importlib

from llm_serving.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from llm_serving.distributed.kv_transfer.config import KVTransferConfig

# kv_connector -> (module, class); modules are imported only when used (Mooncake's are heavy).
_CLASSES = {
    "InProcessConnector": ("llm_serving.distributed.kv_transfer.in_process",
                           "InProcessConnector"),
    "MooncakeConnector": ("llm_serving.distributed.kv_transfer.mooncake_connector",
                          "MooncakeConnector"),
    "MooncakeStoreConnector": ("llm_serving.distributed.kv_transfer.mooncake_store_connector",
                               "MooncakeStoreConnector"),
}


def create_connector(config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                     rank: int = 0, tp_size: int = 1) -> KVConnectorBase:
    module, name = _CLASSES[config.kv_connector]
    cls = getattr(importlib.import_module(module), name)
    return cls(config, role, block_size, rank, tp_size)
