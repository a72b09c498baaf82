"""Host memory on huge pages (model_executor/host_memory.py): the packed weights' arena.

A model's packed linear weights (and the LM head's packed copy) are carved one after another
from 2 MB-aligned mappings advised for transparent huge pages, instead of NumPy's heap, where
most of a small model's weights sat on 4 KB pages. The layers must compute on that memory, and
the memory must go when the weights go."""
import numpy as np
import pytest
from mindspore import Tensor

from llm_serving.model_executor import host_memory
from llm_serving.model_executor.device import init_device
from llm_serving.model_executor.layers import linear as L


@pytest.fixture(scope="module", autouse=True)
def cpu():
    init_device("cpu")


def _mapped(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_arena_places_weights_back_to_back_on_aligned_chunks():
    arena = host_memory.WeightArena(chunk_bytes=4 << 20)
    a = arena.empty((100, 3), np.float32)           # 1200 bytes: the next starts 1216 on
    b = arena.empty((7,), np.uint16)
    c = arena.empty((2, 64), np.float32)
    assert a.ctypes.data % host_memory.HUGE_PAGE == 0          # a fresh chunk's first byte
    assert b.ctypes.data == a.ctypes.data + 1216
    assert c.ctypes.data == b.ctypes.data + 64
    assert (a.shape, a.dtype, b.dtype) == ((100, 3), np.float32, np.uint16)
    a[...] = 1.0
    b[...] = 7
    c[...] = 2.0                       # writes stay inside each array
    assert a.sum() == 300 and b.sum() == 49 and c.sum() == 256
    # larger than a chunk: a chunk of its own, rounded up to whole huge pages; the arena then
    # fills that one
    big = arena.empty((5 << 20,), np.uint8)
    after = arena.empty((16,), np.float32)
    assert big.ctypes.data % host_memory.HUGE_PAGE == 0
    assert big.ctypes.data not in range(a.ctypes.data, a.ctypes.data + (4 << 20))
    assert after.ctypes.data == big.ctypes.data + (5 << 20)


def test_a_chunk_is_unmapped_when_its_weights_are_gone():
    arena = host_memory.WeightArena(chunk_bytes=4 << 20)
    w = arena.empty((1024, 256), np.float32)
    w[...] = 1.0
    addr = w.ctypes.data
    assert _mapped(addr)
    arena.empty((5 << 20,), np.uint8)       # the arena moves on to another chunk
    del w
    assert not _mapped(addr)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_linear_layers_compute_on_arena_memory(bf16, monkeypatch):
    arena = host_memory.WeightArena(chunk_bytes=4 << 20)
    monkeypatch.setattr(L, "WEIGHTS", arena)
    rng = np.random.default_rng(5)
    layer = L.Linear(96, [80])
    if bf16:
        layer.use_bf16_weight()
    w = rng.standard_normal((80, 96)).astype(np.float32)
    layer.set_weight(w)
    ptr = layer.weight.data_ptr()
    nbytes = layer.weight.asnumpy().nbytes
    assert ptr % host_memory.HUGE_PAGE == 0            # the fresh arena's first array
    assert arena.empty((1,), np.uint8).ctypes.data == ptr + -(-nbytes // 64) * 64
    x = rng.standard_normal((5, 96)).astype(np.float32)
    ref = L.float32_to_bfloat16_bits(w).astype(np.uint32) << 16 if bf16 else None
    wt = ref.view(np.float32) if bf16 else w
    tol = 3e-2 if bf16 else 1e-4        # bf16 kernels may round x to bf16 too
    np.testing.assert_allclose(layer(Tensor(x)).asnumpy(), x.astype(np.float64) @ wt.T,
                               rtol=tol, atol=tol)
