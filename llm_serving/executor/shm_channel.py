"""The master <-> WorkAgent channel: step data in shared memory, announcements on a framed
control connection.

Each direction has one POSIX shared-memory segment of a fixed size computed from the config's
bounds (tokens per step, sequences, blocks), never a fixed number of GiB. A message is a list
of numpy arrays packed one after another (a small header per array: dtype, shape, offset). The
control connection carries only small length-prefixed frames: a kind byte, the step number and
the payload size (``multiprocessing.connection``'s ``send_bytes``; nothing is pickled).

Arrays read from a segment are views into it: they stay valid until the next message in the
same direction, which the protocol never sends before the reader has replied.
"""
from __future__ import annotations

import os
import secrets
import struct
from multiprocessing import resource_tracker, shared_memory
from typing import Optional, Sequence

import numpy as np

from llm_serving.errors import ConfigError
from llm_serving.executor.protocol import (SamplerOutput, SamplingBatch, StepInput,
                                           array_fields, ragged_fields)
from llm_serving.sampling_params import MAX_LOGPROBS

SHM_PREFIX = "llm_serving_"


def segment_prefix(pid: Optional[int] = None) -> str:
    """Names of the segments a master process creates start with this (its pid included, so
    that concurrent servers and test runs can tell their segments apart)."""
    return f"{SHM_PREFIX}{os.getpid() if pid is None else pid}_"


def segments_of(pid: Optional[int] = None) -> set[str]:
    """The segments in /dev/shm created by master process ``pid`` (default: this one)."""
    prefix = segment_prefix(pid)
    return {f for f in os.listdir("/dev/shm") if f.startswith(prefix)}


def remove_segments(pid: int) -> list[str]:
    """Unlink every segment of master process ``pid``; return their names."""
    left = sorted(segments_of(pid))
    for name in left:
        try:
            os.unlink(f"/dev/shm/{name}")
        except (FileNotFoundError, PermissionError):
            pass
    return left


def remove_stale_segments() -> list[str]:
    """Unlink the segments of masters that no longer run. A master frees its segments when it
    shuts down, even on an error, and its resource tracker frees them if it alone is killed;
    a kill of the whole process group (SIGKILL to the server and the tracker, a machine's
    container stopped) leaves them in /dev/shm, where they hold memory until reboot."""
    heads = {name[len(SHM_PREFIX):].split("_", 1)[0]
             for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}
    pids = {int(h) for h in heads if h.isdigit()}
    removed = []
    for pid in sorted(pids):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            removed += remove_segments(pid)
        except PermissionError:         # another user's live process
            pass
    return removed


_ALIGN = 64
_DTYPES = [np.dtype(t) for t in ("int32", "int64", "float32", "float64", "bool", "uint8")]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_HEAD = struct.Struct("<q")          # number of arrays
_ARR = struct.Struct("<bbxxxxxxqqqq")  # dtype code (-1 = None), ndim, pad, offset, shape[0..2]

# Control frames: kind, step number, payload bytes. MASK n: step n's token bitmask (a step
# with ``mask_after_forward``) is now written in its input segment. LORA_FAILED n, before
# step n's DONE: JSON {adapter id: why} of the LoRA adapters the agent could not read.
# PROFILE (nothing in flight): JSON {"start": bool, "prefix"}; the agent answers PROFILE with
# the path of the trace it wrote (stop), or ERROR. RPC n (nothing in flight): call n of
# collective_rpc, pickled; the agent answers RPC n, its size field 1 and the pickled result,
# or 0 and the error (executor/collective_rpc.py).
FRAME = struct.Struct("<cqq")
READY, STEP, DONE, ERROR, QUIT, MASK = b"R", b"S", b"D", b"E", b"Q", b"M"
LORA_FAILED, PROFILE, RPC = b"L", b"P", b"C"


class ChannelFullError(RuntimeError):
    pass


class ShmSegment:
    """One shared-memory segment, created by the master and attached by an agent."""

    def __init__(self, size: int = 0, name: Optional[str] = None):
        if name is None:
            self.shm = shared_memory.SharedMemory(
                name=f"{segment_prefix()}{secrets.token_hex(6)}", create=True, size=size)
            self.owner = True
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            # Attaching registers the segment with this process's resource tracker, which
            # would unlink it when this process exits; the master owns it.
            resource_tracker.unregister(self.shm._name, "shared_memory")
            self.owner = False
        self.name = self.shm.name
        self.buf = self.shm.buf

    @property
    def size(self) -> int:
        return self.shm.size

    def close(self) -> None:
        self.buf = None
        try:
            self.shm.close()
        except BufferError:       # a view into it is still alive; unlinking still frees it
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def pack(buf, arrays: Sequence[Optional[np.ndarray]]) -> int:
    """Write the arrays (at most 3 dims, or None) into ``buf``; return the bytes used."""
    n = len(arrays)
    pos = _HEAD.size + n * _ARR.size
    _HEAD.pack_into(buf, 0, n)
    for i, a in enumerate(arrays):
        slot = _HEAD.size + i * _ARR.size
        if a is None:
            _ARR.pack_into(buf, slot, -1, 0, 0, 0, 0, 0)
            continue
        a = np.ascontiguousarray(a)
        shape = tuple(a.shape) + (0,) * (3 - a.ndim)
        pos = -(-pos // _ALIGN) * _ALIGN
        end = pos + a.nbytes
        if end > len(buf):
            raise ChannelFullError(f"a step needs more than the channel's {len(buf)} bytes")
        _ARR.pack_into(buf, slot, _DTYPE_CODE[a.dtype], a.ndim, pos, *shape)
        np.frombuffer(buf, np.uint8, a.nbytes, pos)[:] = a.reshape(-1).view(np.uint8)
        pos = end
    return pos


def unpack(buf) -> list[Optional[np.ndarray]]:
    (n,) = _HEAD.unpack_from(buf, 0)
    out = []
    for i in range(n):
        code, ndim, pos, *shape = _ARR.unpack_from(buf, _HEAD.size + i * _ARR.size)
        if code < 0:
            out.append(None)
            continue
        dtype, shape = _DTYPES[code], shape[:ndim]
        count = int(np.prod(shape)) if shape else 1
        out.append(np.frombuffer(buf, dtype, count, pos).reshape(shape))
    return out


# ---- StepInput <-> arrays ----------------------------------------------------------------

# Derived from the protocol's dataclasses: a field added there travels without a change here.
_STEP_FIELDS = array_fields(StepInput)
_BATCH_FIELDS = array_fields(SamplingBatch)
_RAGGED_FIELDS = ragged_fields(SamplingBatch)
_MASK_INDEX = len(_STEP_FIELDS) + _BATCH_FIELDS.index("token_bitmask")


def _ragged(rows: Optional[list]) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    if rows is None:
        return None, None
    lens = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.concatenate(rows).astype(np.int64) if len(rows) else np.zeros(0, np.int64)
    return flat, offsets


def step_to_arrays(step: StepInput) -> list[Optional[np.ndarray]]:
    arrays = [getattr(step, f) for f in _STEP_FIELDS]
    s = step.sampling
    if s is None:
        return arrays
    arrays += [getattr(s, f) for f in _BATCH_FIELDS]
    for f in _RAGGED_FIELDS:
        arrays += list(_ragged(getattr(s, f)))
    return arrays


def bitmask_view(buf) -> np.ndarray:
    """The token bitmask of the step packed in ``buf`` (a writable view into it), for a step
    whose mask is sent after its forward."""
    (n,) = _HEAD.unpack_from(buf, 0)
    code = -1
    if _MASK_INDEX < n:
        code, ndim, pos, *shape = _ARR.unpack_from(buf, _HEAD.size + _MASK_INDEX * _ARR.size)
    if code < 0:
        raise ValueError("the packed step has no token bitmask")
    shape = shape[:ndim]
    return np.frombuffer(buf, _DTYPES[code], int(np.prod(shape)), pos).reshape(shape)


def step_from_arrays(arrays: list[Optional[np.ndarray]]) -> StepInput:
    k = len(_STEP_FIELDS)
    step = StepInput(**dict(zip(_STEP_FIELDS, arrays[:k])))
    if len(arrays) > k:
        kw = dict(zip(_BATCH_FIELDS, arrays[k:k + len(_BATCH_FIELDS)]))
        rest = arrays[k + len(_BATCH_FIELDS):]
        for i, f in enumerate(_RAGGED_FIELDS):
            flat, offsets = rest[2 * i], rest[2 * i + 1]
            kw[f] = None if flat is None else [flat[offsets[j]:offsets[j + 1]]
                                               for j in range(len(offsets) - 1)]
        step.sampling = SamplingBatch(**kw)
    return step


_RESULT_FIELDS = array_fields(SamplerOutput)

# The most bytes a result segment may take (there are two): max_logprobs alternatives for
# every sequence and prompt token of a step must fit in it.
MAX_RESULT_CHANNEL_BYTES = 1 << 30


def result_to_arrays(result: Optional[SamplerOutput]) -> list[Optional[np.ndarray]]:
    if result is None:
        return []
    return [getattr(result, f) for f in _RESULT_FIELDS]


def result_from_arrays(arrays: list[Optional[np.ndarray]]) -> Optional[SamplerOutput]:
    if not arrays:
        return None
    # Copies: the segment is rewritten by the next step, results are small.
    return SamplerOutput(**{f: None if a is None else a.copy()
                            for f, a in zip(_RESULT_FIELDS, arrays)})


def step_channel_bytes(max_tokens: int, max_seqs: int, max_model_len: int, block_size: int,
                       num_blocks: int, vocab_size: int = 0, kv_meta_bytes: int = 0) -> int:
    """An upper bound on one packed StepInput under the engine's limits."""
    width = -(-max_model_len // block_size)
    ints = (6 * max_tokens                       # ids, positions, slots, prompt logprob rows
            + max_seqs * width                   # block tables
            + 8 * max_seqs + 2                   # query_start_loc, seq_lens, sample rows,
                                                 # pending positions and sources, pooled
                                                 # row ranges
            + 4                                  # ms_split, mask_after_forward (int64s)
            + 3 * 2 * num_blocks)                # swap out / in, copies (int32 pairs)
    per_row = 10 * 8 + 2 * max_model_len * 8 + 64 * 8 + 3 * 16   # params, penalties, bans
    per_row += 300 * 12 + 4 + 4 * -(-vocab_size // 32) + 2 * 100 * 8
    # ^ logit_bias (<= 300 entries), the token bitmask, bans of bad_words (<= 100 words x 2)
    headers = 64 * (_ARR.size + _ALIGN)
    return 4 * ints + max_seqs * per_row + headers + kv_meta_bytes + (1 << 16)


def result_channel_bytes(max_seqs: int, max_logprobs: int = MAX_LOGPROBS, dump_vocab: int = 0,
                         max_tokens: int = 0, pooled_size: int = 0) -> int:
    """An upper bound on one packed SamplerOutput; ``dump_vocab`` > 0 when logits are dumped;
    ``max_tokens`` (tokens per step) bounds the prompt logprob rows; ``pooled_size`` (a
    pooling runner's hidden size) the pooled vectors, one per sequence."""
    per_row = 8 + 4 + 8 + max_logprobs * 12 + 4 * dump_vocab + 4 * pooled_size
    per_prompt_row = 4 + 8 + max_logprobs * 12
    return (max_seqs * per_row + max_tokens * per_prompt_row
            + len(_RESULT_FIELDS) * (_ARR.size + _ALIGN) + (1 << 12))


def check_result_channel(max_logprobs: int, max_seqs: int, max_tokens: int,
                         pooled_size: int = 0) -> None:
    """Refuse a max_logprobs (or a pooling runner's hidden size) whose result channel would
    exceed MAX_RESULT_CHANNEL_BYTES."""
    size = result_channel_bytes(max_seqs, max_logprobs, max_tokens=max_tokens,
                                pooled_size=pooled_size)
    if size > MAX_RESULT_CHANNEL_BYTES and pooled_size:
        raise ConfigError("max_num_seqs", f"{max_seqs} sequences' pooled vectors of "
                          f"{pooled_size} floats and {max_logprobs} logprobs need a result "
                          f"channel of {size / 2**30:.1f} GiB, more than its "
                          f"{MAX_RESULT_CHANNEL_BYTES >> 30} GiB cap; lower max_num_seqs")
    if size > MAX_RESULT_CHANNEL_BYTES:
        raise ConfigError("max_logprobs", f"{max_logprobs} alternatives for each of "
                          f"{max_seqs} sequences and {max_tokens} prompt tokens a step need a "
                          f"result channel of {size / 2**30:.1f} GiB, more than its "
                          f"{MAX_RESULT_CHANNEL_BYTES >> 30} GiB cap; lower max_logprobs, "
                          "max_num_batched_tokens or max_num_seqs")
