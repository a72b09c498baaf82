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


def connector_class(config: KVTransferConfig) -> type:
    module, name = _CLASSES[config.kv_connector]
    return getattr(importlib.import_module(module), name)


def create_connector(config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                     rank: int = 0, tp_size: int = 1, model_tag: str = "") -> KVConnectorBase:
    conn = connector_class(config)(config, role, block_size, rank, tp_size)
    conn.model_tag = model_tag
    return conn


def kv_model_tag(engine_config) -> str:
    """What a KV block's content depends on besides its tokens (the pool's key salt): the
    model (its directory's name and shape), weight and KV dtypes, block size and
    tensor-parallel split (a bf16 KV block is another block than a float32 one). Dtypes are
    named as they resolve, so an instance started with the defaults and one given float32
    explicitly share blocks."""
    import os
    m, hf = engine_config.model, engine_config.model.hf
    return (f"{os.path.basename(os.path.normpath(m.path))}|L{hf.num_layers}|H{hf.hidden_size}"
            f"|KV{hf.num_kv_heads}x{hf.head_dim}|V{hf.vocab_size}|{m.weight_dtype}"
            f"|kv:{m.kv_storage_dtype}"
            f"|bs{engine_config.cache.block_size}"
            f"|tp{engine_config.parallel.tensor_parallel_size}")
