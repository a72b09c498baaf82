"""The accuracy harness: logits dumped at batch 1 and batch 16 pair up and match; a perturbed
weight is caught."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from llm_serving import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def prompts():
    rows = json.loads((ROOT / "clients" / "data" / "alpaca_521.json").read_text())[:16]
    return [r["instruction"] + ":" + r["input"] for r in rows]


def dump(model_dir, out, max_num_seqs, one_by_one=False, backend="uni"):
    llm = LLM(model_dir, num_blocks=256, max_num_seqs=max_num_seqs, dump_logits=str(out),
              dump_logits_every=4, distributed_executor_backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    if one_by_one:
        for p in prompts():
            llm.generate(p, params)
    else:
        llm.generate(prompts(), params)
    llm.engine.shutdown()


def compare(a, b):
    return subprocess.run([sys.executable, str(ROOT / "clients" / "compare_logits.py"),
                           str(a), str(b), "--atol", "5e-3"], capture_output=True, text=True)


def test_dumps_pair_across_batch_sizes_and_catch_a_perturbed_weight(tiny_model_dir, tmp_path):
    dump(tiny_model_dir, tmp_path / "b1", 1, one_by_one=True)
    dump(tiny_model_dir, tmp_path / "b16", 16)
    files = sorted(p.name for p in (tmp_path / "b1").glob("*.npy"))
    assert len(files) == 16 * 3                       # positions 0, 4 and 8 of each request
    same = compare(tmp_path / "b1", tmp_path / "b16")
    assert same.returncode == 0, same.stdout
    assert "48 files paired, 0 mismatched" in same.stdout
    dump(tiny_model_dir, tmp_path / "agent", 16, backend="mp")    # as the server does it
    assert compare(tmp_path / "b1", tmp_path / "agent").returncode == 0

    bad_model = tmp_path / "perturbed"
    shutil.copytree(tiny_model_dir, bad_model)
    shard = next(bad_model.glob("*.safetensors"))
    weights = load_file(str(shard))
    name = next(k for k in weights if "layers.1.mlp.down_proj" in k)
    weights[name] = weights[name] + np.float32(0.05)
    save_file(weights, str(shard))
    dump(str(bad_model), tmp_path / "bad", 16)
    diff = compare(tmp_path / "b1", tmp_path / "bad")
    assert diff.returncode == 1 and "MISMATCH" in diff.stdout
    # a mistyped directory is named as such (it was 48 "ONLY IN A" lines)
    typo = compare(tmp_path / "b1", tmp_path / "b61")
    assert typo.returncode == 2 and "b61: no such directory" in typo.stderr
