// CPU kernels for the model's layers: small-M linear (GEMV/GEMM on [out, in] weights), RMSNorm
// (with fused residual add), rotary embedding and SiLU-and-mul. All tensors are row-major
// float32; rows may be strided where a stride argument says so.
//
// Why: at decode time MindSpore's CPU MatMul at M=1 runs well below the memory-bandwidth
// floor, and its element-wise ops cost ~60 us each in PyNative, more than the matmuls they sit
// between; these kernels are called through ctypes on the tensors' own memory.
//
// Threads: no OpenMP. Work is split into items and run on ONE shared pool, the attention
// kernel library's (lls_parallel_for, registered once with lls_layer_ops_set_parallel_for), so
// all our C++ kernels use the same helper threads and never fight each other or leave OpenMP
// threads spinning on the core MindSpore's next op needs. Without a registered pool the work
// runs on the calling thread.
//
// Vector code uses GCC vector extensions sized to the widest ISA the build targets (-march=
// native): 16 floats with AVX-512, 8 with AVX/AVX2, 4 otherwise, so the same source builds and
// runs, slower, on CPUs without AVX-512. Build with -ffp-contract=fast so a*b+c becomes FMA.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !defined(LLS_NO_AVX512)
#include <immintrin.h>
#define LLS_VW 16
#elif defined(__AVX__)
#include <immintrin.h>
#define LLS_VW 8
#else
#define LLS_VW 4
#endif

namespace {

constexpr int VW = LLS_VW;
typedef float vf __attribute__((vector_size(VW * 4)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// acc + x * w with one rounding, written out: left to -ffp-contract, the compiler fused some
// template instances and not others (tail tiles, the scalar K tail), so a row's bits depended
// on the tile it fell in. Explicit FMAs make every output the same chain whatever the tiling.
inline vf vfma(vf x, vf w, vf acc) {
#if LLS_VW == 16
  return (vf)_mm512_fmadd_ps((__m512)x, (__m512)w, (__m512)acc);
#elif LLS_VW == 8 && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#else
  vf r;
  for (int i = 0; i < VW; ++i) r[i] = __builtin_fmaf(x[i], w[i], acc[i]);
  return r;
#endif
}

inline float sfma(float x, float w, float acc) { return __builtin_fmaf(x, w, acc); }

inline float hsum(vf v) {
#if LLS_VW == 16
  return _mm512_reduce_add_ps((__m512)v);
#elif LLS_VW == 8
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
#endif
}

// ---------------------------------------------------------------------------------------------
// Shared thread pool hook.
typedef void (*TaskFn)(void* ctx, int64_t i);
typedef void (*ParallelForFn)(TaskFn fn, void* ctx, int64_t n, int parallel, int64_t linger_us);
ParallelForFn g_parallel_for = nullptr;
// After a linear job the pool's idle helpers keep spinning this long: the model runs the
// linear kernel only for decode-sized inputs, where every matmul of the step is ours and the
// next one follows within tens of microseconds, while a sleeping helper wakes too late. Other
// jobs (element-wise) do not linger: at larger batches MindSpore's MatMul runs next and needs
// the core.
int64_t g_linger_us = 500;

void parallel_for(TaskFn fn, void* ctx, int64_t n, bool parallel, int64_t linger_us = 0) {
  if (parallel && n > 1 && g_parallel_for) {
    g_parallel_for(fn, ctx, n, 1, linger_us);
    return;
  }
  for (int64_t i = 0; i < n; ++i) fn(ctx, i);
}

// Run body(r0, r1) over [0, rows) in chunks of `chunk` rows, in parallel when there are at
// least two chunks.
template <class F>
void parallel_rows(int64_t rows, int64_t chunk, F&& body) {
  struct Ctx {
    F* f;
    int64_t rows, chunk;
  } c{&body, rows, chunk};
  const int64_t n = (rows + chunk - 1) / chunk;
  parallel_for(
      [](void* p, int64_t i) {
        Ctx* c = static_cast<Ctx*>(p);
        const int64_t r0 = i * c->chunk;
        const int64_t r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
        (*c->f)(r0, r1);
      },
      &c, n, n > 1);
}

// ---------------------------------------------------------------------------------------------
// Linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); w is [N, K] row-major (the HF
// [out, in] layout). Each output is a dot product of an x row and a w row, so w streams from
// memory exactly once and in order, whatever M is: the kernel is built for decode (small M),
// where the weight read is the whole cost.
//
// Micro-tile: MR rows of x times NR rows of w, MR*NR vector accumulators over K. Work items are
// blocks of output columns (w rows); within one, each NR-row w tile is reused from L1 for all
// MR-row tiles of x. With AVX-512 and M <= 2, 8 w rows stream at once (more reads in flight:
// measured ~10% more bandwidth than 4 at M=1, together with the software prefetch).

constexpr int NR = 4;
#if LLS_VW == 16
constexpr int MR_MAX = 4;   // 16 accumulators + 4 w + 1 x of 32 zmm registers
constexpr int NR_WIDE = 8;  // for M <= 2: up to 16 accumulators + 8 w + 1 x
#else
constexpr int MR_MAX = 2;   // 8 accumulators + 4 w + 1 x of 16 ymm registers
constexpr int NR_WIDE = 4;
#endif
constexpr int64_t kPrefetch = 1024;  // floats ahead in each w row (4 KB)

// Output parts: columns [split[p], split[p+1]) of the logical [M, N] result go to out[p] with
// row stride ld[p] (a fused qkv projection can write q, k and v into separate tensors).
constexpr int kMaxParts = 4;

struct LinearArgs {
  const float* x;
  int64_t ldx;
  const float* w;
  const float* bias;
  int64_t M, N, K;
  int64_t nb;  // output columns per work item
  int nparts;
  int64_t split[kMaxParts + 1];
  float* out[kMaxParts];
  int64_t ld[kMaxParts];
};

// sums[j] = horizontal sum of v[j], j < NR. With AVX-512, groups of 4 vectors are reduced
// together through a transpose (8 instructions for 4 sums instead of ~32).
template <int NRT>
inline void hsum_n(const vf* v, float* sums) {
  int j = 0;
#if LLS_VW == 16
  for (; j + 4 <= NRT; j += 4) {
    const __m512 a = (__m512)v[j], b = (__m512)v[j + 1], c = (__m512)v[j + 2],
                 d = (__m512)v[j + 3];
    // per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], cd likewise
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // per 128-bit lane: [a, b, c, d] partial sums
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44),
                                      _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                   _mm512_extractf32x8_ps(abcd, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(sums + j, q);
  }
#endif
  for (; j < NRT; ++j) sums[j] = hsum(v[j]);
}

inline float* out_ptr(const LinearArgs& a, int64_t m, int64_t n) {
  int p = 0;
  while (n >= a.split[p + 1]) ++p;
  return a.out[p] + m * a.ld[p] + (n - a.split[p]);
}

template <int MR, int NRT>
inline void linear_tile(const LinearArgs& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const float* w = a.w + n0 * K;
  const float* x = a.x + m0 * a.ldx;
  vf acc[MR][NRT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRT; ++j) acc[i][j] = vf{};
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    for (int j = 0; j < NRT; ++j) __builtin_prefetch(w + j * K + k + kPrefetch);
    vf wv[NRT];
    for (int j = 0; j < NRT; ++j) wv[j] = vload(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const vf xv = vload(x + i * a.ldx + k);
      for (int j = 0; j < NRT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float sums[NRT];
    hsum_n<NRT>(acc[i], sums);
    for (int j = 0; j < NRT; ++j) {
      float s = sums[j];
      for (int64_t kk = k; kk < K; ++kk) s = sfma(x[i * a.ldx + kk], w[j * K + kk], s);
      if (a.bias) s += a.bias[n0 + j];
      *out_ptr(a, m0 + i, n0 + j) = s;
    }
  }
}

template <int NRT>
inline void linear_cols(const LinearArgs& a, int64_t n0) {
  int64_t m = 0;
  for (; m + MR_MAX <= a.M; m += MR_MAX) linear_tile<MR_MAX, NRT>(a, m, n0);
  switch (a.M - m) {
#if LLS_VW == 16
    case 3: linear_tile<3, NRT>(a, m, n0); break;
#endif
    case 2: if (MR_MAX > 2) { linear_tile<2, NRT>(a, m, n0); } break;
    case 1: linear_tile<1, NRT>(a, m, n0); break;
    default: break;
  }
}

// Many rows (prefill, large decode batches): the weight block of an item is reused by every x
// row, so the tile is bound by loads and FMAs, not by the weight stream. A larger register
// tile (more FMAs per load), w and x held in registers (no memory-operand FMAs, which reload w
// for every row), no software prefetch (the item's w block sits in L2). Each output is still
// the same VW-lane FMA chain over k followed by the same horizontal sum as in linear_tile, so
// a row's bits do not depend on the tile it falls in (batch invariance).
#if LLS_VW == 16
constexpr int MR_BIG = 6, NR_BIG = 4;  // 24 accumulators + 4 w + 1 x of 32 zmm registers
#else
constexpr int MR_BIG = 4, NR_BIG = 3;  // 12 accumulators + 3 w + 1 x of 16 ymm registers
#endif

template <int MR, int NRT>
inline void linear_tile_big(const LinearArgs& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const float* w = a.w + n0 * K;
  const float* x = a.x + m0 * a.ldx;
  vf acc[MR][NRT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRT; ++j) acc[i][j] = vf{};
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    vf wv[NRT];
    for (int j = 0; j < NRT; ++j) {
      wv[j] = vload(w + j * K + k);
      asm("" : "+x"(wv[j]));  // keep w in a register: one load per k step, not one per row
    }
    for (int i = 0; i < MR; ++i) {
      vf xv = vload(x + i * a.ldx + k);
      asm("" : "+x"(xv));
      for (int j = 0; j < NRT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float sums[NRT];
    hsum_n<NRT>(acc[i], sums);
    for (int j = 0; j < NRT; ++j) {
      float s = sums[j];
      for (int64_t kk = k; kk < K; ++kk) s = sfma(x[i * a.ldx + kk], w[j * K + kk], s);
      if (a.bias) s += a.bias[n0 + j];
      *out_ptr(a, m0 + i, n0 + j) = s;
    }
  }
}

template <int MR>
inline void linear_rows(const LinearArgs& a, int64_t m, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR_BIG <= n1; n += NR_BIG) linear_tile_big<MR, NR_BIG>(a, m, n);
  for (; n < n1; ++n) linear_tile_big<MR, 1>(a, m, n);
}

template <int MR>
inline void linear_rows_tail(const LinearArgs& a, int64_t m, int64_t n0, int64_t n1) {
  if constexpr (MR > 0) {
    if (a.M - m == MR) linear_rows<MR>(a, m, n0, n1);
    else linear_rows_tail<MR - 1>(a, m, n0, n1);
  }
}

void linear_item(void* p, int64_t item) {
  const LinearArgs& a = *static_cast<const LinearArgs*>(p);
  const int64_t n0 = item * a.nb;
  const int64_t n1 = n0 + a.nb < a.N ? n0 + a.nb : a.N;
  int64_t n = n0;
  if (a.M > MR_MAX) {
    int64_t m = 0;
    for (; m + MR_BIG <= a.M; m += MR_BIG) linear_rows<MR_BIG>(a, m, n0, n1);
    if (m < a.M) linear_rows_tail<MR_BIG - 1>(a, m, n0, n1);
    return;
  }
  if (a.M <= 2)
    for (; n + NR_WIDE <= n1; n += NR_WIDE) linear_cols<NR_WIDE>(a, n);
  for (; n + NR <= n1; n += NR) linear_cols<NR>(a, n);
  for (; n < n1; ++n) linear_cols<1>(a, n);
}

}  // namespace

extern "C" {

int lls_layer_ops_abi_version() { return 4; }

int lls_layer_ops_vector_width() { return VW; }

void lls_layer_ops_set_parallel_for(ParallelForFn fn) { g_parallel_for = fn; }

// How long (us) the pool's helpers keep spinning after a layer op, waiting for the next one.
void lls_layer_ops_set_linger_us(int64_t us) { g_linger_us = us < 0 ? 0 : us; }

// y = x @ w.T (+ bias), written into nparts column ranges: columns [split[p], split[p+1]) of
// row m go to out[p] + m * ld[p]. x: [M, K] with row stride ldx; w: [N, K] contiguous.
// Returns 0, or -1 on bad arguments.
int lls_linear_f32(const float* x, int64_t ldx, const float* w, const float* bias, int64_t M,
                   int64_t N, int64_t K, int nparts, const int64_t* split, float* const* out,
                   const int64_t* ld) {
  if (M < 0 || N < 0 || K < 0 || nparts < 1 || nparts > kMaxParts || ldx < K) return -1;
  LinearArgs a;
  a.x = x; a.ldx = ldx; a.w = w; a.bias = bias; a.M = M; a.N = N; a.K = K;
  a.nparts = nparts;
  for (int p = 0; p <= nparts; ++p) a.split[p] = split[p];
  if (a.split[0] != 0 || a.split[nparts] != N) return -1;
  for (int p = 0; p < nparts; ++p) {
    if (a.split[p + 1] < a.split[p] || ld[p] < a.split[p + 1] - a.split[p]) return -1;
    a.out[p] = out[p];
    a.ld[p] = ld[p];
  }
  if (M == 0 || N == 0) return 0;
  // ~64 output columns per item (a multiple of NR): enough items for dynamic balancing, few
  // enough that the per-item cost stays negligible. Small problems run on the calling thread.
  a.nb = 64;
  if (M > MR_MAX) {  // w block of an item: ~256 KB (half of a typical L2), whole tiles
    const int64_t q = 4 * NR_BIG;   // a multiple of NR too: the same column tails as below
    const int64_t nb = (int64_t(64) * 1024 / (K > 0 ? K : 1)) / q * q;
    a.nb = nb < q ? q : nb > 256 ? 256 : nb;
  }
  const int64_t items = (N + a.nb - 1) / a.nb;
  parallel_for(linear_item, &a, items, M * N * K >= (1 << 18), g_linger_us);
  return 0;
}

// The same contract as lls_linear_f32, computed by a BLAS library's single-threaded
// cblas_sgemm (row-major, 32-bit ints: the scipy-openblas32 build), called on blocks of output
// columns from our shared pool. The library's own threads stay off (set to 1 by the caller), so
// its GEMM micro-kernels (dispatched at run time for the CPU) share the cores with our other
// kernels instead of fighting them. w is [N, K] (the [out, in] layout) and is read in place:
// y[:, c0:c1] = x @ w[c0:c1].T is a NoTrans x Trans sgemm on a row block of w.
typedef void (*CblasSgemmFn)(int order, int transa, int transb, int m, int n, int k, float alpha,
                             const float* a, int lda, const float* b, int ldb, float beta,
                             float* c, int ldc);

namespace {

struct BlasArgs {
  LinearArgs a;
  CblasSgemmFn sgemm;
};

void blas_item(void* p, int64_t item) {
  const BlasArgs& b = *static_cast<const BlasArgs*>(p);
  const LinearArgs& a = b.a;
  const int64_t c0 = item * a.nb;
  const int64_t c1 = c0 + a.nb < a.N ? c0 + a.nb : a.N;
  for (int q = 0; q < a.nparts; ++q) {
    const int64_t lo = a.split[q] > c0 ? a.split[q] : c0;
    const int64_t hi = a.split[q + 1] < c1 ? a.split[q + 1] : c1;
    if (lo >= hi) continue;
    float* out = a.out[q] + (lo - a.split[q]);
    b.sgemm(101 /* RowMajor */, 111 /* NoTrans */, 112 /* Trans */, (int)a.M, (int)(hi - lo),
            (int)a.K, 1.0f, a.x, (int)a.ldx, a.w + lo * a.K, (int)a.K, 0.0f, out, (int)a.ld[q]);
    if (a.bias)
      for (int64_t m = 0; m < a.M; ++m) {
        float* o = out + m * a.ld[q];
        for (int64_t n = lo; n < hi; ++n) o[n - lo] += a.bias[n];
      }
  }
}

}  // namespace

// ``items``: how many column blocks to split N into (the pool balances them dynamically).
int lls_linear_blas_f32(CblasSgemmFn sgemm, int64_t items, const float* x, int64_t ldx,
                        const float* w, const float* bias, int64_t M, int64_t N, int64_t K,
                        int nparts, const int64_t* split, float* const* out, const int64_t* ld) {
  if (!sgemm || items < 1 || M < 0 || N < 0 || K < 0 || nparts < 1 || nparts > kMaxParts ||
      ldx < K || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || ldx > INT32_MAX)
    return -1;
  BlasArgs b;
  LinearArgs& a = b.a;
  b.sgemm = sgemm;
  a.x = x; a.ldx = ldx; a.w = w; a.bias = bias; a.M = M; a.N = N; a.K = K;
  a.nparts = nparts;
  for (int p = 0; p <= nparts; ++p) a.split[p] = split[p];
  if (a.split[0] != 0 || a.split[nparts] != N) return -1;
  for (int p = 0; p < nparts; ++p) {
    if (a.split[p + 1] < a.split[p] || ld[p] < a.split[p + 1] - a.split[p] || ld[p] > INT32_MAX)
      return -1;
    a.out[p] = out[p];
    a.ld[p] = ld[p];
  }
  if (M == 0 || N == 0) return 0;
  // Blocks of a multiple of 16 columns (whole SIMD tiles for the library's micro-kernel).
  a.nb = ((N + items - 1) / items + 15) / 16 * 16;
  const int64_t n = (N + a.nb - 1) / a.nb;
  parallel_for(blas_item, &b, n, true, g_linger_us);
  return 0;
}

// out[t] = x[t] / rms(x[t]) * w
void rms_norm_f32(const float* __restrict x, const float* __restrict w, float* __restrict out,
                  int64_t rows, int64_t dim, float eps) {
  parallel_rows(rows, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* xr = x + t * dim;
      float* o = out + t * dim;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * w[i];
    }
  });
}

// residual[t] += x[t]; out[t] = rms_norm(residual[t]) * w   (residual is updated in place)
void add_rms_norm_f32(const float* __restrict x, float* __restrict residual,
                      const float* __restrict w, float* __restrict out, int64_t rows,
                      int64_t dim, float eps) {
  parallel_rows(rows, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* xr = x + t * dim;
      float* r = residual + t * dim;
      float* o = out + t * dim;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = xr[i] + r[i];
        r[i] = v;
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = r[i] * inv * w[i];
    }
  });
}

// Rotary embedding, "rotate half" (GPT-NeoX / HF Llama) layout, in place on q and k.
// q: [T, nq, D], k: [T, nk, D], rows q_stride / k_stride floats apart (they may be column
// slices of one fused qkv buffer); cos_sin: [max_pos, D], cos in [:D/2] and sin in [D/2:].
void rotary_embedding_f32(float* __restrict q, float* __restrict k,
                          const int32_t* __restrict positions,
                          const float* __restrict cos_sin, int64_t tokens, int64_t nq,
                          int64_t nk, int64_t head_dim, int64_t q_stride, int64_t k_stride) {
  const int64_t half = head_dim / 2;
  parallel_rows(tokens, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* cs = cos_sin + (int64_t)positions[t] * head_dim;
      const float* c = cs;
      const float* s = cs + half;
      for (int64_t h = 0; h < nq + nk; ++h) {
        float* v = h < nq ? q + t * q_stride + h * head_dim
                          : k + t * k_stride + (h - nq) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// out[t, i] = silu(x[t, i]) * x[t, F + i], x: [T, 2F]
void silu_and_mul_f32(const float* __restrict x, float* __restrict out, int64_t rows,
                      int64_t f) {
  parallel_rows(rows, 8, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* g = x + t * 2 * f;
      const float* u = g + f;
      float* o = out + t * f;
#pragma omp simd
      for (int64_t i = 0; i < f; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

}  // extern "C"
