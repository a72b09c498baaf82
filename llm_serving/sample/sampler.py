"""Per-request sampling on the host, in NumPy, vectorized across the batch.

Every row of a batch is sampled with its own parameters (temperature, top-k, top-p, min-p,
penalties, seed); nothing is taken per batch. The order follows vLLM:

1. logit_bias added, banned ids (min_tokens: EOS + stop ids, bad_words) and the tokens a
   row's bitmask leaves out (grammar, allowed_token_ids) set to -inf; then the penalties:
   repetition (prompt + output tokens: positive logits divided, negative multiplied), then
   frequency (times the count in the output) and presence (once if in the output)
   subtracted (vLLM V1 adds the bias before the penalties too);
2. greedy rows (temperature < 1e-5): argmax, ties to the lowest id;
3. random rows: divide by temperature, keep the top-k, then the top-p nucleus (smallest set
   whose probability reaches top_p, at least one token), then drop tokens below
   min_p * max prob, and draw one token by inverse CDF.

Log-probabilities are vLLM V1's default "raw_logprobs": log_softmax of the logits exactly as
the model returned them, before penalties, bans, temperature and filters. The chosen token's
logprob is computed for every row by default; ranks and the top-N only for rows that asked
(num_logprobs >= 0).

Speed. Each step may be 256 rows x 150k vocab, so the code avoids what is slow in NumPy on a
full row: sorting (np.sort ~6 ns/element, argsort ~19, argpartition ~9), cumsum (~3), one
random number per vocab entry (~5). Instead:
- rows are processed in blocks of about 2 MB so the 4-5 elementwise passes stay in cache;
- top-k / top-p: the sorted maxima of small column chunks give an exact lower bound t on
  the smallest probability that can be kept; only the "upper set" {p >= t}, about as many
  tokens as are kept, is sorted, and the row is sampled straight from it. Flat
  distributions (nucleus of thousands of tokens) fall back to sorting the row;
- other rows need one uniform number each: the CDF is walked in two levels (slab sums,
  then one slab of `_slab_width(V)` entries);
- top-N logprobs use the same chunk-maxima idea (`_top_values`), never a full argsort.

Ties at a top-k / top-p boundary are all kept (vLLM keeps an arbitrary subset of them).

Seeds. A seeded row's uniform number is a hash of (seed, output_len), so it depends on
nothing else: it reproduces whatever shares the batch and keeps no state between steps.
Unseeded rows draw from one generator owned by the Sampler.

Not thread-safe: a Sampler reuses its scratch buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from llm_serving.executor.protocol import SamplerOutput, SamplingBatch
from llm_serving.sampling_params import SAMPLING_EPS

_BLOCK_BYTES = 2 << 20              # rows per block: about this much float32 scratch
_EMPTY_IDS = np.zeros(0, np.int64)


def _put_asked(top_ids, top_lp, raw, lse, blk, token_lists) -> None:
    """Rows of ``blk`` with ids in ``token_lists`` report those (in the request's order) in
    place of their top-N: their logprobs taken from the block's raw logits ``raw``."""
    for j, row in enumerate(blk):
        ids = token_lists[row]
        if len(ids):
            top_ids[row, :] = -1
            top_lp[row, :] = -np.inf
            top_ids[row, :len(ids)] = ids
            top_lp[row, :len(ids)] = raw[j, ids] - lse[j]


# ======================================================================= the sampler

class Sampler:
    """Samples one token per row from [B, V] logits; see the module docstring."""

    def __init__(self, seed: Optional[int] = None, always_chosen_logprob: bool = True):
        """seed: seeds the generator shared by unseeded rows (None = from the OS).
        always_chosen_logprob: compute the chosen token's logprob for every row (about one
        exp pass over the row; what an engine needs for cumulative_logprob on every request,
        as vLLM V0 reported it). False computes it only for rows with num_logprobs >= 0 (vLLM
        V1 reports cumulative_logprob=None otherwise) and leaves NaN in the other rows."""
        self._rng = np.random.default_rng(seed)
        self._scratch: dict = {}
        self.always_chosen_logprob = always_chosen_logprob
        # The user's logits processors (custom_logits_processors.py); None: none configured
        self.custom = None

    def __call__(self, logits: np.ndarray, batch: SamplingBatch) -> SamplerOutput:
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != len(batch):
            raise ValueError(f"logits must be [B, V] with B = {len(batch)} rows, "
                             f"got shape {logits.shape}")
        logits = np.ascontiguousarray(logits, dtype=np.float32)   # no copy if it already is
        if self.custom is not None:
            return self._sample_custom(logits, batch)
        b = logits.shape[0]
        modified = batch.modified_rows

        greedy = batch.temperature < SAMPLING_EPS
        if greedy.all() and not modified.any():     # plain greedy rows (the usual decode)
            return self.compute_logprobs(logits, logits.argmax(axis=1), batch.num_logprobs,
                                         batch.logprob_token_ids)
        token_ids = np.empty(b, np.int64)
        rows = np.flatnonzero(greedy)
        if rows.size:
            token_ids[rows] = self._sample_greedy(logits, rows, batch, modified[rows])
        rows = np.flatnonzero(~greedy)
        if rows.size:
            token_ids[rows] = self._sample_random(logits, rows, batch, modified[rows])
        return self.compute_logprobs(logits, token_ids, batch.num_logprobs,
                                     batch.logprob_token_ids)

    def _sample_custom(self, logits: np.ndarray, batch: SamplingBatch) -> SamplerOutput:
        """With custom logits processors, in vLLM V1's order: on a copy of the raw logits,
        logit_bias, bans and token masks, then the processors that may change the argmax,
        then the penalties; greedy rows take the argmax; then temperature, the
        argmax-invariant processors (only when some row samples at random), and the random
        rows' filters and draw. Logprobs stay raw."""
        custom = self.custom
        custom.update(batch.row_keys, batch.added_requests)
        x = logits.copy()
        _on_rows(x, np.flatnonzero(batch.modified_rows), batch, _apply_bias_and_bans)
        x = custom.apply(x, invariant=False)
        _on_rows(x, np.flatnonzero(batch.penalized_rows), batch, _apply_penalties)
        greedy = batch.temperature < SAMPLING_EPS
        token_ids = x.argmax(axis=1)
        banned = ~np.isfinite(x[np.arange(len(x)), token_ids])   # every token banned
        token_ids[banned] = logits[banned].argmax(axis=1)
        random = np.flatnonzero(~greedy)
        if random.size:
            # (times 1/T in float32, as _sample_block scales: the same samples as without
            # processors for the rows they leave alone)
            x *= (1.0 / np.where(greedy, 1.0, batch.temperature)).astype(np.float32)[:, None]
            if custom.has_invariant:
                x = custom.apply(x, invariant=True)
            scaled = dataclasses.replace(batch, temperature=np.ones(len(batch), np.float32))
            token_ids[random] = self._sample_random(x, random, scaled,
                                                    np.zeros(random.size, bool))
        custom.record(token_ids)
        return self.compute_logprobs(logits, token_ids, batch.num_logprobs,
                                     batch.logprob_token_ids)

    # ------------------------------------------------------------------- greedy rows

    def _sample_greedy(self, logits, rows, batch, modified) -> np.ndarray:
        out = _take_rows(logits, rows).argmax(axis=1)
        todo = rows[modified]
        if todo.size:
            where = np.flatnonzero(modified)
            x = np.take(logits, todo, axis=0)
            _apply_penalties_and_bans(x, todo, batch, np.ones(todo.size, np.float32))
            best = x.argmax(axis=1)
            ok = np.isfinite(x[np.arange(todo.size), best])   # False only if all banned
            out[where[ok]] = best[ok]
        return out

    # ------------------------------------------------------------------- random rows

    def _sample_random(self, logits, rows, batch, modified) -> np.ndarray:
        v = logits.shape[1]
        slab = _slab_width(v)
        width = -(-v // slab) * slab
        block = max(1, _BLOCK_BYTES // (4 * width))
        u = self._uniforms(rows, batch)
        out = np.empty(rows.size, np.int64)
        for s in range(0, rows.size, block):
            blk = slice(s, s + block)
            out[blk] = self._sample_block(logits, rows[blk], batch, modified[blk], u[blk],
                                          slab, width)
        return out

    def _uniforms(self, rows, batch) -> np.ndarray:
        """One uniform in [0, 1) per row: a hash of (seed, step) for seeded rows."""
        seeds = batch.seeds[rows]
        seeded = seeds >= 0
        u = np.empty(rows.size, np.float64)
        n_free = rows.size - int(seeded.sum())
        if n_free:
            u[~seeded] = self._rng.random(n_free)
        if n_free < rows.size:
            u[seeded] = _hash_uniform(seeds[seeded], batch.output_lens[rows][seeded])
        return u

    def _sample_block(self, logits, rows, batch, modified, u, slab, width) -> np.ndarray:
        n, v = rows.size, logits.shape[1]
        p = self._buffer("p", n * width, np.float32).reshape(n, width)
        x = p[:, :v]
        inv_t = (1.0 / batch.temperature[rows]).astype(np.float32)
        np.multiply(_take_rows(logits, rows), inv_t[:, None], out=x)
        if width > v:
            p[:, v:] = -np.inf
        if modified.any():
            _apply_penalties_and_bans(x, rows, batch, inv_t)

        # Unnormalized probabilities with max 1 per row (all 0 if the whole row is -inf).
        m = x.max(axis=1)
        m[~np.isfinite(m)] = 0.0
        np.subtract(p, m[:, None], out=p)
        np.exp(p, out=p)

        # Filtering: every filter is a threshold on p; keep p >= max(thresholds).
        thr = batch.min_p[rows].astype(np.float32)   # min-p relative to max prob = 1
        top_k = batch.top_k[rows]
        use_k = (top_k > 0) & (top_k < v)
        use_p = batch.top_p[rows] < 1.0
        token = np.empty(n, np.int64)
        whole = np.ones(n, bool)          # rows sampled over the whole row
        if use_k.any() or use_p.any():
            thr_kp, cand = _top_k_top_p_threshold(p, top_k, batch.top_p[rows], use_k, use_p)
            np.maximum(thr, thr_kp, out=thr)
            if cand is not None:
                # These rows' candidates hold every token they keep: sample among them.
                cand_rows, r, col, vals = cand
                token[cand_rows] = _sample_candidates(r, col, vals, thr[cand_rows], u[cand_rows])
                whole[cand_rows] = False
        if whole.all():
            token = _sample_whole_rows(p, thr, u, slab, self._buffer("keep", n * width, np.bool_))
        elif whole.any():
            idx = np.flatnonzero(whole)
            token[idx] = _sample_whole_rows(np.take(p, idx, axis=0), thr[idx], u[idx], slab,
                                            self._buffer("keep", idx.size * width, np.bool_))
        empty = token < 0
        if empty.any():   # every token banned or -inf: fall back to the model's argmax
            token[empty] = _take_rows(logits, rows).argmax(axis=1)[empty]
        return token

    # ------------------------------------------------------------------- logprobs

    def compute_logprobs(self, logits: np.ndarray, token_ids: np.ndarray,
                         num_logprobs: np.ndarray,
                         token_lists: Optional[list] = None) -> SamplerOutput:
        """Raw log-probabilities of token_ids [B] under logits [B, V]: the chosen token's for
        every row (see always_chosen_logprob), ranks and the top-N for rows with
        num_logprobs [B] >= 0; a row with ids in ``token_lists`` (logprob_token_ids) gets those
        in place of its top-N. Also used for prompt logprobs (the model runner)."""
        b, v = logits.shape
        want = num_logprobs >= 0
        any_want = bool(want.any())
        lp = np.full(b, np.nan, np.float32)
        if not (self.always_chosen_logprob or any_want):
            return SamplerOutput(token_ids=token_ids, logprobs=lp)  # no row asked (the usual)
        rows = np.arange(b) if self.always_chosen_logprob else np.flatnonzero(want)
        k = int(min(num_logprobs.max(), v)) if any_want else -1
        ranks = top_ids = top_lp = None
        if k >= 0:
            ranks = np.zeros(b, np.int64)
            top_ids = np.full((b, k), -1, np.int64)
            top_lp = np.full((b, k), -np.inf, np.float32)
        block = max(1, _BLOCK_BYTES // (4 * v))
        for s in range(0, rows.size, block):
            blk = rows[s:s + block]
            n = blk.size
            raw = _take_rows(logits, blk)
            m = raw.max(axis=1)
            m[~np.isfinite(m)] = 0.0
            tmp = self._buffer("p", n * v, np.float32).reshape(n, v)
            np.subtract(raw, m[:, None], out=tmp)
            np.exp(tmp, out=tmp)
            lse = m + np.log(tmp.sum(axis=1).astype(np.float64))
            chosen = raw[np.arange(n), token_ids[blk]]
            lp[blk] = chosen - lse
            asked = want[blk]
            if not asked.any():
                continue
            if not asked.all():
                sel = np.flatnonzero(asked)
                blk, raw, chosen, lse = blk[sel], np.take(raw, sel, axis=0), chosen[sel], lse[sel]
                n = blk.size
            ge = self._buffer("keep", n * v, np.bool_).reshape(n, v)
            np.greater_equal(raw, chosen[:, None], out=ge)
            ranks[blk] = ge.view(np.uint8).sum(axis=1, dtype=np.int64)   # 3x count_nonzero's speed
            if k:
                vals, ids = _top_values(raw, k, with_ids=True)
                top_lp[blk] = vals - lse[:, None]
                top_ids[blk] = ids
                if token_lists is not None:
                    _put_asked(top_ids, top_lp, raw, lse, blk, token_lists)
        return SamplerOutput(token_ids=token_ids, logprobs=lp, top_token_ids=top_ids,
                             top_logprobs=top_lp, ranks=ranks)

    def _buffer(self, name: str, size: int, dtype) -> np.ndarray:
        buf = self._scratch.get(name)
        if buf is None or buf.size < size:
            buf = np.empty(size, dtype)
            self._scratch[name] = buf
        return buf[:size]


# ======================================================================= helpers

def _on_rows(x: np.ndarray, rows: np.ndarray, batch: SamplingBatch, stage) -> None:
    """``stage`` (_apply_bias_and_bans, _apply_penalties) on the rows ``rows`` of the
    unscaled x [B, V], in place."""
    if rows.size:
        sub = np.take(x, rows, axis=0)
        stage(sub, rows, batch, np.ones(rows.size, np.float32))
        x[rows] = sub


def _take_rows(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """a[rows] (rows ascending, no repeats): a view when rows is a contiguous range."""
    if rows.size and rows[-1] - rows[0] == rows.size - 1:
        return a[rows[0]:rows[-1] + 1]
    return np.take(a, rows, axis=0)


def _sample_whole_rows(p, thr, u, slab, keep_buf) -> np.ndarray:
    """One token per row of p [n, W] (unnormalized, W a multiple of slab) among entries
    >= thr, by inverse CDF at u in two levels: a slab by its mass, then an entry in it.
    -1 for rows with nothing to sample. May zero entries of p."""
    n, w = p.shape
    if (thr > 0).any():
        keep = keep_buf.reshape(n, w)
        np.greater_equal(p, thr[:, None], out=keep)
        np.multiply(p, keep, out=p)
    n_slabs = w // slab
    p3 = p.reshape(n, n_slabs, slab)
    slab_mass = p3.sum(axis=2).astype(np.float64)
    cdf = np.cumsum(slab_mass, axis=1)
    total = cdf[:, -1]
    target = u * total
    s = np.minimum(np.count_nonzero(cdf <= target[:, None], axis=1), n_slabs - 1)
    ar = np.arange(n)
    before = np.where(s > 0, cdf[ar, np.maximum(s - 1, 0)], 0.0)
    seg = p3[ar, s]                                        # [n, slab] copy
    seg_cdf = np.cumsum(seg, axis=1, dtype=np.float64)
    frac = np.divide(target - before, slab_mass[ar, s], out=np.zeros(n),
                     where=slab_mass[ar, s] > 0)
    t2 = np.clip(frac, 0.0, 1.0) * seg_cdf[:, -1]
    j = np.minimum(np.count_nonzero(seg_cdf <= t2[:, None], axis=1), slab - 1)
    token = s * slab + j
    bad = ~(seg[ar, j] > 0)
    if bad.any():   # rounding at a slab's end (take its last kept entry), or nothing at all
        for i in np.flatnonzero(bad):
            nz = np.flatnonzero(seg[i] > 0)
            token[i] = s[i] * slab + nz[-1] if total[i] > 0 and nz.size else -1
    return token


def _sample_candidates(r, col, vals, thr, u) -> np.ndarray:
    """One token per row from candidate entries (row r ascending, column col, value vals;
    every row has some), keeping those >= thr[row], by inverse CDF at u[row]."""
    m = thr.size
    lens = np.bincount(r, minlength=m)
    w = _pad_rows(np.where(vals >= thr[r], vals, 0.0), r, lens)
    cdf = np.cumsum(w, axis=1, dtype=np.float64)      # per row: independent of other rows
    pick = np.count_nonzero(cdf <= (u * cdf[:, -1])[:, None], axis=1)
    pick = np.minimum(pick, lens - 1)
    ar = np.arange(m)
    bad = ~(w[ar, pick] > 0)
    if bad.any():   # rounding at the row's end: its last kept candidate
        for i in np.flatnonzero(bad):
            pick[i] = np.flatnonzero(w[i] > 0)[-1]
    return _pad_rows(col, r, lens, fill=-1)[ar, pick]


def _pad_rows(values, r, lens, fill=0):
    """Values grouped by row r (ascending; row i has lens[i]) as a [m, max(lens)] matrix."""
    starts = np.cumsum(lens) - lens
    out = np.full((lens.size, int(lens.max())), fill, dtype=values.dtype)
    out[r, np.arange(r.size) - starts[r]] = values
    return out


def _apply_penalties_and_bans(x: np.ndarray, rows: np.ndarray, batch: SamplingBatch,
                              scale: np.ndarray) -> None:
    """In place on x [n, V] (row i is batch row rows[i], already multiplied by scale[i] > 0):
    logit_bias, banned ids and token masks, then the penalties, in vLLM's order (a banned
    entry stays -inf through the penalties)."""
    _apply_bias_and_bans(x, rows, batch, scale)
    _apply_penalties(x, rows, batch, scale)


def _gather(lists, which: np.ndarray, rows: np.ndarray, v: int):
    """(row in x, token id) pairs of the per-row id lists of the rows selected by which (x's
    row i is batch row rows[i]), ids outside [0, V) dropped."""
    idx = np.flatnonzero(which)
    if idx.size == 0:
        return _EMPTY_IDS, _EMPTY_IDS
    if lists is None:
        raise ValueError("SamplingBatch has penalties but no prompt_token_ids / "
                         "output_token_ids")
    arrays = [lists[rows[i]] for i in idx]
    lens = np.fromiter((len(a) for a in arrays), np.int64, idx.size)
    toks = np.concatenate(arrays).astype(np.int64, copy=False) if arrays else _EMPTY_IDS
    ri = np.repeat(idx, lens)
    ok = (toks >= 0) & (toks < v)
    return ri[ok], toks[ok]


def _apply_bias_and_bans(x: np.ndarray, rows: np.ndarray, batch: SamplingBatch,
                         scale: np.ndarray) -> None:
    """logit_bias added, then banned ids (min_tokens, bad_words) and the tokens a row's
    bitmask leaves out set to -inf (see _apply_penalties_and_bans)."""
    n, v = x.shape
    if batch.bias_rows is not None and batch.bias_rows.size:
        # Rows of x: where each biased batch row sits in `rows` (absent rows dropped).
        pos = np.full(len(batch), -1, np.int64)
        pos[rows] = np.arange(n)
        ri, ti = pos[batch.bias_rows], batch.bias_ids.astype(np.int64)
        ok = (ri >= 0) & (ti < v)
        ri, ti = ri[ok], ti[ok]
        x[ri, ti] += batch.bias_values[ok] * scale[ri]

    if batch.banned_token_ids is not None:
        ri, ti = _gather(batch.banned_token_ids, np.ones(n, bool), rows, v)
        if ri.size:
            x[ri, ti] = -np.inf

    if batch.mask_rows is not None and batch.mask_rows.size:
        pos = np.full(len(batch), -1, np.int64)
        pos[batch.mask_rows] = np.arange(batch.mask_rows.size)
        which = pos[rows]
        sel = np.flatnonzero(which >= 0)
        if sel.size:
            allowed = unpack_bitmask(batch.token_bitmask[which[sel]], v)
            sub = x[sel]
            sub[~allowed] = -np.inf
            x[sel] = sub


def _apply_penalties(x: np.ndarray, rows: np.ndarray, batch: SamplingBatch,
                     scale: np.ndarray) -> None:
    """Repetition (prompt and output tokens: positive logits divided, negative multiplied),
    then frequency and presence penalties (see _apply_penalties_and_bans)."""
    v = x.shape[1]
    rep = batch.repetition_penalty[rows]
    freq = batch.frequency_penalty[rows]
    pres = batch.presence_penalty[rows]

    # Repetition: over prompt and output tokens. Duplicates are harmless: every write of a
    # position computes the same value from the same original.
    which = rep != 1.0
    if which.any():
        ri, ti = _gather(batch.prompt_token_ids, which, rows, v)
        ro, to = _gather(batch.output_token_ids, which, rows, v)
        ri, ti = np.concatenate([ri, ro]), np.concatenate([ti, to])
        if ri.size:
            vals = x[ri, ti]
            r = rep[ri]
            x[ri, ti] = np.where(vals > 0, vals / r, vals * r)

    # Frequency and presence: over output tokens, with counts.
    which = (freq != 0.0) | (pres != 0.0)
    if which.any():
        ri, ti = _gather(batch.output_token_ids, which, rows, v)
        if ri.size:
            flat, counts = np.unique(ri * v + ti, return_counts=True)
            ri, ti = np.divmod(flat, v)
            x[ri, ti] -= (freq[ri] * counts + pres[ri]) * scale[ri]


def unpack_bitmask(bitmask: np.ndarray, v: int) -> np.ndarray:
    """bool [R, v] from int32 [R, ceil(v / 32)] bitmasks (bit t % 32 of word t // 32)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                         bitorder="little")
    return bits[:, :v].view(np.bool_)


def _slab_width(v: int) -> int:
    """Width of the inverse-CDF slabs; a function of the vocabulary size only, so that a
    seeded row's sample never depends on its batch companions."""
    return 512 if v > 8192 else 64


def _top_k_top_p_threshold(p, top_k, top_p, use_k, use_p) -> np.ndarray:
    """Per row of p [n, W] (unnormalized probabilities, max 1, W a multiple of 64): the
    smallest probability kept by top-k and then top-p on what top-k kept; 0 where unused.

    Exact without sorting whole rows. Split the columns into chunks of C; sort the chunk
    maxima (W/C values). If the j largest chunk maxima already hold the mass top-p needs
    (or j = k for top-k), then every token that can survive is >= the j-th largest chunk
    maximum t, because those j maxima are themselves j tokens >= t. So only the "upper set"
    {p >= t}, about j tokens, is sorted. Rows where that set would be large (flat
    distributions, large k) sort the whole row instead.

    Returns (thresholds [n], candidates): candidates is None or (rows, r, col, vals): for
    those rows of p, their upper sets (entry i is p[rows[r[i]], col[i]] = vals[i], grouped by
    r ascending), which contain every entry >= the row's threshold.
    """
    n, w = p.shape
    thr = np.zeros(n, np.float32)
    rows = np.flatnonzero(use_k | use_p)
    if rows.size == 0:
        return thr, None
    q = _take_rows(p, rows)
    m = rows.size
    k = np.where(use_k[rows], top_k[rows], 0).astype(np.int64)         # 0 = no top-k
    tp = np.where(use_p[rows], top_p[rows], 1.0).astype(np.float64)
    mass = q.sum(axis=1).astype(np.float64)

    c = 16 if w <= 65536 else 32
    nc = w // c
    cmax = np.sort(q.reshape(m, c, nc).max(axis=1), axis=1)[:, ::-1]   # [m, nc] descending
    j = k.copy()
    only_p = k == 0
    if only_p.any():
        cum = np.cumsum(cmax[only_p], axis=1, dtype=np.float64)
        j[only_p] = np.count_nonzero(cum < (tp[only_p] * mass[only_p])[:, None], axis=1) + 1
    fast = j <= nc
    t = cmax[np.arange(m), np.clip(j - 1, 0, nc - 1)]
    fast &= t > 0

    cand = None
    idx = np.flatnonzero(fast)
    if idx.size:
        sub = _take_rows(q, idx)
        flat = np.flatnonzero(sub >= t[idx, None])     # 1-D: much faster than 2-D nonzero
        r = flat // w
        lens = np.bincount(r, minlength=idx.size)
        small = lens <= w // 4                           # ties can make the upper set large
        if not small.all():
            fast[idx[~small]] = False
            keep = small[r]
            flat, r = flat[keep], np.searchsorted(np.flatnonzero(small), r[keep])
            idx, lens = idx[small], lens[small]
        if idx.size:
            vals = sub.reshape(-1)[flat]
            thr[rows[idx]] = _cut_sorted(_sort_desc_by_row(vals, r), lens, k[idx], tp[idx],
                                         mass[idx])
            cand = (rows[idx], r, flat % w, vals)

    idx = np.flatnonzero(~fast)
    if idx.size:
        srt = np.sort(_take_rows(q, idx), axis=1)[:, ::-1]
        thr[rows[idx]] = _cut_sorted_rows(srt, k[idx], tp[idx])
    return thr, cand


def _sort_desc_by_row(vals: np.ndarray, row: np.ndarray) -> np.ndarray:
    """vals (positive float32) grouped by row (ascending), each group sorted descending.

    Positive IEEE floats order like their bit patterns, so one int64 key (row in the high
    half, inverted bits in the low half) sorts everything with a single fast np.sort."""
    bits = vals.astype(np.float32).view(np.int32).astype(np.int64)
    key = np.sort((row.astype(np.int64) << 32) | (0x7FFFFFFF - bits))
    return (0x7FFFFFFF - (key & 0xFFFFFFFF)).astype(np.int32).view(np.float32)


def _cut_sorted(sv, lens, k, tp, mass) -> np.ndarray:
    """Thresholds from per-row descending values concatenated in sv (row i has lens[i]):
    the k-th value if k > 0, and the value where the cumulative mass first reaches tp times
    the row's mass (the sum of the first k values when k > 0)."""
    m = lens.size
    r = np.repeat(np.arange(m), lens)
    vals = _pad_rows(sv, r, lens)                     # [m, L], zero padded
    ar = np.arange(m)
    has_k = k > 0
    if has_k.any():
        vals = np.where(np.arange(vals.shape[1]) < np.where(has_k, k, lens)[:, None], vals, 0.0)
    cum = np.cumsum(vals, axis=1, dtype=np.float64)  # per row: independent of other rows
    kk = np.maximum(k, 1) - 1
    total = np.where(has_k, cum[ar, np.minimum(kk, vals.shape[1] - 1)], mass)
    below = np.count_nonzero(cum < (tp * total)[:, None], axis=1)
    last = np.where(has_k, k, lens) - 1
    thr_p = np.where(tp < 1.0, vals[ar, np.minimum(below, last)], 0.0)
    thr_k = np.where(has_k, vals[ar, np.minimum(kk, vals.shape[1] - 1)], 0.0)
    return np.maximum(thr_p, thr_k)


def _cut_sorted_rows(srt, k, tp) -> np.ndarray:
    """As _cut_sorted for whole rows sorted descending ([m, W], W a multiple of 64); the
    cumulative sum is taken in two levels (blocks, then one block) to stay cheap."""
    m, w = srt.shape
    ar = np.arange(m)
    has_k = k > 0
    thr_k = np.where(has_k, srt[ar, np.maximum(k, 1) - 1], 0.0)
    if has_k.any():
        srt = np.where(np.arange(w) < np.where(has_k, k, w)[:, None], srt, 0.0)
    blk = 64
    b3 = srt.reshape(m, w // blk, blk)
    bcum = np.cumsum(b3.sum(axis=2, dtype=np.float64), axis=1)
    target = tp * bcum[:, -1]
    bi = np.minimum(np.count_nonzero(bcum < target[:, None], axis=1), w // blk - 1)
    before = np.where(bi > 0, bcum[ar, np.maximum(bi - 1, 0)], 0.0)
    inner = np.cumsum(b3[ar, bi], axis=1, dtype=np.float64) + before[:, None]
    wi = np.minimum(np.count_nonzero(inner < target[:, None], axis=1), blk - 1)
    thr_p = np.where(tp < 1.0, srt[ar, bi * blk + wi], 0.0)
    return np.maximum(thr_p, thr_k)


def _top_values(a: np.ndarray, k: int, with_ids: bool = False):
    """The k largest entries of each row of a [n, V], descending, exactly; with their
    column ids if with_ids.

    Columns are split into chunks (chunk j = columns j, j + nc, j + 2*nc, ...). The k largest
    entries all lie in the k chunks with the largest maxima, so only those k*C candidates
    are sorted: O(V) + a sort of ~sqrt(k*V) per row, instead of a sort of V.
    """
    n, v = a.shape
    k = min(k, v)
    if 16 * k > v:
        if with_ids:
            ids = np.argsort(a, axis=1)[:, ::-1][:, :k]
            return np.take_along_axis(a, ids, axis=1), ids
        return np.sort(a, axis=1)[:, ::-1][:, :k], None
    c = 1 << max(1, int(round(0.5 * np.log2(v / k))))
    nc = v // c
    main = a[:, :nc * c].reshape(n, c, nc)
    top = np.argpartition(main.max(axis=1), nc - k, axis=1)[:, nc - k:]     # [n, k]
    lanes = np.arange(c)[None, :, None]
    cand = main[np.arange(n)[:, None, None], lanes, top[:, None, :]].reshape(n, c * k)
    if nc * c < v:
        cand = np.concatenate([cand, a[:, nc * c:]], axis=1)
    if not with_ids:
        return np.sort(cand, axis=1)[:, ::-1][:, :k], None
    ids = (lanes * nc + top[:, None, :]).reshape(n, c * k)
    if nc * c < v:
        ids = np.concatenate([ids, np.broadcast_to(np.arange(nc * c, v), (n, v - nc * c))],
                             axis=1)
    order = np.argsort(cand, axis=1)[:, ::-1][:, :k]
    return np.take_along_axis(cand, order, axis=1), np.take_along_axis(ids, order, axis=1)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (xor-shift-multiply): every input bit affects every output bit."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _hash_uniform(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1), a pure function of (seed, step), vectorized.

    Each seed keys a counter-based stream: state = mix(seed), value at step t =
    mix(state + (t + 1) * golden). Stable across NumPy versions and platforms.
    """
    s = np.asarray(seeds, np.int64).astype(np.uint64)
    t = np.asarray(steps, np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = _mix64(s * _GOLDEN + _GOLDEN)
        h = _mix64(key + (t + np.uint64(1)) * _GOLDEN)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
