"""A function of an importable module, for tests/test_collective_rpc.py: collective_rpc pickles
it by reference, and the WorkAgents import this module through the caller's sys.path."""


def boom(worker, x):
    raise ValueError(f"boom {x} on rank {worker.rank}")
