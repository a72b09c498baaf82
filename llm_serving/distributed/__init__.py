"""Communication between processes: the tensor-parallel WorkAgents of one host
(``shm_allreduce.py``), and KV transfer between instances (``kv_transfer/``)."""
