"""MindSpore's collective scheduler for a tensor-parallel group of WorkAgents.

The master starts it beside the agents (environment: MS_ROLE=MS_SCHED, MS_SCHED_HOST,
MS_SCHED_PORT, MS_WORKER_NUM). ``mindspore.communication.init()`` in this role serves the
cluster's topology until the agents are gone; the master kills it at shutdown. If the master
itself is killed, the agents exit when their control connection closes and this process
exits on its own once it sees them time out.
"""
from __future__ import annotations

import os
import sys

from llm_serving.executor.worker import exit_with_master, ignore_stop_signals


def main() -> int:
    ignore_stop_signals()     # the master kills it after the agents ...
    exit_with_master()        # ... or it goes with the master
    from mindspore.communication import init
    from llm_serving.model_executor.device import init_device
    device = init_device(sys.argv[1] if len(sys.argv) > 1 else "auto")   # as the agents do
    init("mccl" if device == "CPU" else "hccl")
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
