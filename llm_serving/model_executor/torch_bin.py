"""PyTorch ``pytorch_model*.bin`` checkpoints (torch.save's zip format), read without torch;
also a single torch.save'd tensor (vLLM's ``prompt_embeds`` payload, ``read_torch_tensor``).

Baichuan2's published checkpoints, like many of its time, are ``.bin`` files only. The file is
a zip (stored, not compressed) holding ``<name>/data.pkl``, a pickle of the state dict whose
tensors refer to storages ``<name>/data/<key>`` by persistent id. Here the pickle is read by
an unpickler that knows only the few globals a state dict needs (anything else is refused,
so no code in the file runs), and every tensor is a view of the file's memory map (bf16
widened to a new float32 array), as safetensors files are read.
"""
from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Iterator, Tuple

import ml_dtypes
import numpy as np

from llm_serving.errors import ModelLoadError

_STORAGE_DTYPES = {
    "FloatStorage": np.dtype("<f4"), "HalfStorage": np.dtype("<f2"),
    "BFloat16Storage": np.dtype("<u2"), "DoubleStorage": np.dtype("<f8"),
    "LongStorage": np.dtype("<i8"), "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"), "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"), "BoolStorage": np.dtype("?"),
}


class _Storage:
    def __init__(self, kind: str):
        self.kind = kind


class _Tensor:
    """A tensor as the pickle describes it: (storage key, dtype name, offset, size, stride)."""

    def __init__(self, storage, offset, size, stride, *_):
        self.storage, self.offset = storage, int(offset)
        self.size, self.stride = tuple(size), tuple(stride)


def _rebuild_parameter(data, *_):
    return data


_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _Tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): (lambda name=name: _Storage(name)) for name in _STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        found = _GLOBALS.get((module, name))
        if found is None:
            raise ModelLoadError(f"{self.path}: the pickle names {module}.{name}, which is not "
                                 "part of a plain state dict of tensors; refused")
        if name in _STORAGE_DTYPES:
            return found()
        return found

    def persistent_load(self, pid):
        # ('storage', storage type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"
                and isinstance(pid[1], _Storage)):
            raise ModelLoadError(f"{self.path}: unexpected persistent id {pid!r}")
        return (str(pid[2]), pid[1].kind)


def _member_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) member's bytes start in the file."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ModelLoadError(f"{path}: {info.filename} is compressed; torch.save stores them")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _load_pickle(z: zipfile.ZipFile, where) -> tuple:
    """The unpickled object of a torch.save zip, and the prefix of its members."""
    pkl = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl is None:
        raise ModelLoadError(f"{where}: no data.pkl in the torch.save zip")
    unpickler = _Unpickler(z.open(pkl))
    unpickler.path = where
    try:
        return unpickler.load(), pkl[: -len("data.pkl")]
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{where}: cannot read the pickle ({e})") from e


def _view(t: _Tensor, storage: np.ndarray, where, name, keep_bf16: bool = False) -> np.ndarray:
    """Tensor ``t`` as a read-only view of its storage's elements (bf16 widened to float32, or
    with ``keep_bf16`` viewed as ``ml_dtypes.bfloat16``)."""
    key, kind = t.storage
    dt = storage.dtype
    count = int(np.prod(t.size, dtype=np.int64)) if t.size else 1
    last = t.offset + sum((s - 1) * st for s, st in zip(t.size, t.stride)) if count else 0
    if t.offset < 0 or any(st < 0 for st in t.stride) or (count and last >= len(storage)):
        raise ModelLoadError(f"{where}: tensor {name!r} lies outside its storage")
    arr = np.lib.stride_tricks.as_strided(
        storage[t.offset:], shape=t.size, strides=[s * dt.itemsize for s in t.stride],
        writeable=False)
    if kind == "BFloat16Storage" and keep_bf16:
        arr = arr.view(ml_dtypes.bfloat16)
    elif kind == "BFloat16Storage":
        arr = (np.ascontiguousarray(arr).astype(np.uint32) << 16).view(np.float32)
    return arr


def read_torch_tensor(data: bytes, where: str = "the payload") -> np.ndarray:
    """The one tensor of ``torch.save(tensor)``'s bytes (zip format), as a NumPy array: what
    ``torch.load(..., weights_only=True)`` returns, read with the same refusal of anything
    but plain tensors. A ValueError (``ModelLoadError`` is not one) says what is wrong."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            # torch.save stores its members; a compressed one could inflate past any bound
            if any(i.compress_type != zipfile.ZIP_STORED for i in z.infolist()):
                raise ModelLoadError(f"{where}: the zip has compressed members, which "
                                     "torch.save does not write")
            obj, prefix = _load_pickle(z, where)
            if not isinstance(obj, _Tensor):
                raise ModelLoadError(f"{where}: holds a {type(obj).__name__}, not a tensor")
            key, kind = obj.storage
            raw = z.read(f"{prefix}data/{key}")
    except zipfile.BadZipFile:
        raise ValueError(f"{where}: not a torch.save file (zip format)") from None
    except KeyError:
        raise ValueError(f"{where}: the tensor refers to a missing storage") from None
    except ModelLoadError as e:
        raise ValueError(str(e)) from None
    dt = _STORAGE_DTYPES[kind]
    storage = np.frombuffer(raw, dtype=dt, count=len(raw) // dt.itemsize)
    try:
        return _view(obj, storage, where, "tensor")
    except ModelLoadError as e:
        raise ValueError(str(e)) from None


def read_torch_bin(path, keep_bf16: bool = False) -> Iterator[Tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of a torch.save'd state dict (zip format); bf16 as
    ``_view`` reads it."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise ModelLoadError(f"{path}: not a torch zip checkpoint (torch.save before 1.6 wrote "
                             "another format: re-save it, or convert it to safetensors)")
    with zipfile.ZipFile(path) as z:
        state, prefix = _load_pickle(z, path)
        if isinstance(state, dict) and "state_dict" in state and len(state) == 1:
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise ModelLoadError(f"{path}: expected a state dict, got {type(state).__name__}")
        infos = {n: z.getinfo(n) for n in z.namelist()}
    for name, t in state.items():
        if not isinstance(t, _Tensor):
            continue                        # (a non-tensor entry, e.g. a version number)
        key, kind = t.storage
        dt = _STORAGE_DTYPES[kind]
        member = infos.get(f"{prefix}data/{key}")
        if member is None:
            raise ModelLoadError(f"{path}: tensor {name!r} refers to a missing storage {key}")
        start, count = _member_offset(path, member), member.file_size // dt.itemsize
        # a map of its own, so that its pages leave RSS once the tensor is dropped
        storage = np.asarray(np.memmap(path, dtype=dt, mode="r", offset=start, shape=(count,))
                             ) if count else np.zeros(0, dt)
        yield name, _view(t, storage, path, name, keep_bf16)
