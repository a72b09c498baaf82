"""KV transfer between instances (PD disaggregation): the configuration (``config.py``), the
connector API (``base.py``), deterministic block hashes (``block_hash.py``), the transports
on Mooncake (``mooncake_p2p.py``, ``mooncake_store.py``) and the connectors built on them."""
