"""PyTorch pytorch_model*.bin checkpoints (Baichuan2 publishes only these) read without
torch: every tensor equal to torch.load's, a sharded bf16 Baichuan2 giving the logits of the
same weights in safetensors, and a pickle that would run code refused unrun."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from llm_serving import LLM
from llm_serving.errors import ModelLoadError
from llm_serving.model_executor.torch_bin import read_torch_bin, read_torch_tensor
from test_loader import _rss_file_kb
from test_model_parity import _prefill_logits, _prompts

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def test_tensors_equal_torch_loads(tmp_path):
    state = {"f32": torch.randn(3, 4), "bf16": torch.randn(5, 6).to(torch.bfloat16),
             "f16": torch.randn(2, 7).half(), "transposed": torch.randn(4, 3).t(),
             "slice": torch.arange(10)[2:7], "shared": None, "scalar": torch.tensor(2.5),
             "param": torch.nn.Parameter(torch.randn(2, 2))}
    state["shared"] = state["f32"][1]           # a view into another tensor's storage
    torch.save(state, tmp_path / "w.bin")
    ours = dict(read_torch_bin(tmp_path / "w.bin"))
    ref = torch.load(tmp_path / "w.bin", weights_only=True)
    assert list(ours) == list(ref)
    for name, t in ref.items():
        expect = t.detach().float() if t.dtype == torch.bfloat16 else t.detach()
        assert ours[name].dtype == expect.numpy().dtype, name
        np.testing.assert_array_equal(ours[name], expect.numpy(), err_msg=name)
    kept = dict(read_torch_bin(tmp_path / "w.bin", keep_bf16=True))   # bf16 bits as they are
    np.testing.assert_array_equal(kept["bf16"].view(np.int16),
                                  ref["bf16"].view(torch.int16).numpy())
    torch.save({"empty": torch.zeros(0)}, tmp_path / "empty.bin")
    assert dict(read_torch_bin(tmp_path / "empty.bin"))["empty"].shape == (0,)


def test_a_tensor_read_leaves_rss_once_dropped(tmp_path):
    """Each storage is its own memory map, as each safetensors tensor is: 8 tensors of 8 MB
    read and dropped one by one hold about one tensor's pages."""
    torch.save({f"t{i}": torch.full((2 * 2**20,), float(i)) for i in range(8)},
               tmp_path / "w.bin")
    base, peak = _rss_file_kb(), 0
    for name, arr in read_torch_bin(tmp_path / "w.bin"):
        assert float(arr.sum()) == int(name[1:]) * arr.size       # every page touched
        peak = max(peak, _rss_file_kb() - base)
        del arr
    assert 8 * 1024 <= peak < 24 * 1024, peak


def test_sharded_bf16_baichuan2_bins_give_the_safetensors_logits(tmp_path):
    from llm_serving.model_executor.tiny_model import PRESETS, make_tiny_model
    st = make_tiny_model(str(tmp_path / "st"), dtype="bfloat16", **PRESETS["tiny-baichuan2"])
    b = tmp_path / "bin"
    shutil.copytree(st, b)
    (b / "model.safetensors").unlink()
    weights = safetensors_torch.load_file(str(Path(st) / "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({n: weights[n] for n in part}, b / fname)
        weight_map.update({n: fname for n in part})
    (b / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompts = _prompts(1024)[2:5]
    want = _prefill_logits(LLM(st, num_blocks=64), prompts)
    got = _prefill_logits(LLM(str(b), num_blocks=64), prompts)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    evil = _RunsCode()
    evil.marker = tmp_path / "ran"
    with zipfile.ZipFile(tmp_path / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": evil}, protocol=2))
    with pytest.raises(ModelLoadError, match="system"):
        dict(read_torch_bin(tmp_path / "pytorch_model.bin"))
    assert not evil.marker.exists()


def test_one_saved_tensor_equals_torch_loads():
    """torch.save(tensor)'s bytes (vLLM's prompt_embeds payload) read as torch.load(...,
    weights_only=True) reads them; anything but a plain tensor is refused, unrun."""
    for t in (torch.randn(3, 4), torch.randn(1, 5, 6).to(torch.bfloat16),
              torch.randn(2, 7).half(), torch.randn(4, 3).t(), torch.randn(9, 2)[3:6],
              torch.randn(2, 2, requires_grad=True)):
        buf = io.BytesIO()
        torch.save(t, buf)
        ref = torch.load(io.BytesIO(buf.getvalue()), weights_only=True).detach()
        np.testing.assert_array_equal(read_torch_tensor(buf.getvalue()),
                                      (ref.float() if ref.dtype == torch.bfloat16
                                       else ref).numpy())
    evil = _RunsCode()
    evil.marker = "/nonexistent/ran"
    for obj, why in (({"t": torch.ones(2)}, "holds a dict"),
                     (torch.ones(2, 2).to_sparse(), "refused"), (evil, "system")):
        buf = io.BytesIO()
        torch.save(obj, buf)
        with pytest.raises(ValueError, match=why):
            read_torch_tensor(buf.getvalue())
    with pytest.raises(ValueError, match="not a torch.save file"):
        read_torch_tensor(b"not a zip")
    bomb = io.BytesIO()         # a deflated member would inflate past the payload's size
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * (1 << 20))
    with pytest.raises(ValueError, match="compressed"):
        read_torch_tensor(bomb.getvalue())
