// CPU kernels for the model's layers: linear (GEMM on weights packed in panels), RMSNorm and
// LayerNorm (with fused residual add), rotary embedding, SiLU-and-mul, GELU and a row add.
// All tensors are row-major float32, except the linear weights of lls_linear_bf16 (bfloat16
// bits, widened to float32 in registers: the arithmetic and its order are those of
// lls_linear_f32); rows may be strided where a stride argument says so.
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
#include <utility>
#include <vector>
#include <unistd.h>
#if defined(__linux__)
#include <dlfcn.h>
#endif

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
// ---------------------------------------------------------------------------------------------
// Linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), for a weight W [N, K] (HF's [out, in])
// packed once, at load time, into panels of NP output columns (``panel_width()``):
//   panel p holds columns [p * NP, (p + 1) * NP) as K rows of NP values, element (n, k) of W
//   at wp[(n / NP) * K * NP + k * NP + n % NP]; N is padded with zero columns to whole panels.
// A k step of a panel is NP contiguous values, and a whole panel one contiguous stream (at
// decode, the weight read is the whole cost).
//
// Every output is ONE scalar FMA chain over k in order, acc = fma(x[m, k], w[n, k], acc) from
// acc = 0 for k = 0 .. K-1, then + bias[n]. A register tile holds R rows x NRV vectors of a
// panel: per k step it loads NRV vectors of w, broadcasts R values of x and does R * NRV FMAs
// (an outer product). The tile shape, the K blocks (partial sums are stored and reloaded
// exactly), the row chunks and the threads change where a chain runs, never its operations:
// a row's bits depend neither on the batch around it (batch invariance) nor on the thread
// count.
#if LLS_VW == 16
constexpr int NRV = 4, MR = 6;  // 24 accumulators + 4 w + 1 broadcast of 32 zmm registers
#else
constexpr int NRV = 2, MR = 6;  // 12 accumulators + 2 w + 1 broadcast of 16 registers
#endif
constexpr int NP = NRV * VW;
// Up to this many rows a tile spans two panels: two weight streams in flight, measured ~7%
// more read bandwidth than one at M=1 (Intel Xeon, AVX-512).
constexpr int kSmallRows = 2;
// One row spans enough panels for 8 accumulator chains: two on the AVX-512 build, four on the
// others. With the 4 chains of two AVX2 panels, a batch-1 step's bf16 projections read their
// weights 5-10% slower (0.77-0.78 against 0.80-0.85 of the all-core read probe in three runs,
// AMD Zen 3, the 97 M model's 48 projections, interleaved; fp32 0.81 against 0.89, one run):
// each chain's FMAs wait on their loads, and four chains keep too few of them in flight
// (docs/benchmarks.md, 2026-11-26, fourth session).
constexpr int kOneRowPanels = 8 / NRV;
// Software prefetch of the weight stream, this far ahead (over the tile's panels), in the
// first row tile of each K block, the one that brings the block in from memory.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kMaxChunkRows = 512;
// bf16 weights: up to this many rows in a chunk, the tiles widen the weights as they load them
// (each row tile again, from L1); above, a K block is widened to float32 once and the float32
// tiles run on it. On the AVX2 build, widening in the tiles took 0.66-0.89x the time from 7 to
// 32 rows (AMD Zen 3, bench_linear --kernel widen, the same bits) and bf16 decode steps of 8,
// 16 and 32 sequences 0.80-0.92x (bench_model); at 64 rows bench_linear read 0.91-0.97x but
// bench_model's steps 1.05-1.10x. The AVX-512 build keeps widening once above one row tile: it
// has not been measured there.
#if LLS_VW == 16
constexpr int64_t kWidenOnceAbove = MR;
#else
constexpr int64_t kWidenOnceAbove = 32;
#endif

inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// expf over a whole vector, from glibc's libmvec (the vector variants of libm, within 1 ulp
// as its scalar expf; what GCC calls for a vectorized expf under -ffast-math, which these
// kernels cannot take): the AVX-512 or AVX2 variant this build's vector width calls for,
// looked up once; null where libmvec or the variant is missing (then expf, one by one). The
// SiLU's exps one by one were ~12% of a bf16 prefill step (perf, Intel Xeon).
typedef vf (*VecExpFn)(vf);

VecExpFn vector_exp() {
  static const VecExpFn fn = []() -> VecExpFn {
#if defined(__linux__) && (LLS_VW == 16 || (LLS_VW == 8 && defined(__AVX2__)))
    void* lib = dlopen("libmvec.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    return reinterpret_cast<VecExpFn>(dlsym(lib, LLS_VW == 16 ? "_ZGVeN16v_expf"
                                                             : "_ZGVdN8v_expf"));
#else
    return nullptr;
#endif
  }();
  return fn;
}

inline vf vbroadcast(const float* p) {
#if LLS_VW == 16
  return (vf)_mm512_set1_ps(*p);  // a load with broadcast, not a shuffle on the FMA port
#elif LLS_VW == 8
  return (vf)_mm256_broadcast_ss(p);
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = *p;
  return v;
#endif
}

// Output parts: columns [split[p], split[p+1]) of the logical [M, N] result go to out[p] with
// row stride ld[p] (a fused qkv projection can write q, k and v into separate tensors).
constexpr int kMaxParts = 4;

struct LinearArgs {
  const float* x;
  int64_t ldx;
  const void* w;  // packed panels, float or bf16_t: the kernels' template argument
  const float* bias;
  int64_t M, N, K;
  int nparts;
  int64_t split[kMaxParts + 1];
  float* out[kMaxParts];
  int64_t ld[kMaxParts];
};

// Columns [n0, n1) of rows [m0, m1) from the tile sums c (row stride ldc, column n0 first),
// plus the bias, into the output parts.
inline void store_rows(const LinearArgs& a, const float* c, int64_t ldc, int64_t m0, int64_t m1,
                       int64_t n0, int64_t n1) {
  for (int q = 0; q < a.nparts; ++q) {
    const int64_t lo = a.split[q] > n0 ? a.split[q] : n0;
    const int64_t hi = a.split[q + 1] < n1 ? a.split[q + 1] : n1;
    if (lo >= hi) continue;
    for (int64_t m = m0; m < m1; ++m) {
      const float* s = c + (m - m0) * ldc + (lo - n0);
      float* o = a.out[q] + m * a.ld[q] + (lo - a.split[q]);
      if (a.bias) {
        const float* b = a.bias + lo;
        for (int64_t n = 0; n < hi - lo; ++n) o[n] = s[n] + b[n];
      } else {
        int64_t n = 0;
        for (; n + VW <= hi - lo; n += VW) vstore(o + n, vload(s + n));
        for (; n < hi - lo; ++n) o[n] = s[n];
      }
    }
  }
}

// Where columns [n0, n0 + width) of rows from m0 on go when they all go to one output part
// and there is no bias: the kernels then store their final sums there directly (null: into a
// buffer, copied out by store_rows, whose row-by-row copies were ~6% of a bf16 prefill step).
inline float* direct_out(const LinearArgs& a, int64_t n0, int64_t width, int64_t m0,
                         int64_t& ld) {
  if (a.bias || n0 + width > a.N) return nullptr;
  for (int q = 0; q < a.nparts; ++q)
    if (a.split[q] <= n0 && n0 + width <= a.split[q + 1]) {
      ld = a.ld[q];
      return a.out[q] + m0 * ld + (n0 - a.split[q]);
    }
  return nullptr;
}

// R rows x G panels (NRV vectors each) over k in [0, kn): x row i at x + i * ldx (the block's
// first k), panel g's block at w[g]; the sums of row i, panel g loaded from c + i * ldc +
// g * NP (or zero: first, the block starts the chains) and stored to d + i * ldd + g * NP (c
// itself, or for the last K block the output, see op_item).
template <class WT, int R, int G, bool PF>
inline void op_tile(const float* x, int64_t ldx, const WT* const* w, int64_t kn,
                    const float* c, int64_t ldc, bool first, float* d, int64_t ldd) {
  // The fixed-count loops are unrolled before GCC's scalar replacement of ``acc``: left rolled,
  // the AVX2 build kept ``acc`` mirrored on the stack, one store per FMA (1.2x the time).
  constexpr int NV = G * NRV;
  constexpr int64_t ahead = kPrefetchBytes / G / sizeof(WT);
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = first ? vf{} : vload(c + i * ldc + j * VW);
  for (int64_t k = 0; k < kn; ++k) {
    vf wv[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      const WT* p = w[j / NRV] + k * NP + (j % NRV) * VW;
      if constexpr (PF) __builtin_prefetch(p + ahead);
      wv[j] = wload(p);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const vf xb = vbroadcast(x + i * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(xb, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) vstore(d + i * ldd + j * VW, acc[i][j]);
}

// op_tile with R = r rows (1 <= r <= RMAX), chosen at run time.
template <class WT, int G, int RMAX>
inline void op_tile_rows(int r, bool pf, const float* x, int64_t ldx, const WT* const* w,
                         int64_t kn, const float* c, int64_t ldc, bool first, float* d,
                         int64_t ldd) {
  if constexpr (RMAX > 0) {
    if (r == RMAX) {
      if (pf) op_tile<WT, RMAX, G, true>(x, ldx, w, kn, c, ldc, first, d, ldd);
      else op_tile<WT, RMAX, G, false>(x, ldx, w, kn, c, ldc, first, d, ldd);
    } else {
      op_tile_rows<WT, G, RMAX - 1>(r, pf, x, ldx, w, kn, c, ldc, first, d, ldd);
    }
  }
}

// Grows, never shrinks; one per thread. Bounded: tile sums by kMaxChunkRows x 2 panels (one
// row x kOneRowPanels), the widened bf16 block by kc x NP.
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

thread_local AlignedBuffer t_sums, t_wide;

struct OpArgs {
  LinearArgs a;
  int64_t panels;  // ceil(N / NP)
  int G;           // panels per item: kOneRowPanels for one row, 2 for few, else 1
  int64_t mc;      // rows per chunk (a multiple of MR, or all rows)
  int64_t kc;      // K block
  int status;      // set to -1 by an item that could not allocate its buffers
};

// One item: rows [m0, m1) of one row chunk against the item's G panels.
template <class WT>
void op_item(void* p, int64_t item) {
  OpArgs& o = *static_cast<OpArgs*>(p);
  const LinearArgs& a = o.a;
  const int64_t groups = (o.panels + o.G - 1) / o.G;
  const int64_t m0 = item / groups * o.mc;
  const int64_t m1 = m0 + o.mc < a.M ? m0 + o.mc : a.M;
  const int64_t p0 = item % groups * o.G;
  const int g = o.panels - p0 < o.G ? int(o.panels - p0) : o.G;
  const int64_t K = a.K, ldc = g * NP, rows = m1 - m0;
  const WT* panel = static_cast<const WT*>(a.w) + p0 * K * NP;
  float* c = t_sums.get(rows * ldc);
  if (!c) {
    o.status = -1;
    return;
  }
  if (K == 0) std::memset(c, 0, rows * ldc * 4);
  // The last K block stores its sums straight into the output where the item's columns all go
  // to one part and there is no bias, rather than into c for store_rows to copy out: the copy
  // was 3-4% of a B=64 decode step and of a prefill (perf, AMD Zen 4, fp32; AVX2 build too).
  const int64_t n0 = p0 * NP, n1 = n0 + g * NP < a.N ? n0 + g * NP : a.N;
  int64_t ldo = 0;
  float* const out = direct_out(a, n0, g * NP, m0, ldo);
  for (int64_t k0 = 0; k0 < K; k0 += o.kc) {
    const int64_t kn = o.kc < K - k0 ? o.kc : K - k0;
    const float* x = a.x + m0 * a.ldx + k0;
    const bool first = k0 == 0;
    const bool to_out = out && k0 + kn == K;
    float* const d = to_out ? out : c;
    const int64_t ldd = to_out ? ldo : ldc;
    if constexpr (kOneRowPanels == 4) {
      if (o.G == 4) {  // one row: a tile of four panels (of the last group's: two, one)
        for (int q = 0, t; q < g; q += t) {
          t = g - q >= 4 ? 4 : g - q >= 2 ? 2 : 1;
          const WT* w0 = panel + (q * K + k0) * NP;
          const WT* w[4] = {w0, w0 + K * NP, w0 + 2 * K * NP, w0 + 3 * K * NP};
          const float* cq = c + q * NP;
          float* dq = d + q * NP;
          if (t == 4) op_tile<WT, 1, 4, true>(x, a.ldx, w, kn, cq, ldc, first, dq, ldd);
          else if (t == 2) op_tile<WT, 1, 2, true>(x, a.ldx, w, kn, cq, ldc, first, dq, ldd);
          else op_tile<WT, 1, 1, true>(x, a.ldx, w, kn, cq, ldc, first, dq, ldd);
        }
        continue;
      }
    }
    if (g == 2) {  // few rows (<= kSmallRows): one tile, two panels
      const WT* w[2] = {panel + k0 * NP, panel + K * NP + k0 * NP};
      op_tile_rows<WT, 2, kSmallRows>(int(rows), true, x, a.ldx, w, kn, c, ldc, first, d, ldd);
      continue;
    }
    const WT* wb = panel + k0 * NP;
    if constexpr (!std::is_same<WT, float>::value) {
      if (rows > kWidenOnceAbove) {
        // Many row tiles reuse the block: widen it to float32 once (exact), then run the
        // float32 tiles on it: the same values in the same chains, so the same bits.
        float* wide = t_wide.get(kn * NP);
        if (!wide) {
          o.status = -1;
          return;
        }
        for (int64_t i = 0; i < kn * NP; ++i) wide[i] = wscalar(wb[i]);
        const float* w[1] = {wide};
        for (int64_t m = 0; m < rows; m += MR) {
          const int r = rows - m < MR ? int(rows - m) : MR;
          op_tile_rows<float, 1, MR>(r, false, x + m * a.ldx, a.ldx, w, kn, c + m * ldc, ldc,
                                     first, d + m * ldd, ldd);
        }
        continue;
      }
    }
    const WT* w[1] = {wb};
    for (int64_t m = 0; m < rows; m += MR) {
      const int r = rows - m < MR ? int(rows - m) : MR;
      op_tile_rows<WT, 1, MR>(r, m == 0, x + m * a.ldx, a.ldx, w, kn, c + m * ldc, ldc, first,
                              d + m * ldd, ldd);
    }
  }
  if (!out || K == 0) store_rows(a, c, ldc, m0, m1, n0, n1);
}

// Cache sizes of this CPU, read at run time (sysconf, else sysfs, else typical values): they
// set the linear kernel's blocking.
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

// The arguments every linear entry point takes, checked and stored in ``a``: false when
// they are inconsistent (negative sizes, ldx < K, a split that does not cover [0, N), an
// output narrower than its part).
bool set_linear_args(LinearArgs& a, const float* x, int64_t ldx, const void* w,
                     const float* bias, int64_t M, int64_t N, int64_t K, int nparts,
                     const int64_t* split, float* const* out, const int64_t* ld) {
  if (M < 0 || N < 0 || K < 0 || nparts < 1 || nparts > kMaxParts || ldx < K) return false;
  a.x = x; a.ldx = ldx; a.w = w; a.bias = bias; a.M = M; a.N = N; a.K = K;
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

// Blocking: a row chunk's x (mc x K) stays in L2 while the item's panels pass over it, and a
// panel's K block (kc x NP) in L1 while the chunk's row tiles pass over it. A chunk keeps at
// least 96 rows (fewer re-reads of the weights), at most kMaxChunkRows.
template <class WT>
int linear(const float* x, int64_t ldx, const WT* w, const float* bias, int64_t M, int64_t N,
           int64_t K, int nparts, const int64_t* split, float* const* out, const int64_t* ld) {
  OpArgs o;
  LinearArgs& a = o.a;
  if (!set_linear_args(a, x, ldx, w, bias, M, N, K, nparts, split, out, ld)) return -1;
  if (M == 0 || N == 0) return 0;
  const CacheSizes& cs = cache_sizes();
  o.panels = (N + NP - 1) / NP;
  o.G = M == 1 ? kOneRowPanels : M <= kSmallRows ? 2 : 1;
  int64_t mc = cs.l2 / 2 / (4 * (K > 0 ? K : 1)) / MR * MR;
  mc = mc < 96 ? 96 : mc > kMaxChunkRows ? kMaxChunkRows : mc;
  if (M <= mc) {
    o.mc = M;
  } else {  // balanced chunks, whole row tiles
    const int64_t chunks = (M + mc - 1) / mc;
    o.mc = ((M + chunks - 1) / chunks + MR - 1) / MR * MR;
  }
  int64_t kc = K;
  if (o.mc > MR) {  // the block is reused by several row tiles: keep it in L1
    kc = cs.l1d * 2 / 3 / (NP * int64_t(sizeof(float)));
    if (kc < 16) kc = 16;
    const int64_t blocks = K > kc ? (K + kc - 1) / kc : 1;
    kc = (K + blocks - 1) / blocks;
  }
  o.kc = kc > 0 ? kc : 1;
  o.status = 0;
  const int64_t items = (M + o.mc - 1) / o.mc * ((o.panels + o.G - 1) / o.G);
  parallel_for(op_item<WT>, &o, items, M * N * K >= (1 << 18), g_linger_us);
  return o.status;
}

}  // namespace

extern "C" {

int lls_layer_ops_abi_version() { return 15; }

// 1 when silu_and_mul_f32 takes its exps from libmvec (vector_exp), else 0.
int lls_vector_exp_available() { return vector_exp() != nullptr; }

int lls_layer_ops_vector_width() { return VW; }

// Output columns per panel of the packed weight layout (see "Linear" above).
int lls_layer_ops_panel_width() { return NP; }

void lls_layer_ops_set_parallel_for(ParallelForFn fn) { g_parallel_for = fn; }

// How long (us) the pool's helpers keep spinning after a layer op, waiting for the next one.
void lls_layer_ops_set_linger_us(int64_t us) { g_linger_us = us < 0 ? 0 : us; }

// y = x @ W.T (+ bias), written into nparts column ranges: columns [split[p], split[p+1]) of
// row m go to out[p] + m * ld[p]. x: [M, K] with row stride ldx; wp: W [N, K] packed in
// panels (ceil(N / NP) * K * NP floats, see "Linear" above). Returns 0, or -1 on bad arguments
// or when a work buffer could not be allocated.
int lls_linear_f32(const float* x, int64_t ldx, const float* wp, const float* bias, int64_t M,
                   int64_t N, int64_t K, int nparts, const int64_t* split, float* const* out,
                   const int64_t* ld) {
  return linear<float>(x, ldx, wp, bias, M, N, K, nparts, split, out, ld);
}

// The same contract with the packed weight as bfloat16 bits (uint16). Activations, bias,
// accumulation and output stay float32; each weight is widened exactly, so y equals
// lls_linear_f32 on the float32 values of the bf16 weights, bit for bit (and is
// batch-invariant in the same way), while the weight stream (the cost at decode) is halved.
int lls_linear_bf16(const float* x, int64_t ldx, const bf16_t* wp, const float* bias,
                    int64_t M, int64_t N, int64_t K, int nparts, const int64_t* split,
                    float* const* out, const int64_t* ld) {
  return linear<bf16_t>(x, ldx, wp, bias, M, N, K, nparts, split, out, ld);
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// bf16 weights AND bf16 activations (--dtype bfloat16 where the probe picks them), on AMX tiles
// (CPUs with amx_bf16) or with AVX512-BF16 dot products (avx512_bf16; see dot_tile below).
// On AMX, x is rounded to bf16 (nearest even) once per call; TDPBF16PS multiplies bf16
// pairs and accumulates in float32 tiles. The weight W [N, K] is packed (``pack_weight_amx``)
// into 16 x 32 tiles in the pair-interleaved ("VNNI") order the instruction reads, N padded to
// 32 and K to 32 with zeros, the two tiles of 32 output columns side by side:
//   tile (nb, kb) at wt + ((nb / 2 * Kp/32 + kb) * 2 + nb % 2) * 512, row r holding, for
//   n = 0..15, the pair (W[16 nb + n, 32 kb + 2r], W[16 nb + n, 32 kb + 2r + 1]).
// A strip is 32 output columns (two weight tiles) over all rows, 32 at a time (four float32
// accumulator tiles): its weight is one contiguous stream (what a few rows' decode step
// costs), and it stays in L2 across row blocks. Every output element is the same sequence of
// tile products over k whatever M, the row's place and the thread: batch-invariant, like the
// float32 kernel (a different sum order, so not the same bits as it).
// The bf16-activation entry points' arguments, unused in a build without their kernel.
#define LLS_LINEAR_ARGS_UNUSED                                                             \
  (void)x, (void)ldx, (void)wt, (void)bias, (void)M, (void)N, (void)K, (void)nparts,       \
      (void)split, (void)out, (void)ld
#if defined(__AVX512BF16__) && !defined(LLS_NO_AVX512)
#define LLS_BF16DOT 1
#include <sched.h>
#endif
#if defined(LLS_BF16DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LLS_AMX 1
#include <sys/syscall.h>
#endif

namespace {

#ifdef LLS_BF16DOT
// Items per call: a few per usable core (the pool balances them), each a run of strips (for
// AMX, one tile configuration load). Against one item per strip: prefill 1x256 2969 -> 3622
// tok/s, decode B=16 23.9 -> 22.2 ms (bench_model, Intel Xeon, AMX).
int64_t bf16_items_per_call() {
  static const int64_t n = [] {
    cpu_set_t set;
    const int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    return int64_t(4) * (cores > 0 ? cores : 1);
  }();
  return n;
}

thread_local AlignedBuffer t_xb;
// Software prefetch of the weight strip this far ahead: +20% read bandwidth at one row in a
// standalone test of this loop (Intel Xeon), where the tile loads alone leave the hardware
// prefetcher behind.
constexpr int64_t kStripPrefetchBytes = 4096;

// x [M, K] (row stride ldx) -> bf16 [Mp, Kp], round to nearest even, zero-padded.
void round_rows_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, bf16_t* xb,
                     int64_t Mp, int64_t Kp) {
  for (int64_t m = 0; m < Mp; ++m) {
    bf16_t* o = xb + m * Kp;
    if (m >= M) {
      std::memset(o, 0, Kp * 2);
      continue;
    }
    const float* r = x + m * ldx;
    for (int64_t k = 0; k < Kp; k += 16) {
      const __mmask16 live = k + 16 <= K ? 0xFFFF : k < K ? (__mmask16)((1u << (K - k)) - 1) : 0;
      const __m512 v = _mm512_maskz_loadu_ps(live, r + k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// Work split shared by both bf16-activation kernels: 32-column strips, a run per item.
struct Bf16Args {
  LinearArgs a;
  const bf16_t* xb;  // x rounded to bf16, [Mp, Kp], zero-padded
  int64_t Mp, Kp;            // Mp: rows of xb, M padded (AMX: to 16 from 16 up; dot: 12)
  int tile_rows;             // AMX: rows of the x and sum tiles, min(M, 16)
  int64_t strips, per_item;  // 32-column strips, strips per item
  int64_t pair = 1;          // per_item is a multiple of this
};

// ---------------------------------------------------------------------------------------------
// The same product with AVX512-BF16 dot products (VDPBF16PS), for CPUs with avx512_bf16 (AMD
// Zen 4 has it, and no AMX). On the Intel Xeon (AMX) this was written on, a zmm VDPBF16PS
// issued every other cycle in a register-only loop: 124 GFLOP/s a core against 248 for FMAs,
// so there it loses to the widening kernel from a few rows up and the probe never picks it;
// it is for CPUs that issue it as fast as an FMA (not yet measured). The weight is packed as
// for AMX (a tile row is 16 output columns x one k pair, exactly one zmm), x rounded to bf16 as
// for AMX. A register tile of R rows x 32 columns (2R accumulators) takes per k pair two
// weight vectors and R broadcast x pairs: acc = dpbf16(acc, x pair, w pairs), k pairs in order
// from acc = 0. Every output is that one chain whatever M, R, the row's place or the thread:
// batch-invariant (other sums than AMX's).
constexpr int kDotRows = 12;  // 24 accumulators + 2 weight vectors + broadcasts of 32 zmm
// Up to 4 rows (kDotPairRows - 1), a tile takes two strips at once (two weight streams in
// flight) and leaves them to the hardware prefetchers: it asks for no line ahead. Against one
// strip, or a window of software prefetches (AMD Zen 4, 12 layers' projections, interleaved
// runs in read bandwidths of 33 to 66 GB/s; ms per pass): with the window, two strips won at 1,
// 3 and 4 rows (M=4 5.70 -> 5.29 ms) and lost at 2; without it, M=1 5.33 -> 4.50, 5.52 -> 5.13,
// 4.97 -> 4.42 (-7 to -15%), M=2 5.09 -> 4.81, 4.68 -> 3.80 (-5 to -19%), M=4 -1 to -7%; one strip
// without the window reads 10-20% slower at M=1. The requests ahead took line fill buffers of
// L1 that the hardware's streams into L2 use better. From 5 rows a tile takes one strip (more
// accumulators than registers soon) and keeps the window (M=8 3-10% faster with it).
constexpr int kDotPairRows = 5;  // above the largest row count that pairs
inline bool dot_pairs(int64_t M) { return M < kDotPairRows; }
// A strip's k block is 2 KB: 16 k pairs x two halves of 16 columns, 1 KB each (a tile row of
// one half is one 64-byte line). The first row tile of a strip brings it in from memory; from 5
// rows it keeps a window of kDotAheadBytes requested ahead of its loads: the first window at
// the strip's start, then one line further per line loaded. How a tile goes through a block
// (AMD Zen 4, the CPU the probe picks this kernel on; 12 layers' projections, interleaved runs):
// - a tile of few rows (R < kDotManyRows: decode batches up to 9) reads one half's 16 lines,
//   then the other's: the loads run in address order, as the window and the hardware's streams
//   do. Each half's sums are their own chains, so the order changes no bit. Against both halves
//   per k pair (lines r and 16 + r) with each block's 32 lines asked for at once: M=1 5.41 ->
//   5.25 ms and 5.30 -> 5.08, M=8 5.97 -> 5.46 and 5.80 -> 5.25, M=4 the same;
// - a tile of many rows loads both halves per k pair, 2R chains in flight for each weight
//   load, and asks for two lines per k pair (M=16 8.9 -> 7.4 ms, M=64 27.7 -> 26.2, M=128 53.1
//   -> 52.0 against each block asked for at once). Half after half measured slower there (M=16
//   7.7 -> 9.1 ms).
constexpr int kDotManyRows = 10;
constexpr int64_t kDotAheadBytes = 2048;

// x for the dot kernel: rounded to bf16 like round_rows_bf16, in blocks of kDotRows rows, each
// block k pair-major: pair p of block row i (an int32 of two bf16) at xp[(blk * Kp / 2 + p) *
// kDotRows + i]. A register tile's R broadcasts per k pair then read one contiguous run at
// fixed offsets, instead of R rows Kp * 2 bytes apart (an address register per row).
void round_pack_rows_dot(const float* x, int64_t ldx, int64_t M, int64_t K, bf16_t* xb,
                         int64_t /* Mp: the last block's unused slots stay unwritten */,
                         int64_t Kp) {
  int32_t* xp = reinterpret_cast<int32_t*>(xb);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * ldx;
    int32_t* o = xp + (m / kDotRows) * (Kp / 2) * kDotRows + m % kDotRows;
    for (int64_t k = 0; k < Kp; k += 16) {
      const __mmask16 live = k + 16 <= K ? 0xFFFF : k < K ? (__mmask16)((1u << (K - k)) - 1) : 0;
      alignas(32) int32_t pairs[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, r + k)));
      for (int t = 0; t < 8; ++t) o[(k / 2 + t) * kDotRows] = pairs[t];
    }
  }
}

// R rows x S strips (S * 32 columns; S = 2 where dot_pairs), sums into c [R, S * 32].
template <int R, int S>
inline void dot_tile(const Bf16Args& g, const bf16_t* w, int64_t m0, bool pf, float* c) {
  __m512 acc[S][2][R];
  #pragma GCC unroll 16
  for (int s = 0; s < S; ++s)
    #pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[s][0][i] = acc[s][1][i] = _mm512_setzero_ps();
  const int32_t* x = reinterpret_cast<const int32_t*>(g.xb) + m0 * (g.Kp / 2);
  const int64_t strip = g.Kp / 32 * 1024;  // bf16 values per strip
  // (requests past a strip's end fall on the next strip's, or on nothing a prefetch can fault on)
  constexpr int64_t ahead = kDotAheadBytes;
  constexpr bool window = R >= kDotPairRows;  // fewer rows: the hardware prefetchers alone
  if (window && pf) {
    #pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      const char* p = reinterpret_cast<const char*>(w + s * strip);
      for (int l = 0; l < ahead; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    }
  }
  for (int64_t kb = 0; kb < g.Kp / 32; ++kb) {
    const bf16_t* wk = w + kb * 1024;
    const int32_t* xk = x + kb * 16 * kDotRows;
    if (R < kDotManyRows && pf) {  // half after half, each half's lines in address order
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < 16; ++r) {
          __m512bh wv[S];
          #pragma GCC unroll 16
          for (int s = 0; s < S; ++s) {
            const bf16_t* p = wk + s * strip + h * 512 + r * 32;
            if constexpr (window) _mm_prefetch(reinterpret_cast<const char*>(p) + ahead,
                                               _MM_HINT_T0);
            wv[s] = (__m512bh)_mm512_load_si512(p);
          }
          #pragma GCC unroll 16
          for (int i = 0; i < R; ++i) {
            const __m512bh xi = (__m512bh)_mm512_set1_epi32(xk[r * kDotRows + i]);
            #pragma GCC unroll 16
            for (int s = 0; s < S; ++s) acc[s][h][i] = _mm512_dpbf16_ps(acc[s][h][i], xi, wv[s]);
          }
        }
      }
    } else {  // both halves per k pair (a tile of few rows too when the strip is in cache:
      // 2R chains in flight rather than R; half after half, M=16 = 12 + 4 rows read 2-3% slower)
      for (int r = 0; r < 16; ++r) {
        __m512bh wv[S][2];
        #pragma GCC unroll 16
        for (int s = 0; s < S; ++s) {
          if (pf) {  // this k pair's two lines, `ahead` further on
            const char* p = reinterpret_cast<const char*>(wk + s * strip + r * 64) + ahead;
            _mm_prefetch(p, _MM_HINT_T0);
            _mm_prefetch(p + 64, _MM_HINT_T0);
          }
          wv[s][0] = (__m512bh)_mm512_load_si512(wk + s * strip + r * 32);
          wv[s][1] = (__m512bh)_mm512_load_si512(wk + s * strip + 512 + r * 32);
        }
        #pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          const __m512bh xi = (__m512bh)_mm512_set1_epi32(xk[r * kDotRows + i]);
          #pragma GCC unroll 16
          for (int s = 0; s < S; ++s) {
            acc[s][0][i] = _mm512_dpbf16_ps(acc[s][0][i], xi, wv[s][0]);
            acc[s][1][i] = _mm512_dpbf16_ps(acc[s][1][i], xi, wv[s][1]);
          }
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      _mm512_store_ps(c + i * S * 32 + s * 32, acc[s][0][i]);
      _mm512_store_ps(c + i * S * 32 + s * 32 + 16, acc[s][1][i]);
    }
}

template <int S, int... Rs>
inline void dot_tile_rows(int r, const Bf16Args& g, const bf16_t* w, int64_t m0, bool pf,
                          float* c, std::integer_sequence<int, Rs...>) {
  ((r == Rs + 1 ? dot_tile<Rs + 1, S>(g, w, m0, pf, c) : void()), ...);
}

void dot_item(void* p, int64_t item) {
  const Bf16Args& g = *static_cast<const Bf16Args*>(p);
  const LinearArgs& a = g.a;
  alignas(64) float c[kDotRows * 32];
  const int64_t j0 = item * g.per_item;
  const int64_t j1 = j0 + g.per_item < g.strips ? j0 + g.per_item : g.strips;
  const int64_t strip = g.Kp / 32 * 1024;
  int64_t j = j0;
  if (dot_pairs(a.M)) {
    for (; j + 1 < j1; j += 2) {
      const int64_t n0 = 32 * j, n1 = n0 + 64 < a.N ? n0 + 64 : a.N;
      dot_tile_rows<2>(int(a.M), g, static_cast<const bf16_t*>(a.w) + j * strip, 0, true, c,
                       std::make_integer_sequence<int, kDotPairRows - 1>());
      store_rows(a, c, 64, 0, a.M, n0, n1);
    }
  }
  for (; j < j1; ++j) {
    const bf16_t* w = static_cast<const bf16_t*>(a.w) + j * strip;
    const int64_t n0 = 32 * j, n1 = n0 + 32 < a.N ? n0 + 32 : a.N;
    for (int64_t m0 = 0; m0 < a.M; m0 += kDotRows) {
      const int r = int(a.M - m0 < kDotRows ? a.M - m0 : kDotRows);
      dot_tile_rows<1>(r, g, w, m0, m0 == 0, c, std::make_integer_sequence<int, kDotRows>());
      store_rows(a, c, 32, m0, m0 + r, n0, n1);
    }
  }
}

// x [M, K] -> the thread's bf16 buffer of Mp x Kp values, in a kernel's order.
typedef void (*RoundFn)(const float* x, int64_t ldx, int64_t M, int64_t K, bf16_t* xb,
                        int64_t Mp, int64_t Kp);

// Checks the arguments, rounds x into the thread's buffer with ``round`` (Mp rows: for AMX the
// rows past M are zeros, for dot the last row block's unused slots are never read) and runs
// ``item`` over the strips.
int run_bf16(Bf16Args& g, TaskFn item, RoundFn round, const float* x, int64_t ldx,
             const bf16_t* wt, const float* bias, int64_t M, int64_t N, int64_t K, int nparts,
             const int64_t* split, float* const* out, const int64_t* ld, int64_t Mp) {
  if (!set_linear_args(g.a, x, ldx, wt, bias, M, N, K, nparts, split, out, ld)) return -1;
  if (M == 0 || N == 0) return 0;
  g.Mp = Mp;
  g.Kp = (K + 31) / 32 * 32;
  bf16_t* xb = reinterpret_cast<bf16_t*>(t_xb.get((g.Mp * g.Kp + 1) / 2));
  if (!xb) return -1;
  // Rounded on the pool in chunks of whole row blocks of both kernels (serially on this
  // thread, the rounding was ~4% of a bf16 prefill step).
  constexpr int64_t kRoundRows = 48;
  static_assert(kRoundRows % 16 == 0 && kRoundRows % kDotRows == 0, "whole row blocks");
  const int64_t Kp = g.Kp;
  parallel_rows(Mp, kRoundRows, [=](int64_t r0, int64_t r1) {
    const int64_t live = M <= r0 ? 0 : M - r0 < r1 - r0 ? M - r0 : r1 - r0;
    round(x + (live ? r0 * ldx : 0), ldx, live, K, xb + r0 * Kp, r1 - r0, Kp);
  });
  g.xb = xb;
  g.strips = (N + 31) / 32;
  const int64_t want = bf16_items_per_call();
  g.per_item = (g.strips + want - 1) / want;
  g.per_item = (g.per_item + g.pair - 1) / g.pair * g.pair;
  const int64_t items = (g.strips + g.per_item - 1) / g.per_item;
  parallel_for(item, &g, items, M * N * K >= (1 << 18), g_linger_us);
  return 0;
}
#endif  // LLS_BF16DOT

#ifdef LLS_AMX
struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Strip j (32 output columns), rows [m0, m0 + 32).
inline void amx_block(const Bf16Args& g, int64_t j, int64_t m0, float* c) {
  const LinearArgs& a = g.a;
  const int64_t kb_n = g.Kp / 32;
  const bf16_t* w = static_cast<const bf16_t*>(a.w) + j * kb_n * 1024;
  const int64_t n0 = 32 * j, n1 = n0 + 32 < a.N ? n0 + 32 : a.N;
  const int64_t ldx = g.Kp * 2;
  const bool two = m0 + g.tile_rows < g.Mp;
  const bf16_t* x0 = g.xb + m0 * g.Kp;
  const bf16_t* x1 = x0 + 16 * g.Kp;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kb_n; ++kb) {
    if (m0 == 0) {  // the strip comes from memory: ask for it ahead of the tile loads
      const char* pf = reinterpret_cast<const char*>(w + kb * 1024) + kStripPrefetchBytes;
      for (int l = 0; l < 2048; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
    }
    _tile_loadd(4, x0 + kb * 32, ldx);
    _tile_loadd(6, w + kb * 1024, 64);
    _tile_loadd(7, w + kb * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x1 + kb * 32, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  int64_t ld = 0;
  float* o = m0 + (two ? 32 : 16) <= a.M ? direct_out(a, n0, 32, m0, ld) : nullptr;
  if (o) {
    _tile_stored(0, o, ld * 4);
    _tile_stored(1, o + 16, ld * 4);
    if (two) {
      _tile_stored(2, o + 16 * ld, ld * 4);
      _tile_stored(3, o + 16 * ld + 16, ld * 4);
    }
    return;
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (two) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
  const int64_t m1 = m0 + 32 < a.M ? m0 + 32 : a.M;
  if (m0 < m1) store_rows(a, c, 32, m0, m1, n0, n1);
}

// Strips j and j + 1 at once, for fewer than 16 rows (one row block): two weight streams in
// flight. Every sum is the same sequence of tile products as in amx_block.
inline void amx_strip_pair(const Bf16Args& g, int64_t j, float* c) {
  const LinearArgs& a = g.a;
  const int64_t kb_n = g.Kp / 32;
  const bf16_t* w = static_cast<const bf16_t*>(a.w) + j * kb_n * 1024;
  const bf16_t* u = w + kb_n * 1024;
  const int64_t ldx = g.Kp * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kb_n; ++kb) {
    const char* pw = reinterpret_cast<const char*>(w + kb * 1024) + kStripPrefetchBytes;
    const char* pu = reinterpret_cast<const char*>(u + kb * 1024) + kStripPrefetchBytes;
    for (int l = 0; l < 2048; l += 64) {
      _mm_prefetch(pw + l, _MM_HINT_T0);
      _mm_prefetch(pu + l, _MM_HINT_T0);
    }
    _tile_loadd(4, g.xb + kb * 32, ldx);
    _tile_loadd(6, w + kb * 1024, 64);
    _tile_loadd(7, w + kb * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, u + kb * 1024, 64);
    _tile_loadd(7, u + kb * 1024 + 512, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
  }
  // c: [rows, 64] (row stride 256 bytes), strip j's columns first
  _tile_stored(0, c, 256);
  _tile_stored(1, c + 16, 256);
  _tile_stored(2, c + 32, 256);
  _tile_stored(3, c + 48, 256);
  const int64_t n0 = 32 * j, n1 = n0 + 64 < a.N ? n0 + 64 : a.N;
  store_rows(a, c, 64, 0, a.M, n0, n1);
}

void amx_item(void* p, int64_t item) {
  const Bf16Args& g = *static_cast<const Bf16Args*>(p);
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    // x and sum tiles (0-5) hold a row block's rows: 16, or M when M < 16
    cfg.rows[t] = t < 6 ? g.tile_rows : 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[32 * 32];
  const int64_t j0 = item * g.per_item;
  const int64_t j1 = j0 + g.per_item < g.strips ? j0 + g.per_item : g.strips;
  int64_t j = j0;
  if (g.tile_rows < 16)
    for (; j + 1 < j1; j += 2) amx_strip_pair(g, j, c);
  // Row blocks outside, the item's strips inside: a block of x is read once from memory for
  // all of them, and their weights stay in L2 from one block to the next (strips outside
  // read all of x again for each strip: 3 MB per strip at a 2048-token prefill).
  for (int64_t m0 = 0; m0 < g.Mp; m0 += 32)
    for (int64_t i = j; i < j1; ++i) amx_block(g, i, m0, c);
  _tile_release();
}

#endif  // LLS_AMX

}  // namespace

extern "C" {

// 1 when this build has the AMX kernel and the kernel (OS) let this process use AMX tiles
// (Linux: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process), else 0.
int lls_amx_init() {
#ifdef LLS_AMX
  static const int ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
#else
  return 0;
#endif
}

// lls_linear_bf16's contract with bf16 activations on AMX: wt packed by pack_weight_amx.
// Returns 0, -1 on bad arguments or a failed allocation, -2 when AMX is not usable here.
int lls_linear_bf16_amx(const float* x, int64_t ldx, const bf16_t* wt, const float* bias,
                        int64_t M, int64_t N, int64_t K, int nparts, const int64_t* split,
                        float* const* out, const int64_t* ld) {
#ifdef LLS_AMX
  if (!lls_amx_init()) return -2;
  Bf16Args g;
  g.tile_rows = M < 16 ? int(M) : 16;
  return run_bf16(g, amx_item, round_rows_bf16, x, ldx, wt, bias, M, N, K, nparts, split, out,
                  ld, M < 16 ? M : (M + 15) / 16 * 16);
#else
  LLS_LINEAR_ARGS_UNUSED;
  return -2;
#endif
}

// 1 when this build has the AVX512-BF16 dot-product kernel (lls_linear_bf16_dot), else 0.
int lls_bf16_dot_built() {
#ifdef LLS_BF16DOT
  return 1;
#else
  return 0;
#endif
}

// lls_linear_bf16_amx's contract and numerics class (bf16 activations, float32 sums) with
// AVX512-BF16 dot products (dot_item): the same packed weight, other summation order.
// Returns 0, -1 on bad arguments or a failed allocation, -2 when this build has no
// avx512_bf16.
int lls_linear_bf16_dot(const float* x, int64_t ldx, const bf16_t* wt, const float* bias,
                        int64_t M, int64_t N, int64_t K, int nparts, const int64_t* split,
                        float* const* out, const int64_t* ld) {
#ifdef LLS_BF16DOT
  Bf16Args g;
  g.tile_rows = 0;
  // one row's strips go two at a time: an even run per item, so that none ends on a single
  // strip's one stream (M=1 -2 to -3%, AMD Zen 4)
  g.pair = dot_pairs(M) ? 2 : 1;
  return run_bf16(g, dot_item, round_pack_rows_dot, x, ldx, wt, bias, M, N, K, nparts, split,
                  out, ld, (M + kDotRows - 1) / kDotRows * kDotRows);
#else
  LLS_LINEAR_ARGS_UNUSED;
  return -2;
#endif
}

// The same contract as lls_linear_f32, computed by a BLAS library's single-threaded
// cblas_sgemm (row-major, 32-bit ints: the scipy-openblas32 build), called per panel from our
// shared pool. The library's own threads stay off (set to 1 by the caller), so its GEMM
// micro-kernels (dispatched at run time for the CPU) share the cores with our other kernels
// instead of fighting them. A panel is a row-major [K, NP] matrix: y[:, panel] = x @ panel,
// a NoTrans x NoTrans sgemm.
typedef void (*CblasSgemmFn)(int order, int transa, int transb, int m, int n, int k, float alpha,
                             const float* a, int lda, const float* b, int ldb, float beta,
                             float* c, int ldc);

namespace {

struct BlasArgs {
  LinearArgs a;
  CblasSgemmFn sgemm;
  int64_t panels_per_item;
  int status;
};

void blas_item(void* p, int64_t item) {
  BlasArgs& b = *static_cast<BlasArgs*>(p);
  const LinearArgs& a = b.a;
  const int64_t panels = (a.N + NP - 1) / NP;
  const int64_t p0 = item * b.panels_per_item;
  const int64_t p1 = p0 + b.panels_per_item < panels ? p0 + b.panels_per_item : panels;
  float* c = t_sums.get(a.M * NP);
  if (!c) {
    b.status = -1;
    return;
  }
  for (int64_t q = p0; q < p1; ++q) {
    b.sgemm(101 /* RowMajor */, 111 /* NoTrans */, 111 /* NoTrans */, (int)a.M, NP, (int)a.K,
            1.0f, a.x, (int)a.ldx, static_cast<const float*>(a.w) + q * a.K * NP, NP, 0.0f, c,
            NP);
    const int64_t n0 = q * NP, n1 = n0 + NP < a.N ? n0 + NP : a.N;
    store_rows(a, c, NP, 0, a.M, n0, n1);
  }
}

}  // namespace

// ``items``: how many blocks of panels to split N into (the pool balances them dynamically).
int lls_linear_blas_f32(CblasSgemmFn sgemm, int64_t items, const float* x, int64_t ldx,
                        const float* wp, const float* bias, int64_t M, int64_t N, int64_t K,
                        int nparts, const int64_t* split, float* const* out, const int64_t* ld) {
  if (!sgemm || items < 1 || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX ||
      ldx > INT32_MAX)
    return -1;
  BlasArgs b;
  LinearArgs& a = b.a;
  b.sgemm = sgemm;
  b.status = 0;
  if (!set_linear_args(a, x, ldx, wp, bias, M, N, K, nparts, split, out, ld)) return -1;
  if (M == 0 || N == 0) return 0;
  const int64_t panels = (N + NP - 1) / NP;
  b.panels_per_item = (panels + items - 1) / items;
  const int64_t n = (panels + b.panels_per_item - 1) / b.panels_per_item;
  parallel_for(blas_item, &b, n, true, g_linger_us);
  return b.status;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// W8A8 int8 linear (vLLM's compressed-tensors "int-quantized", symmetric): int8 weights with a
// float32 scale per output channel, activations quantized to int8 per token (dynamic) or with
// one static scale, exact int32 sums, a float32 epilogue:
//   sx[m] = max_k |x[m, k]| / 127 (dynamic) or the static scale; inv = 1 / sx (0 when sx = 0)
//   xq[m, k] = clamp(rint(x[m, k] * inv), -128, 127)   (round half to even, as vLLM-CPU's
//              dynamic_scaled_int8_quant / static_scaled_int8_quant; a zero row gives zeros)
//   dynamic: y[m, n] = fma(float(sum_k xq[m, k] * q[n, k]) * scale[n], sx[m], bias[n])
//            (without a bias: (float(sum) * scale[n]) * sx[m])
//   static:  y[m, n] = (float(sum) * sx) * scale[n] + bias[n], each operation rounded
//   what vLLM-CPU's oneDNN int8 matmul gives in each mode, bit for bit (AMD Zen 5).
// The sum is exact whatever the order, so every row is the same bits whatever M, the row's
// place and the thread (batch invariance), on every build variant below alike.
//
// Weight layout (``gemm.pack_weight_int8``, the same for every build): panels of 16 output
// columns, K in groups of 4, a group of a panel one 64-byte line: q[n, k] at
// wq[((n / 16) * K4 + k / 4) * 64 + (n % 16) * 4 + k % 4], K4 = ceil(K / 4), K padded with
// zeros and N to a multiple of 64 (I8_PAD_N: a register tile's widest strip). The multiply
// is u8 x s8 (what VPDPBUSD takes): x is stored as xq + 128, and comp[n] = 128 * sum_k q[n, k]
// (``gemm.int8_compensation``) is taken off the sum, exactly. A tile of many rows is I8R rows x
// I8S panels; one of at most kI8PairRows rows spans I8SP panels (more weight streams).
// Per k group and row, one int32 broadcast of the row's 4 bytes against the panel's line:
// - AVX512-VNNI (and AVX-VNNI on the ymm build): VPDPBUSD, 4 products summed into int32 lanes
//   (the non-saturating form);
// - AVX2 / AVX512BW without VNNI (AMD Zen 3): bytes widened to int16 (x zero-, q sign-extended,
//   even and odd bytes apart) and VPMADDWD, exact (VPMADDUBSW would saturate its int16 sums);
// - otherwise scalar.
// |sum| <= K * 255 * 128 fits int32 for K <= 65536 (checked).
#include <sched.h>

namespace {

constexpr int I8P = 16;            // output columns per panel
constexpr int64_t kI8MaxK = 65536;
constexpr int I8_PAD_N = 64;
// The first row tile of a strip (which reads it from memory) asks for its lines this many
// bytes ahead, from 5 rows up: M=16 -10%, M=64 -3%; at 1 row (two strips a tile, no request
// ahead) it cost +5-8% (AMD Zen 5, bench_linear --int8-builds, interleaved builds).
#ifndef LLS_I8_AHEAD
#define LLS_I8_AHEAD 1024
#endif
#ifndef LLS_I8_PAIR_ROWS
#define LLS_I8_PAIR_ROWS 4
#endif
// Up to this many rows a tile spans I8SP panels, several strips (more weight streams in
// flight than one strip's; LLS_I8_PAIR_ROWS: measured, see I8SP)
constexpr int kI8PairRows = LLS_I8_PAIR_ROWS;

// One vector's operations, for the zmm (PRE _mm512, SI si512) or ymm (_mm256, si256) build:
// LLS_I8_VEC the loads and stores, then LLS_I8_VNNI (DPBUSD: the instruction's intrinsic) or
// LLS_I8_MADD the products: I8W is a weight line as the products take it, I8X a row's 4 bytes
// broadcast, i8_dot adds their products to an accumulator.
#define LLS_I8_VEC(PRE, SI)                                                                 \
  inline i8acc i8_zero() { return PRE##_setzero_##SI(); }                                   \
  inline i8acc i8_bcast(const uint8_t* p) {                                                 \
    int32_t v;                                                                              \
    std::memcpy(&v, p, 4);                                                                  \
    return PRE##_set1_epi32(v);                                                             \
  }                                                                                         \
  inline i8acc i8_load(const int8_t* p) {                                                   \
    return PRE##_loadu_##SI(reinterpret_cast<const i8acc*>(p));                             \
  }                                                                                         \
  inline void i8_store(int32_t* p, i8acc v) { PRE##_store_##SI(reinterpret_cast<i8acc*>(p), v); }
#define LLS_I8_VNNI(DPBUSD)                                                                 \
  struct I8W { i8acc w; };                                                                  \
  struct I8X { i8acc x; };                                                                  \
  inline I8W i8_wprep(i8acc w) { return {w}; }                                              \
  inline I8X i8_xprep(i8acc x) { return {x}; }                                              \
  inline i8acc i8_dot(i8acc acc, const I8X& x, const I8W& w) { return DPBUSD(acc, x.x, w.w); }
// Without VNNI: each 32-bit lane's 4 bytes as two int16 lanes of even and of odd bytes (q
// sign-, x zero-extended); VPMADDWD sums the pairs exactly into int32.
#define LLS_I8_MADD(PRE, SI)                                                                \
  struct I8W { i8acc e, o; };                                                               \
  struct I8X { i8acc e, o; };                                                               \
  inline I8W i8_wprep(i8acc w) {                                                            \
    return {PRE##_srai_epi16(PRE##_slli_epi16(w, 8), 8), PRE##_srai_epi16(w, 8)};           \
  }                                                                                         \
  inline I8X i8_xprep(i8acc x) {                                                            \
    return {PRE##_and_##SI(x, PRE##_set1_epi16(0xFF)), PRE##_srli_epi16(x, 8)};             \
  }                                                                                         \
  inline i8acc i8_dot(i8acc acc, const I8X& x, const I8W& w) {                              \
    return PRE##_add_epi32(acc, PRE##_add_epi32(PRE##_madd_epi16(x.e, w.e),                 \
                                                PRE##_madd_epi16(x.o, w.o)));               \
  }

#if LLS_VW == 16 && defined(__AVX512BW__)
typedef __m512i i8acc;             // one vector = one panel's 16 int32 sums
constexpr int I8V = 1;             // vectors per panel
constexpr int I8S = 4;             // panels per register tile (one 64-column strip)
constexpr int I8SP = 8;            // panels per tile of few rows (kI8PairRows)
LLS_I8_VEC(_mm512, si512)
#if defined(__AVX512VNNI__)
#define LLS_I8_DOT "avx512-vnni"
constexpr int I8R = 6;             // 24 accumulators + 4 weight lines + 1 broadcast
LLS_I8_VNNI(_mm512_dpbusd_epi32)
#else
#define LLS_I8_DOT "avx512bw-madd"
constexpr int I8R = 4;
LLS_I8_MADD(_mm512, si512)
#endif
#elif defined(__AVX2__)
typedef __m256i i8acc;
constexpr int I8V = 2;
constexpr int I8SP = 4;
LLS_I8_VEC(_mm256, si256)
#if defined(__AVXVNNI__)
#define LLS_I8_DOT "avx-vnni"
constexpr int I8S = 2;
constexpr int I8R = 2;             // 8 accumulators + 4 weight halves + 1 broadcast
LLS_I8_VNNI(_mm256_dpbusd_avx_epi32)
#else
#define LLS_I8_DOT "avx2-madd"
// 8 accumulators + a panel's two halves as even and odd int16 + the row's two: 4 rows x one
// panel took 0.85-0.87x the time of 2 rows x two panels from 16 to 128 rows, the same at 1 and
// 4 (this build on AMD Zen 5, the tile shape set by macros since removed, the kernel alone in
// a ctypes loop as bench_linear --int8-builds times it, two runs under other load)
constexpr int I8S = 1;
constexpr int I8R = 4;
LLS_I8_MADD(_mm256, si256)
#endif
#else
#define LLS_I8_DOT "scalar"
constexpr int I8S = 1;
constexpr int I8R = 4;
constexpr int I8SP = 2;
#endif

struct I8Args {
  LinearArgs a;                    // a.w: the packed int8 weight
  const int32_t* comp;             // [panels * 16]
  const float* scale;              // [N]
  const uint8_t* xq;               // [Mp, K4 * 4]: xq + 128
  const float* sx;                 // [M]
  bool fixed;                      // one static scale (the epilogue's order differs)
  int64_t K4, strips, per_item;
};

// R rows from m0 x S panels from panel p0: int32 sums into c [R, S * 16].
template <int R, int S>
inline void i8_tile(const I8Args& g, int64_t p0, int64_t m0, bool pf, int32_t* c) {
  const int64_t K4 = g.K4;
  const int8_t* w = static_cast<const int8_t*>(g.a.w) + p0 * K4 * 64;
  const uint8_t* x = g.xq + m0 * K4 * 4;
#if !defined(__AVX2__)
  int32_t acc[R][S * I8P] = {};
  for (int64_t kg = 0; kg < K4; ++kg)
    for (int s = 0; s < S; ++s) {
      const int8_t* wl = w + (s * K4 + kg) * 64;
      for (int i = 0; i < R; ++i) {
        const uint8_t* xr = x + i * K4 * 4 + kg * 4;
        for (int n = 0; n < I8P; ++n)
          for (int j = 0; j < 4; ++j) acc[i][s * I8P + n] += int32_t(xr[j]) * wl[n * 4 + j];
      }
    }
  for (int i = 0; i < R; ++i)
    for (int n = 0; n < S * I8P; ++n) c[i * S * I8P + n] = acc[i][n];
#else
  constexpr int NV = S * I8V;
  i8acc acc[R][NV];
  #pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[i][v] = i8_zero();
  for (int64_t kg = 0; kg < K4; ++kg) {
    I8W wv[NV];
    #pragma GCC unroll 16
    for (int s = 0; s < S; ++s) {
      if (LLS_I8_AHEAD > 0 && pf) __builtin_prefetch(w + (s * K4 + kg) * 64 + LLS_I8_AHEAD, 0, 3);
      #pragma GCC unroll 4
      for (int v = 0; v < I8V; ++v)
        wv[s * I8V + v] = i8_wprep(i8_load(w + (s * K4 + kg) * 64 + v * 64 / I8V));
    }
    #pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const I8X xb = i8_xprep(i8_bcast(x + i * K4 * 4 + kg * 4));
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[i][v] = i8_dot(acc[i][v], xb, wv[v]);
    }
  }
  #pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) i8_store(c + i * S * I8P + v * (I8P / I8V), acc[i][v]);
#endif
}

template <int S, int... Rs>
inline void i8_tile_rows(int r, const I8Args& g, int64_t p0, int64_t m0, bool pf, int32_t* c,
                         std::integer_sequence<int, Rs...>) {
  ((r == Rs + 1 ? i8_tile<Rs + 1, S>(g, p0, m0, pf, c) : void()), ...);
}

// The epilogue of rows [m0, m1) x columns [n0, n1) from the sums c (row stride ldc), in
// vLLM-CPU's (oneDNN's) orders, bit for bit (see the contract above). No other contraction
// (fp-contract off).
__attribute__((optimize("fp-contract=off"))) void i8_store_rows(
    const I8Args& g, const int32_t* c, int64_t ldc, int64_t m0, int64_t m1, int64_t n0,
    int64_t n1) {
  const LinearArgs& a = g.a;
  for (int q = 0; q < a.nparts; ++q) {
    const int64_t lo = a.split[q] > n0 ? a.split[q] : n0;
    const int64_t hi = a.split[q + 1] < n1 ? a.split[q + 1] : n1;
    if (lo >= hi) continue;
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t* s = c + (m - m0) * ldc + (lo - n0);
      const int32_t* comp = g.comp + lo;
      const float* sc = g.scale + lo;
      const float sxm = g.sx[m];
      float* o = a.out[q] + m * a.ld[q] + (lo - a.split[q]);
      const float* b = a.bias ? a.bias + lo : nullptr;
      if (g.fixed) {  // static: (sum * sx) * scale + bias, each rounded
        for (int64_t n = 0; n < hi - lo; ++n) {
          const float t = float(s[n] - comp[n]) * sxm * sc[n];
          o[n] = b ? t + b[n] : t;
        }
      } else if (b) {  // dynamic: one rounding for the product with sx and the bias add
        for (int64_t n = 0; n < hi - lo; ++n)
          o[n] = std::fma(float(s[n] - comp[n]) * sc[n], sxm, b[n]);
      } else {
        for (int64_t n = 0; n < hi - lo; ++n) o[n] = float(s[n] - comp[n]) * sc[n] * sxm;
      }
    }
  }
}

void i8_item(void* p, int64_t item) {
  const I8Args& g = *static_cast<const I8Args*>(p);
  const LinearArgs& a = g.a;
  alignas(64) int32_t c[(I8R * I8S > kI8PairRows * I8SP ? I8R * I8S : kI8PairRows * I8SP) * I8P];
  const int64_t j0 = item * g.per_item;
  const int64_t j1 = j0 + g.per_item < g.strips ? j0 + g.per_item : g.strips;
  constexpr int W = I8S * I8P;  // columns per strip
  int64_t j = j0;
  constexpr int G = I8SP / I8S;  // strips per tile of few rows
  if (a.M <= kI8PairRows)
    for (; j + G <= j1; j += G) {
      i8_tile_rows<I8SP>(int(a.M), g, j * I8S, 0, false, c,
                         std::make_integer_sequence<int, kI8PairRows>());
      i8_store_rows(g, c, G * W, 0, a.M, j * W, (j + G) * W < a.N ? (j + G) * W : a.N);
    }
  for (; j < j1; ++j) {
    const int64_t n0 = j * W, n1 = n0 + W < a.N ? n0 + W : a.N;
    for (int64_t m0 = 0; m0 < a.M; m0 += I8R) {
      const int r = int(a.M - m0 < I8R ? a.M - m0 : I8R);
      i8_tile_rows<I8S>(r, g, j * I8S, m0, m0 == 0, c, std::make_integer_sequence<int, I8R>());
      i8_store_rows(g, c, W, m0, m0 + r, n0, n1);
    }
  }
}

// Rows [r0, r1) of x quantized into xq (+ 128, K4 * 4 bytes a row, the padding 128) and sx.
void i8_quantize_rows(const float* x, int64_t ldx, int64_t K, int64_t K4, const float* fixed,
                      uint8_t* xq, float* sx, int64_t r0, int64_t r1) {
  for (int64_t m = r0; m < r1; ++m) {
    const float* r = x + m * ldx;
    float s;
    if (fixed) {
      s = *fixed;
    } else {
      float amax = 0.0f;
      int64_t k = 0;
#if LLS_VW == 16
      __m512 v = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) v = _mm512_max_ps(v, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
      amax = _mm512_reduce_max_ps(v);
#elif LLS_VW == 8
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 v = _mm256_setzero_ps();
      for (; k + 8 <= K; k += 8)
        v = _mm256_max_ps(v, _mm256_andnot_ps(sign, _mm256_loadu_ps(r + k)));
      alignas(32) float t[8];
      _mm256_store_ps(t, v);
      for (int i = 0; i < 8; ++i) amax = t[i] > amax ? t[i] : amax;
#endif
      for (; k < K; ++k) amax = std::fabs(r[k]) > amax ? std::fabs(r[k]) : amax;
      s = amax / 127.0f;
    }
    sx[m] = s;
    const float inv = s != 0.0f ? 1.0f / s : 0.0f;
    uint8_t* o = xq + m * K4 * 4;
    int64_t k = 0;
#if LLS_VW == 16
    const __m512 vi = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-128.0f);
    const __m512 hi = _mm512_set1_ps(127.0f);
    for (; k + 16 <= K; k += 16) {
      const __m512 t =
          _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(r + k), vi), lo), hi);
      const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(t), _mm512_set1_epi32(128));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), _mm512_cvtepi32_epi8(q));
    }
#elif LLS_VW == 8 && defined(__AVX2__)
    const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-128.0f);
    const __m256 hi = _mm256_set1_ps(127.0f);
    for (; k + 8 <= K; k += 8) {
      const __m256 t =
          _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(r + k), vi), lo), hi);
      const __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(t), _mm256_set1_epi32(128));
      const __m128i w16 =
          _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(o + k), _mm_packus_epi16(w16, w16));
    }
#endif
    for (; k < K; ++k) {
      float t = r[k] * inv;
      t = t < -128.0f ? -128.0f : t > 127.0f ? 127.0f : t;
      o[k] = uint8_t(int32_t(std::nearbyint(t)) + 128);
    }
    for (; k < K4 * 4; ++k) o[k] = 128;
  }
}

thread_local std::vector<uint8_t> t_xq;
thread_local std::vector<float> t_sx;

}  // namespace

extern "C" {

// The int8 kernel's instructions in this build: "avx512-vnni", "avx512bw-madd", "avx-vnni",
// "avx2-madd" or "scalar".
const char* lls_int8_dot_kind() { return LLS_I8_DOT; }

// y = the W8A8 int8 linear above, for x [M, K] float32 (row stride ldx), wq packed by
// pack_weight_int8, comp its compensation, scale [N] float32, static_scale: null for dynamic
// per-token scales, else a pointer to the one static scale; bias, output parts as
// lls_linear_f32. Returns 0, or -1 on bad arguments (K > 65536) or a failed allocation.
int lls_linear_int8(const float* x, int64_t ldx, const int8_t* wq, const int32_t* comp,
                    const float* scale, const float* static_scale, const float* bias, int64_t M,
                    int64_t N, int64_t K, int nparts, const int64_t* split, float* const* out,
                    const int64_t* ld) {
  I8Args g;
  if (!set_linear_args(g.a, x, ldx, wq, bias, M, N, K, nparts, split, out, ld) || K > kI8MaxK ||
      !comp || !scale)
    return -1;
  if (M == 0 || N == 0) return 0;
  g.comp = comp;
  g.scale = scale;
  g.fixed = static_scale != nullptr;
  g.K4 = (K + 3) / 4;
  try {
    t_xq.resize(size_t(M * g.K4 * 4));
    t_sx.resize(size_t(M));
  } catch (...) {
    return -1;
  }
  uint8_t* xq = t_xq.data();
  float* sx = t_sx.data();
  const int64_t K4 = g.K4;
  parallel_rows(M, 32, [=](int64_t r0, int64_t r1) {
    i8_quantize_rows(x, ldx, K, K4, static_scale, xq, sx, r0, r1);
  });
  g.xq = xq;
  g.sx = sx;
  const int64_t panels = (N + I8P - 1) / I8P;
  g.strips = (panels + I8S - 1) / I8S;
  // items: a few per core, as the bf16 kernels (the pool balances them)
  static const int64_t want = [] {
    cpu_set_t set;
    const int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    return int64_t(4) * (cores > 0 ? cores : 1);
  }();
  g.per_item = (g.strips + want - 1) / want;
  constexpr int G = I8SP / I8S;
  if (M <= kI8PairRows) g.per_item = (g.per_item + G - 1) / G * G;  // whole tiles per item
  const int64_t items = (g.strips + g.per_item - 1) / g.per_item;
  parallel_for(i8_item, &g, items, M * N * K >= (1 << 18), g_linger_us);
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

// Per-head RMSNorm in place (Qwen3's q_norm / k_norm): x[t, h] = x[t, h] / rms(x[t, h]) * w,
// x: [T, heads, D] with rows `stride` floats apart (a column slice of the fused qkv output).
void head_rms_norm_f32(float* __restrict x, const float* __restrict w, int64_t tokens,
                       int64_t heads, int64_t head_dim, int64_t stride, float eps) {
  parallel_rows(tokens, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + t * stride + h * head_dim;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < head_dim; ++i) ss += v[i] * v[i];
        const float inv = 1.0f / std::sqrt(ss / (float)head_dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) v[i] = v[i] * inv * w[i];
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

// out[t, i] = silu(x[t, i]) * x[t, F + i], x: [T, 2F]. The exps of whole vectors come from
// glibc's libmvec when it is there (vector_exp), the rest from expf: a column's function does
// not depend on the rows around it.
void silu_and_mul_f32(const float* __restrict x, float* __restrict out, int64_t rows,
                      int64_t f) {
  const VecExpFn vexp = vector_exp();
  parallel_rows(rows, 8, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* g = x + t * 2 * f;
      const float* u = g + f;
      float* o = out + t * f;
      int64_t i = 0;
      if (vexp)
        for (; i + VW <= f; i += VW) {
          const vf gv = vload(g + i);
          vstore(o + i, gv / (1.0f + vexp(-gv)) * vload(u + i));
        }
      for (; i < f; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

// LayerNorm with bias (GPT-2 / GPTBigCode): out[t] = (x[t] - mean) / sqrt(var + eps) * w + b,
// the mean and the (biased) variance over the row's dim values, in two passes.
static inline void layer_norm_row(const float* __restrict xr, const float* __restrict w,
                                  const float* __restrict b, float* __restrict o, int64_t dim,
                                  float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) sum += xr[i];
  const float mean = sum / (float)dim;
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += (xr[i] - mean) * (xr[i] - mean);
  const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) o[i] = (xr[i] - mean) * inv * w[i] + b[i];
}

void layer_norm_f32(const float* __restrict x, const float* __restrict w,
                    const float* __restrict b, float* __restrict out, int64_t rows,
                    int64_t dim, float eps) {
  parallel_rows(rows, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) layer_norm_row(x + t * dim, w, b, out + t * dim, dim, eps);
  });
}

// residual[t] += x[t]; out[t] = layer_norm(residual[t])   (residual is updated in place)
void add_layer_norm_f32(const float* __restrict x, float* __restrict residual,
                        const float* __restrict w, const float* __restrict b,
                        float* __restrict out, int64_t rows, int64_t dim, float eps) {
  parallel_rows(rows, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* xr = x + t * dim;
      float* r = residual + t * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) r[i] += xr[i];
      layer_norm_row(r, w, b, out + t * dim, dim, eps);
    }
  });
}

// x[t] += table[ids[t]], x: [T, dim] (a learned position embedding added to the token's).
void add_rows_f32(float* __restrict x, const float* __restrict table,
                  const int32_t* __restrict ids, int64_t rows, int64_t dim) {
  parallel_rows(rows, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* src = table + (int64_t)ids[t] * dim;
      float* dst = x + t * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) dst[i] += src[i];
    }
  });
}

// out = gelu(x) over n values: with tanh_approx, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// (PyTorch's approximate="tanh", transformers' gelu_pytorch_tanh), else 0.5 x (1 + erf(x/sqrt2)).
void gelu_f32(const float* __restrict x, float* __restrict out, int64_t rows, int64_t dim,
              int tanh_approx) {
  parallel_rows(rows, 8, [=](int64_t r0, int64_t r1) {
    const float* xs = x + r0 * dim;
    float* os = out + r0 * dim;
    const int64_t n = (r1 - r0) * dim;
    if (tanh_approx) {
      const float k = 0.7978845608028654f;  // sqrt(2 / pi)
      for (int64_t i = 0; i < n; ++i) {
        const float v = xs[i];
        os[i] = 0.5f * v * (1.0f + std::tanh(k * (v + 0.044715f * v * v * v)));
      }
    } else {
      const float r = 0.7071067811865476f;  // 1 / sqrt(2)
      for (int64_t i = 0; i < n; ++i) os[i] = 0.5f * xs[i] * (1.0f + std::erf(xs[i] * r));
    }
  });
}

}  // extern "C"
