"""What the master launches for a configuration: one pure function, ``plan_launch``.

Per tensor-parallel rank: its device (``start_device_id + rank`` on Ascend), the environment
variables it gets on top of the master's (MindSpore's dynamic-cluster variables when there is
more than one rank), and its command line; plus MindSpore's collective scheduler when there
is more than one rank. ``multiproc_executor.py`` starts exactly this plan, and
``start.py --dry-run`` prints it without starting anything (``describe()``), so the device
path can be checked on a machine without the device.

Nothing here imports MindSpore or touches a device: "auto" is what MindSpore would select
(``llm_serving/device_target.py``) unless the caller says (``device_target``), and the values
only known at launch time (the control connection's file descriptor, the shared-memory
segments' names, the scheduler's port) are placeholders that ``ProcessPlan.command()`` fills
in.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Optional

from llm_serving.config import EngineConfig
from llm_serving.device_target import auto_device_target

# Placeholders in ProcessPlan.argv, filled in by command() at launch.
CONTROL_FD = "<control-fd>"
SHM_IN = "<shm-in>"
SHM_OUT = "<shm-out>"
SCHED_PORT = "<free-port>"

DEVICE_NAMES = {"cpu": "CPU", "ascend": "Ascend", "npu": "Ascend"}


@dataclass(frozen=True)
class ProcessPlan:
    role: str                        # "scheduler" or "agent"
    rank: Optional[int]              # the agent's tensor-parallel rank
    device_id: Optional[int]         # the NPU it selects (Ascend agents only)
    argv: tuple                      # command line (with placeholders)
    env: dict = field(default_factory=dict)           # set over the master's environment
    env_defaults: dict = field(default_factory=dict)  # set unless the master's has them

    def command(self, **values: str) -> list:
        """argv with the placeholders replaced (``control_fd=``, ``shm_in=``, ``shm_out=``)."""
        subst = {CONTROL_FD: values.get("control_fd"), SHM_IN: values.get("shm_in"),
                 SHM_OUT: values.get("shm_out")}
        return [str(subst[a]) if subst.get(a) is not None else a for a in self.argv]

    def environment(self, base: dict, sched_port: Optional[int] = None) -> dict:
        """The process's whole environment, given the master's."""
        env = {**self.env_defaults, **base, **self.env}
        if sched_port is not None and env.get("MS_SCHED_PORT") == SCHED_PORT:
            env["MS_SCHED_PORT"] = str(sched_port)
        return env


@dataclass(frozen=True)
class LaunchPlan:
    device: str                      # "CPU" or "Ascend"
    tp_size: int
    comm_backend: Optional[str]      # "hccl" / "mccl" when tp_size > 1
    scheduler: Optional[ProcessPlan]
    agents: tuple                    # ProcessPlan per rank, by rank

    def describe(self) -> str:
        """A human-readable plan: what ``--dry-run`` prints."""
        lines = [f"device: {self.device}; tensor_parallel_size: {self.tp_size}; "
                 + (f"collectives: {self.comm_backend} (mindspore.communication.init)"
                    if self.comm_backend else "no collectives (one rank)")]
        for p in ([self.scheduler] if self.scheduler else []) + list(self.agents):
            head = ("collective scheduler" if p.role == "scheduler" else
                    f"WorkAgent rank {p.rank}" + (f" -> device {self.device}:{p.device_id}"
                                                  if p.device_id is not None else ""))
            lines.append(head)
            for k, v in sorted(p.env.items()):
                lines.append(f"  env {k}={v}")
            for k, v in sorted(p.env_defaults.items()):
                lines.append(f"  env {k}={v} (unless already set)")
            argv = [a if len(a) < 120 else "'<the EngineConfig as JSON>'" for a in p.argv]
            lines.append("  $ " + " ".join(a if a.startswith("'<") else shlex.quote(a)
                                           for a in argv))
        if self.agents:
            lines.append("the EngineConfig as JSON (--config of every agent):")
            lines.append("  " + self.agents[0].argv[-1])
        return "\n".join(lines)


def resolve_device(device: str, device_target: Optional[str] = None) -> str:
    """"CPU" or "Ascend" for a configured device; "auto" is ``device_target``, by default
    what MindSpore would select on this machine (``llm_serving/device_target.py``)."""
    d = device.lower()
    if d == "auto":
        return device_target or auto_device_target()
    return DEVICE_NAMES[d]


def plan_launch(config: EngineConfig, python: str, device_target: Optional[str] = None,
                sched_host: str = "127.0.0.1") -> LaunchPlan:
    """The scheduler (tensor parallel only) and one WorkAgent per rank for ``config``."""
    tp = config.parallel.tensor_parallel_size
    device = resolve_device(config.device.device, device_target)
    comm = ("mccl" if device == "CPU" else "hccl") if tp > 1 else None
    cluster = ({"MS_SCHED_HOST": sched_host, "MS_SCHED_PORT": SCHED_PORT,
                "MS_WORKER_NUM": str(tp)} if tp > 1 else {})
    # MindSpore's distributed runtime logs a WARNING every few seconds.
    quiet = {"GLOG_v": "3"} if tp > 1 else {}
    scheduler = (ProcessPlan("scheduler", None, None,
                             (python, "-m", "llm_serving.executor.comm_scheduler",
                              config.device.device),
                             {**cluster, "MS_ROLE": "MS_SCHED"}, quiet)
                 if tp > 1 else None)
    config_json = config.to_json()
    agents = []
    for rank in range(tp):
        argv = (python, "-m", "llm_serving.executor.worker", "--control-fd", CONTROL_FD,
                "--tp-rank", str(rank), "--shm-in", SHM_IN, "--shm-out", SHM_OUT,
                "--config", config_json)
        env = ({**cluster, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank)} if tp > 1
               else {})
        if config.model.logits_processors:
            # the user's processor modules import in the agent as in this process (as vLLM's
            # spawned workers get its sys.path; the interpreter's own paths it has)
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
                p or os.getcwd() for p in sys.path
                if not p.startswith((sys.prefix, sys.base_prefix))))
        device_id = config.device.start_device_id + rank if device == "Ascend" else None
        agents.append(ProcessPlan("agent", rank, device_id, argv, env, quiet))
    return LaunchPlan(device, tp, comm, scheduler, tuple(agents))


def print_plan(config: EngineConfig) -> None:
    """``start.py --dry-run``: print the plan for this machine's Python and exit."""
    print(plan_launch(config, sys.executable).describe())
