// CPU kernels for the model's layers: small-M linear (GEMV/GEMM on [out, in] weights), RMSNorm
// (with fused residual add), rotary embedding and SiLU-and-mul. All tensors are row-major
// float32, except the linear weights of lls_linear_bf16 (bfloat16 bits, widened to float32 in
// registers: the arithmetic and its order are those of lls_linear_f32); rows may be strided
// where a stride argument says so.
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
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>
#include <unistd.h>

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

// Weights: float, or uint16_t holding bfloat16 bits (the high half of a float32). A bf16 weight
// widens exactly (zero-extend, shift left 16), so the FMAs see float32 operands and every
// output is the same FMA chain as with float32 weights of the rounded values.
typedef uint16_t bf16_t;

inline float wscalar(float w) { return w; }
inline float wscalar(bf16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline vf wload(const float* p) { return vload(p); }
inline vf wload(const bf16_t* p) {
#if LLS_VW == 16
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif LLS_VW == 8 && defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = wscalar(p[i]);
  return v;
#endif
}

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
constexpr int64_t kPrefetchBytes = 4096;  // ahead in each w row

// Output parts: columns [split[p], split[p+1]) of the logical [M, N] result go to out[p] with
// row stride ld[p] (a fused qkv projection can write q, k and v into separate tensors).
constexpr int kMaxParts = 4;

struct LinearArgs {
  const float* x;
  int64_t ldx;
  const void* w;  // [N, K] float or bf16_t: the element type is the kernels' template argument
  int64_t w_row0;  // w holds rows [w_row0, ...) of the weight (0, or an item's widened block)
  const float* bias;
  int64_t M, N, K;
  int64_t nb;  // output columns per work item
  int64_t pack_min_rows = 0;  // the many-rows path packs x and w from this many rows
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

// A tile's last part, the same for every tile shape (so the same bits): each output's vector
// sum, then the K tail columns from k on as scalar FMAs, then the bias; stored in place.
template <class WT, int MR, int NRT>
inline void store_tile(const LinearArgs& a, const float (&sums)[MR][NRT], const float* x,
                       const WT* w, int64_t k, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NRT; ++j) {
      float s = sums[i][j];
      for (int64_t kk = k; kk < K; ++kk) s = sfma(x[i * a.ldx + kk], wscalar(w[j * K + kk]), s);
      if (a.bias) s += a.bias[n0 + j];
      *out_ptr(a, m0 + i, n0 + j) = s;
    }
  }
}

template <class WT, int MR, int NRT>
inline void linear_tile(const LinearArgs& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const WT* w = static_cast<const WT*>(a.w) + (n0 - a.w_row0) * K;
  const float* x = a.x + m0 * a.ldx;
  vf acc[MR][NRT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRT; ++j) acc[i][j] = vf{};
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    for (int j = 0; j < NRT; ++j)
      __builtin_prefetch(reinterpret_cast<const char*>(w + j * K + k) + kPrefetchBytes);
    vf wv[NRT];
    for (int j = 0; j < NRT; ++j) wv[j] = wload(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const vf xv = vload(x + i * a.ldx + k);
      for (int j = 0; j < NRT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  float sums[MR][NRT];
  for (int i = 0; i < MR; ++i) hsum_n<NRT>(acc[i], sums[i]);
  store_tile<WT, MR, NRT>(a, sums, x, w, k, m0, n0);
}

template <class WT, int NRT>
inline void linear_cols(const LinearArgs& a, int64_t n0) {
  int64_t m = 0;
  for (; m + MR_MAX <= a.M; m += MR_MAX) linear_tile<WT, MR_MAX, NRT>(a, m, n0);
  switch (a.M - m) {
#if LLS_VW == 16
    case 3: linear_tile<WT, 3, NRT>(a, m, n0); break;
#endif
    case 2: if (MR_MAX > 2) { linear_tile<WT, 2, NRT>(a, m, n0); } break;
    case 1: linear_tile<WT, 1, NRT>(a, m, n0); break;
    default: break;
  }
}

// Many rows (prefill, large decode batches): the weight block of an item is reused by every x
// row, so the work is bound by loads and FMAs, not by the weight stream. A larger register tile
// (more FMAs per load), w and x held in registers (no memory-operand FMAs, which reload w for
// every row), operands packed and blocked for the caches (below). Each output is still the same
// VW-lane FMA chain over k in order, followed by the same horizontal sum, scalar K tail and
// bias add as in linear_tile, so a row's bits do not depend on the tile it falls in (batch
// invariance).
#if LLS_VW == 16
constexpr int MR_BIG = 6, NR_BIG = 4;  // 24 accumulators + 4 w + 1 x of 32 zmm registers
#else
constexpr int MR_BIG = 4, NR_BIG = 3;  // 12 accumulators + 3 w + 1 x of 16 ymm registers
#endif

#if LLS_VW == 8
// hsum of four vectors at once, each the same sum tree as hsum ((v0+v4) + (v2+v6)) + ((v1+v5) +
// (v3+v7)), so the same bits: 11 instructions for four sums instead of 24. The results go to
// sums[0..3][j].
template <class S>
inline void hsum4(vf a, vf b, vf c, vf d, S sums, int j) {
  const __m256 ac = _mm256_add_ps(_mm256_permute2f128_ps((__m256)a, (__m256)c, 0x20),
                                  _mm256_permute2f128_ps((__m256)a, (__m256)c, 0x31));
  const __m256 bd = _mm256_add_ps(_mm256_permute2f128_ps((__m256)b, (__m256)d, 0x20),
                                  _mm256_permute2f128_ps((__m256)b, (__m256)d, 0x31));
  // per 128-bit half: [a or c: s0+s2, b or d: s0+s2, a or c: s1+s3, b or d: s1+s3]
  const __m256 t = _mm256_add_ps(_mm256_unpacklo_ps(ac, bd), _mm256_unpackhi_ps(ac, bd));
  const __m256 r = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0x0E));  // [a, b, ., . | c, d, ., .]
  alignas(32) float o[8];
  _mm256_store_ps(o, r);
  sums[0][j] = o[0];
  sums[1][j] = o[1];
  sums[2][j] = o[4];
  sums[3][j] = o[5];
}
#endif

// Cache sizes of this CPU, read at run time (sysconf, else sysfs, else typical values): they
// set the blocking of the many-rows path.
struct CacheSizes {
  int64_t l1d = 32 * 1024, l2 = 512 * 1024;
};

int64_t sysfs_cache_size(int level) {
  for (int i = 0; i < 8; ++i) {
    char path[96], buf[32];
    std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
    FILE* f = std::fopen(path, "r");
    if (!f) break;
    const int lv = std::fgets(buf, sizeof buf, f) ? std::atoi(buf) : 0;
    std::fclose(f);
    if (lv != level) continue;
    std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
    if (!(f = std::fopen(path, "r"))) continue;
    const bool instr = std::fgets(buf, sizeof buf, f) && buf[0] == 'I';
    std::fclose(f);
    if (instr) continue;
    std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
    if (!(f = std::fopen(path, "r"))) continue;
    char* end = nullptr;
    int64_t v = std::fgets(buf, sizeof buf, f) ? std::strtoll(buf, &end, 10) : 0;
    std::fclose(f);
    if (end && (*end == 'K' || *end == 'k')) v *= 1024;
    if (end && (*end == 'M' || *end == 'm')) v *= 1024 * 1024;
    return v;
  }
  return 0;
}

const CacheSizes& cache_sizes() {
  static const CacheSizes c = [] {
    CacheSizes c;
    int64_t l1 = 0, l2 = 0;
#ifdef _SC_LEVEL1_DCACHE_SIZE
    l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (l1 <= 0) l1 = sysfs_cache_size(1);
    if (l2 <= 0) l2 = sysfs_cache_size(2);
    // ignore absurd values (some VMs report 0 or garbage)
    if (l1 >= 8 * 1024 && l1 <= 4 * 1024 * 1024) c.l1d = l1;
    if (l2 >= 64 * 1024 && l2 <= 256 * 1024 * 1024) c.l2 = l2;
    return c;
  }();
  return c;
}

// Blocking. An item is a block of nb output columns; its w block (nb x K, ~half of L2) stays
// in L2 while every MR_BIG-row x panel passes over it. With enough panels (M >= 12 * MR_BIG)
// the w block is first packed into a per-thread buffer, and x once per call (at most
// kBigRows rows at a time), panel by panel. So a micro-tile reads two contiguous streams: no
// cache-set conflicts between rows K floats apart (K=2048: 8 KB apart, all in the same L1
// sets), one stream per operand for the hardware prefetcher. K is then cut into blocks of kc
// so that an x panel's block stays in L1 while the item's w tiles stream past it; between K
// blocks a tile's vector accumulators are stored and reloaded, which leaves every FMA chain,
// and so every bit, as it was.
//
// Packed layouts, in VW-float vectors, over the K8 = K - K % VW leading columns:
//   x panel of mr rows starting at row r: xp + r * K8, vector (s, i) at (s * mr + i) * VW;
//   w tile of nr columns starting at item column c: wp + c * K8, vector (s, j) at (s * nr + j).
// The K % VW tail columns are read in place by the scalar tail.

// Grows, never shrinks; one per thread. Bounded: x by kBigRows * K, w by ~L2/2 (at least
// 4 * NR_BIG columns x K), accumulators by nb * MR_BIG vectors.
struct AlignedBuffer {
  float* p = nullptr;
  int64_t n = 0;
  ~AlignedBuffer() { std::free(p); }
  float* get(int64_t floats) {
    if (floats > n) {
      std::free(p);
      const int64_t bytes = ((floats * 4 + 63) / 64) * 64;
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      n = p ? floats : 0;
    }
    return p;
  }
};

thread_local AlignedBuffer t_xpack, t_wpack, t_accs;

struct BigArgs {
  const LinearArgs* a;
  const float* xp;   // packed x, M * K8 floats, or null (x read in place)
  bool pack_w;       // pack each item's w block
  int64_t K8;
  int64_t kc;        // K block, in vectors
};

// Operand addressing of a micro-tile: vector (s, r) of x (r a row) or w (r a column) is at
// p + s * step + r * row, in place (step VW, row the leading dimension) or packed (row VW).
struct Operand {
  const float* p;
  int64_t step, row;
};

template <int MR, int NRT>
inline void big_tile(const LinearArgs& a, Operand xo, Operand wo, int64_t s0, int64_t s1,
                     vf* save, bool first, bool last, int64_t m0, int64_t n0) {
  vf acc[MR][NRT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRT; ++j) acc[i][j] = first ? vf{} : save[i * NRT + j];
  const float* xp = xo.p + s0 * xo.step;
  const float* wp = wo.p + s0 * wo.step;
  for (int64_t s = s0; s < s1; ++s) {
    vf wv[NRT];
    for (int j = 0; j < NRT; ++j) {
      wv[j] = vload(wp + j * wo.row);
      asm("" : "+x"(wv[j]));  // keep w in a register: one load per k step, not one per row
    }
    for (int i = 0; i < MR; ++i) {
      vf xv = vload(xp + i * xo.row);
      asm("" : "+x"(xv));
      for (int j = 0; j < NRT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
    xp += xo.step;
    wp += wo.step;
  }
  if (!last) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NRT; ++j) save[i * NRT + j] = acc[i][j];
    return;
  }
  float sums[MR][NRT];
#if LLS_VW == 8
  if constexpr (MR == 4) {
    for (int j = 0; j < NRT; ++j) hsum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j], sums, j);
  } else {
    for (int i = 0; i < MR; ++i) hsum_n<NRT>(acc[i], sums[i]);
  }
#else
  for (int i = 0; i < MR; ++i) hsum_n<NRT>(acc[i], sums[i]);
#endif
  store_tile<float, MR, NRT>(a, sums, a.x + m0 * a.ldx,
                            static_cast<const float*>(a.w) + n0 * a.K, s1 * VW, m0, n0);
}

// One x panel of MR rows (at row m) against the item's w block, columns [n0, n1); wpack is
// the packed block or null (w read in place).
template <int MR>
inline void packed_panel(const BigArgs& b, const float* wpack, vf* accs, int64_t m, int64_t n0,
                         int64_t n1) {
  const LinearArgs& a = *b.a;
  const int64_t K8 = b.K8, steps = K8 / VW;
  const Operand xo = b.xp ? Operand{b.xp + m * K8, MR * VW, VW}
                          : Operand{a.x + m * a.ldx, VW, a.ldx};
  for (int64_t s0 = 0;;) {
    const int64_t s1 = s0 + b.kc < steps ? s0 + b.kc : steps;
    const bool first = s0 == 0, last = s1 == steps;
    int64_t n = n0;
    vf* save = accs;
    for (; n + NR_BIG <= n1; n += NR_BIG, save += MR * NR_BIG) {
      const Operand wo = wpack ? Operand{wpack + (n - n0) * K8, NR_BIG * VW, VW}
                               : Operand{static_cast<const float*>(a.w) + n * a.K, VW, a.K};
      big_tile<MR, NR_BIG>(a, xo, wo, s0, s1, save, first, last, m, n);
    }
    for (; n < n1; ++n, save += MR) {
      const Operand wo = wpack ? Operand{wpack + (n - n0) * K8, VW, VW}
                               : Operand{static_cast<const float*>(a.w) + n * a.K, VW, a.K};
      big_tile<MR, 1>(a, xo, wo, s0, s1, save, first, last, m, n);
    }
    if (last) break;
    s0 = s1;
  }
}

template <int MR>
inline void packed_panel_tail(const BigArgs& b, const float* wpack, vf* accs, int64_t m,
                              int64_t n0, int64_t n1) {
  if constexpr (MR > 0) {
    if (b.a->M - m == MR) packed_panel<MR>(b, wpack, accs, m, n0, n1);
    else packed_panel_tail<MR - 1>(b, wpack, accs, m, n0, n1);
  }
}

// Pack rows [r0, r0 + mr) of x (or columns of w: the same [rows, K] layout) as one panel.
inline void pack_panel(const float* src, int64_t ld, int64_t mr, int64_t K8, float* dst) {
  for (int64_t s = 0; s < K8; s += VW)
    for (int64_t i = 0; i < mr; ++i, dst += VW) std::memcpy(dst, src + i * ld + s, VW * 4);
}

void big_item(void* p, int64_t item) {
  const BigArgs& b = *static_cast<const BigArgs*>(p);
  const LinearArgs& a = *b.a;
  const int64_t n0 = item * a.nb;
  const int64_t n1 = n0 + a.nb < a.N ? n0 + a.nb : a.N;
  const int64_t K8 = b.K8;
  vf* accs = reinterpret_cast<vf*>(t_accs.get((n1 - n0) * MR_BIG * VW + VW));
  float* wpack = b.pack_w ? t_wpack.get((n1 - n0) * K8 + 1) : nullptr;
  if (!accs || (b.pack_w && !wpack)) std::abort();
  if (wpack) {
    int64_t n = n0;  // the same column tiles as packed_panel: full NR_BIG tiles, then single
    for (; n + NR_BIG <= n1; n += NR_BIG)
      pack_panel(static_cast<const float*>(a.w) + n * a.K, a.K, NR_BIG, K8, wpack + (n - n0) * K8);
    for (; n < n1; ++n) pack_panel(static_cast<const float*>(a.w) + n * a.K, a.K, 1, K8, wpack + (n - n0) * K8);
  }
  int64_t m = 0;
  for (; m + MR_BIG <= a.M; m += MR_BIG) packed_panel<MR_BIG>(b, wpack, accs, m, n0, n1);
  if (m < a.M) packed_panel_tail<MR_BIG - 1>(b, wpack, accs, m, n0, n1);
}

void pack_x_item(void* p, int64_t panel) {
  const BigArgs& b = *static_cast<const BigArgs*>(p);
  const LinearArgs& a = *b.a;
  const int64_t m = panel * MR_BIG;
  const int64_t mr = a.M - m < MR_BIG ? a.M - m : MR_BIG;
  pack_panel(a.x + m * a.ldx, a.ldx, mr, b.K8, const_cast<float*>(b.xp) + m * b.K8);
}

// The many-rows path on at most kBigRows rows (bounds the packed x buffer): pack x (in
// parallel, by panels), then the column items.
constexpr int64_t kBigRows = 512;
// lls_linear_f32 packs from 12 panels (measured on Zen 3: a loss at 2 panels, even at 8, a
// gain from 16); lls_linear_packed_f32 from one (on an Intel Xeon with AVX-512, M=16..64 run
// in 0.77-0.80x the time). Packing changes no bits, so the GEMM probe picks between the two
// per shape on the CPU it runs on.
constexpr int64_t kPackMinRows = 12 * MR_BIG;

void linear_big_rows(LinearArgs& a) {
  const CacheSizes& cs = cache_sizes();
  const int64_t K8 = a.K / VW * VW, steps = K8 / VW;
  BigArgs b;
  b.a = &a;
  b.K8 = K8;
  // Pack (and block K) once an item's w block is reused by enough x panels to pay for the
  // copies (measured on Zen 3: a loss at 2 panels, even at 8, a gain from 16). Below, the
  // tiles read x and w in place over the whole K, as before.
  const bool pack = a.M >= a.pack_min_rows;
  b.pack_w = pack;
  b.xp = nullptr;
  if (pack) {
    b.xp = t_xpack.get(a.M * K8 + 1);
    if (!b.xp) std::abort();
  }
  // w block of an item: about half of L2, in whole tiles (a multiple of NR too: the same
  // column tails as the small-M path's items).
  const int64_t q = 4 * NR_BIG;
  const int64_t nb = (cs.l2 / 2 / 4 / (a.K > 0 ? a.K : 1)) / q * q;
  a.nb = nb < q ? q : nb > 256 ? 256 : nb;
  // K block: an x panel block and a w tile block in 3/4 of L1 (Zen 3: 109 vectors, so K=768
  // runs unblocked and K=2048 in three blocks), balanced over the blocks.
  int64_t kc = cs.l1d * 3 / 4 / ((MR_BIG + NR_BIG) * VW * 4);
  if (kc < 16) kc = 16;
  if (!pack) kc = steps;
  const int64_t nkb = steps > kc ? (steps + kc - 1) / kc : 1;
  b.kc = steps > 0 ? (steps + nkb - 1) / nkb : 1;
  const bool par = a.M * a.N * a.K >= (1 << 18);
  if (pack && K8 > 0)
    parallel_for(pack_x_item, &b, (a.M + MR_BIG - 1) / MR_BIG, par && a.M * K8 >= (1 << 16));
  const int64_t items = (a.N + a.nb - 1) / a.nb;
  parallel_for(big_item, &b, items, par, g_linger_us);
}

// Rows are independent (every output is its own FMA chain), so cutting M into chunks changes
// no bits; chunks are balanced and each keeps more than MR_MAX rows.
void linear_big(const LinearArgs& a) {
  const int64_t chunks = (a.M + kBigRows - 1) / kBigRows;
  const int64_t rows = (a.M + chunks - 1) / chunks;
  for (int64_t r0 = 0; r0 < a.M; r0 += rows) {
    LinearArgs c = a;
    c.x = a.x + r0 * a.ldx;
    c.M = a.M - r0 < rows ? a.M - r0 : rows;
    for (int p = 0; p < a.nparts; ++p) c.out[p] = a.out[p] + r0 * a.ld[p];
    linear_big_rows(c);
  }
}

// The per-item tiles of the many-rows path for bf16 weights (an item's block widened to
// float32 first, in linear_item) and, under LLS_LINEAR_REFERENCE, the float32 path before
// packing and blocking: each MR_BIG x NR_BIG tile reads x and w in place over the whole K.
template <class WT, int MR, int NRT>
inline void linear_tile_big(const LinearArgs& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const WT* w = static_cast<const WT*>(a.w) + (n0 - a.w_row0) * K;
  const float* x = a.x + m0 * a.ldx;
  vf acc[MR][NRT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NRT; ++j) acc[i][j] = vf{};
  int64_t k = 0;
  for (; k + VW <= K; k += VW) {
    vf wv[NRT];
    for (int j = 0; j < NRT; ++j) {
      wv[j] = wload(w + j * K + k);
      asm("" : "+x"(wv[j]));  // keep w in a register: one load per k step, not one per row
    }
    for (int i = 0; i < MR; ++i) {
      vf xv = vload(x + i * a.ldx + k);
      asm("" : "+x"(xv));
      for (int j = 0; j < NRT; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  float sums[MR][NRT];
  for (int i = 0; i < MR; ++i) hsum_n<NRT>(acc[i], sums[i]);
  store_tile<WT, MR, NRT>(a, sums, x, w, k, m0, n0);
}

template <class WT, int MR>
inline void linear_rows(const LinearArgs& a, int64_t m, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR_BIG <= n1; n += NR_BIG) linear_tile_big<WT, MR, NR_BIG>(a, m, n);
  for (; n < n1; ++n) linear_tile_big<WT, MR, 1>(a, m, n);
}

template <class WT, int MR>
inline void linear_rows_tail(const LinearArgs& a, int64_t m, int64_t n0, int64_t n1) {
  if constexpr (MR > 0) {
    if (a.M - m == MR) linear_rows<WT, MR>(a, m, n0, n1);
    else linear_rows_tail<WT, MR - 1>(a, m, n0, n1);
  }
}

template <class WT>
void linear_item(void* p, int64_t item) {
  const LinearArgs& a = *static_cast<const LinearArgs*>(p);
  const int64_t n0 = item * a.nb;
  const int64_t n1 = n0 + a.nb < a.N ? n0 + a.nb : a.N;
  int64_t n = n0;
  if (a.M > MR_MAX) {
    if constexpr (!std::is_same<WT, float>::value) {
      // Many rows reuse the item's weight block: widen it to float32 once (exact), then run
      // the float32 tiles on it, instead of widening every weight vector for every row tile.
      // The same values in the same FMA chain: the bits are those of the bf16 tiles.
      static thread_local std::vector<float> block;
      const int64_t K = a.K, count = (n1 - n0) * K;
      if ((int64_t)block.size() < count) block.resize(count);
      const WT* src = static_cast<const WT*>(a.w) + n0 * K;
      for (int64_t i = 0; i < count; ++i) block[i] = wscalar(src[i]);
      LinearArgs b = a;
      b.w = block.data();
      b.w_row0 = n0;
      int64_t m = 0;
      for (; m + MR_BIG <= b.M; m += MR_BIG) linear_rows<float, MR_BIG>(b, m, n0, n1);
      if (m < b.M) linear_rows_tail<float, MR_BIG - 1>(b, m, n0, n1);
      return;
    }
    int64_t m = 0;
    for (; m + MR_BIG <= a.M; m += MR_BIG) linear_rows<WT, MR_BIG>(a, m, n0, n1);
    if (m < a.M) linear_rows_tail<WT, MR_BIG - 1>(a, m, n0, n1);
    return;
  }
  if (a.M <= 2)
    for (; n + NR_WIDE <= n1; n += NR_WIDE) linear_cols<WT, NR_WIDE>(a, n);
  for (; n + NR <= n1; n += NR) linear_cols<WT, NR>(a, n);
  for (; n < n1; ++n) linear_cols<WT, 1>(a, n);
}

#ifdef LLS_LINEAR_REFERENCE
void reference_item(void* p, int64_t item) {
  const LinearArgs& a = *static_cast<const LinearArgs*>(p);
  const int64_t n0 = item * a.nb;
  const int64_t n1 = n0 + a.nb < a.N ? n0 + a.nb : a.N;
  int64_t m = 0;
  for (; m + MR_BIG <= a.M; m += MR_BIG) linear_rows<float, MR_BIG>(a, m, n0, n1);
  if (m < a.M) linear_rows_tail<float, MR_BIG - 1>(a, m, n0, n1);
}
#endif  // LLS_LINEAR_REFERENCE

// The arguments every linear entry point takes, checked and stored in ``a``: false when
// they are inconsistent (negative sizes, ldx < K, a split that does not cover [0, N), an
// output narrower than its part).
bool set_linear_args(LinearArgs& a, const float* x, int64_t ldx, const void* w,
                     const float* bias, int64_t M, int64_t N, int64_t K, int nparts,
                     const int64_t* split, float* const* out, const int64_t* ld) {
  if (M < 0 || N < 0 || K < 0 || nparts < 1 || nparts > kMaxParts || ldx < K) return false;
  a.x = x; a.ldx = ldx; a.w = w; a.w_row0 = 0; a.bias = bias; a.M = M; a.N = N; a.K = K;
  a.nparts = nparts;
  for (int p = 0; p <= nparts; ++p) a.split[p] = split[p];
  if (a.split[0] != 0 || a.split[nparts] != N) return false;
  for (int p = 0; p < nparts; ++p) {
    if (a.split[p + 1] < a.split[p] || ld[p] < a.split[p + 1] - a.split[p]) return false;
    a.out[p] = out[p];
    a.ld[p] = ld[p];
  }
  return true;
}

// Argument checks and the work split shared by the float32 and bf16 weight entry points.
template <class WT>
int linear(const float* x, int64_t ldx, const WT* w, const float* bias, int64_t M, int64_t N,
           int64_t K, int nparts, const int64_t* split, float* const* out, const int64_t* ld,
           int64_t pack_min_rows = kPackMinRows) {
  LinearArgs a;
  if (!set_linear_args(a, x, ldx, w, bias, M, N, K, nparts, split, out, ld)) return -1;
  a.pack_min_rows = pack_min_rows;
  if (M == 0 || N == 0) return 0;
  // ~64 output columns per item (a multiple of NR): enough items for dynamic balancing, few
  // enough that the per-item cost stays negligible. Small problems run on the calling thread.
  // The split depends on the shapes only (not on WT), so bf16 weights tile like float32 ones.
  if constexpr (std::is_same<WT, float>::value) {
    if (M > MR_MAX) {    // packed and blocked (above); the same bits as the tiles below
      linear_big(a);
      return 0;
    }
  }
  a.nb = 64;
  if (M > MR_MAX) {  // bf16: w block of an item: ~256 KB of float32 (half of a typical L2)
    const int64_t q = 4 * NR_BIG;   // a multiple of NR too: the same column tails as below
    const int64_t nb = (int64_t(64) * 1024 / (K > 0 ? K : 1)) / q * q;
    a.nb = nb < q ? q : nb > 256 ? 256 : nb;
  }
  const int64_t items = (N + a.nb - 1) / a.nb;
  parallel_for(linear_item<WT>, &a, items, M * N * K >= (1 << 18), g_linger_us);
  return 0;
}

}  // namespace

extern "C" {

int lls_layer_ops_abi_version() { return 6; }

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
  return linear<float>(x, ldx, w, bias, M, N, K, nparts, split, out, ld);
}

// lls_linear_f32, packing x and w panels whenever the many-rows path runs (M > MR_MAX):
// the same bits, faster or slower depending on the CPU (see kPackMinRows).
int lls_linear_packed_f32(const float* x, int64_t ldx, const float* w, const float* bias,
                          int64_t M, int64_t N, int64_t K, int nparts, const int64_t* split,
                          float* const* out, const int64_t* ld) {
  return linear<float>(x, ldx, w, bias, M, N, K, nparts, split, out, ld, 1);
}

// The same contract with w as bfloat16 bits [N, K] (uint16). Activations, bias, accumulation
// and output stay float32; each weight is widened exactly, so y equals lls_linear_f32 on the
// float32 values of the bf16 weights, bit for bit (and is batch-invariant in the same way),
// while the weight stream (the cost at decode) is halved.
int lls_linear_bf16(const float* x, int64_t ldx, const bf16_t* w, const float* bias, int64_t M,
                    int64_t N, int64_t K, int nparts, const int64_t* split, float* const* out,
                    const int64_t* ld) {
  return linear<bf16_t>(x, ldx, w, bias, M, N, K, nparts, split, out, ld);
}

#ifdef LLS_LINEAR_REFERENCE
// lls_linear_f32 with the many-rows path of before (no packing, no K blocking, ~256 KB w
// blocks); M <= MR_MAX runs the same code as lls_linear_f32.
int lls_linear_reference_f32(const float* x, int64_t ldx, const float* w, const float* bias,
                             int64_t M, int64_t N, int64_t K, int nparts, const int64_t* split,
                             float* const* out, const int64_t* ld) {
  if (M <= MR_MAX) return lls_linear_f32(x, ldx, w, bias, M, N, K, nparts, split, out, ld);
  LinearArgs a;
  if (!set_linear_args(a, x, ldx, w, bias, M, N, K, nparts, split, out, ld)) return -1;
  if (N == 0) return 0;
  const int64_t q = 4 * NR_BIG;
  const int64_t nb = (int64_t(64) * 1024 / (K > 0 ? K : 1)) / q * q;
  a.nb = nb < q ? q : nb > 256 ? 256 : nb;
  const int64_t items = (N + a.nb - 1) / a.nb;
  parallel_for(reference_item, &a, items, M * N * K >= (1 << 18), g_linger_us);
  return 0;
}
#endif

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
            (int)a.K, 1.0f, a.x, (int)a.ldx, static_cast<const float*>(a.w) + lo * a.K, (int)a.K,
            0.0f, out, (int)a.ld[q]);
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
  if (!sgemm || items < 1 || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX ||
      ldx > INT32_MAX)
    return -1;
  BlasArgs b;
  LinearArgs& a = b.a;
  b.sgemm = sgemm;
  if (!set_linear_args(a, x, ldx, w, bias, M, N, K, nparts, split, out, ld)) return -1;
  for (int p = 0; p < nparts; ++p)
    if (ld[p] > INT32_MAX) return -1;
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
