"""Communication between the tensor-parallel WorkAgents of one host (``shm_allreduce.py``)."""
