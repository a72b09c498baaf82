"""The device path without a device: what the master would launch for an Ascend config
(rank -> device, MindSpore's cluster environment, command lines), shown by
``start.py --dry-run`` and computed by ``executor/launch_plan.py``, which the multiprocess
executor also launches from."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llm_serving.config import EngineArgs, EngineConfig
from llm_serving.executor.launch_plan import plan_launch

ROOT = Path(__file__).resolve().parents[1]


def _ascend_yaml(tmp_path, model_dir, ports, start_device_id):
    """The shipped 7B KBK config, pointed at the tiny model, on Ascend with these ports."""
    cfg = yaml.safe_load((ROOT / "configs/llama/llama_7b_kbk_pa_dyn.yaml").read_text())
    cfg["serving_config"].update(agent_ports=ports, start_device_id=start_device_id)
    cfg["model_config"].update(max_generate_length=1024, seq_length=[1024])
    cfg["llm_serving"] = {"model": model_dir, "device": "Ascend"}
    path = tmp_path / "ascend.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dry_run_prints_the_rank_to_device_map_environment_and_commands(tiny_model_dir,
                                                                        tmp_path):
    path = _ascend_yaml(tmp_path, tiny_model_dir, [16002, 16003, 16004, 16005], 4)
    res = subprocess.run([sys.executable, "start.py", "--config", str(path), "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "device: Ascend; tensor_parallel_size: 4; collectives: hccl" in out
    # One agent per agent_ports entry, rank r on device start_device_id + r.
    assert re.findall(r"WorkAgent rank (\d) -> device Ascend:(\d)", out) == [
        ("0", "4"), ("1", "5"), ("2", "6"), ("3", "7")]
    blocks = out.split("WorkAgent rank ")[1:]
    for rank, block in enumerate(blocks):
        assert f"env MS_NODE_ID={rank}\n" in block and "env MS_ROLE=MS_WORKER\n" in block
        assert "env MS_WORKER_NUM=4\n" in block
        assert f"-m llm_serving.executor.worker --control-fd '<control-fd>' --tp-rank {rank} " \
               in block
    sched = out.split("collective scheduler\n")[1].split("WorkAgent")[0]
    assert "env MS_ROLE=MS_SCHED" in sched and "comm_scheduler ascend" in sched
    # The agents' config says Ascend from device 4; nothing was started.
    config = EngineConfig.from_json(out.strip().splitlines()[-1].strip())
    assert (config.device.device, config.device.start_device_id) == ("ascend", 4)
    assert config.parallel.tensor_parallel_size == 4


@pytest.mark.parametrize("device,tp,start", [("ascend", 1, 3), ("ascend", 2, 0), ("cpu", 2, 5)])
def test_the_plan_matches_what_each_agent_will_select(tiny_model_dir, device, tp, start):
    """The device the plan names for rank r is the one the agent's own config gives it
    (start_device_id + r, which the WorkAgent passes to init_device); one rank gets no
    cluster environment and no scheduler; CPU ranks name no device and use mccl."""
    config = EngineArgs(model=tiny_model_dir, device=device, tensor_parallel_size=tp,
                        start_device_id=start, num_blocks=64).create_engine_config()
    plan = plan_launch(config, "python")
    assert len(plan.agents) == tp and (plan.scheduler is not None) == (tp > 1)
    for rank, agent in enumerate(plan.agents):
        argv = agent.argv
        sent = EngineConfig.from_json(argv[argv.index("--config") + 1])
        assert int(argv[argv.index("--tp-rank") + 1]) == rank
        expected = sent.device.start_device_id + rank if device == "ascend" else None
        assert agent.device_id == expected
        env = agent.environment({"PATH": "/bin", "GLOG_v": "1"}, sched_port=1234)
        if tp == 1:
            assert not any(k.startswith("MS_") for k in env) and env["GLOG_v"] == "1"
        else:
            assert (env["MS_NODE_ID"], env["MS_WORKER_NUM"], env["MS_SCHED_PORT"]) == (
                str(rank), str(tp), "1234")
            assert env["GLOG_v"] == "1"           # the user's own setting wins
    assert plan.comm_backend == (None if tp == 1 else "hccl" if device == "ascend" else "mccl")
    cmd = plan.agents[0].command(control_fd=9, shm_in="a,b", shm_out="c,d")
    assert cmd[cmd.index("--control-fd") + 1] == "9" and cmd[cmd.index("--shm-in") + 1] == "a,b"


@pytest.mark.parametrize("kv,itemsize", [("float32", 4), ("float16", 2), ("bfloat16", 2),
                                       ("fp8_e5m2", 1)])
def test_dry_run_states_the_kv_pool_it_would_allocate(tiny_model_dir, kv, itemsize):
    """The KV pool's line (start.py logs it before starting): blocks, tokens, the storage
    dtype asked for, and its bytes, computed here from the model's config.json."""
    import json
    hf = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    kvh = hf.get("num_key_value_heads", hf["num_attention_heads"])
    d = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    res = subprocess.run([sys.executable, "start.py", "--model", str(tiny_model_dir),
                          "--device", "cpu", "--num-blocks", "300", "--kv-cache-dtype", kv,
                          "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    mib = 2 * hf["num_hidden_layers"] * 300 * 16 * kvh * d * itemsize / 2**20
    assert res.stdout.splitlines()[0] == (
        f"KV cache: 300 blocks of 16 tokens (4800 tokens), {kv}, {mib:.1f} MiB per rank")


def test_vllm_flags_without_effect_are_taken_with_a_warning(tiny_model_dir):
    """A `vllm serve` command line's --trust-remote-code, --gpu-memory-utilization and
    --disable-custom-all-reduce start the server (here --dry-run) with one warning naming
    them; a misspelt flag is still refused."""
    base = [sys.executable, "start.py", "--model", str(tiny_model_dir), "--device", "cpu",
            "--num-blocks", "300", "--dry-run"]
    res = subprocess.run(base + ["--trust-remote-code", "--gpu-memory-utilization", "0.9",
                                 "--disable-custom-all-reduce"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if "no effect" in line]
    assert len(warned) == 1 and all(k in warned[0] for k in (
        "gpu_memory_utilization", "trust_remote_code", "disable_custom_all_reduce"))
    assert res.stdout.startswith("KV cache: 300 blocks")
    res = subprocess.run(base + ["--gpu-memory-utilisation", "0.9"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--gpu-memory-utilisation" in res.stderr, res.stderr


_AUTO = """
import sys
from llm_serving.config import EngineArgs
from llm_serving.executor.launch_plan import plan_launch
config = EngineArgs(model=sys.argv[1], device="auto", num_blocks=64).create_engine_config()
print(config.device.device, plan_launch(config, "python").device, "mindspore" in sys.modules)
"""


def _decide_auto(model_dir, ld_library_path=None):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    if ld_library_path:
        env["LD_LIBRARY_PATH"] = str(ld_library_path)
    res = subprocess.run([sys.executable, "-c", _AUTO, str(model_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()


def test_auto_device_is_decided_without_importing_mindspore(tiny_model_dir, tmp_path):
    """The serving master resolves --device auto (the KV dtype and pool, the launch plan)
    without MindSpore's import: here, with no CANN libraries, CPU, and the agents are told
    "cpu"; with CANN's runtime and driver libraries on the library path (set_env.sh), Ascend,
    when the installed MindSpore has its Ascend plugin."""
    assert _decide_auto(tiny_model_dir) == ["cpu", "CPU", "False"]
    from llm_serving.device_target import CANN_LIBRARIES, has_ascend_plugin
    if not has_ascend_plugin():
        pytest.skip("this MindSpore has no Ascend plugin")
    cann = tmp_path / "cann"
    cann.mkdir()
    for name in CANN_LIBRARIES[:-1]:
        (cann / name).write_bytes(b"")
    assert _decide_auto(tiny_model_dir, cann) == ["cpu", "CPU", "False"]   # no driver
    (cann / CANN_LIBRARIES[-1]).write_bytes(b"")
    assert _decide_auto(tiny_model_dir, cann) == ["ascend", "Ascend", "False"]
