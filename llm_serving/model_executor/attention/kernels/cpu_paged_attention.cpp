// CPU kernels for attention over a paged KV cache with ragged (unpadded) batches.
//
// Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
// contiguous, float32, bfloat16 (uint16 bits; the *_bf16 entry points), float16 (IEEE half
// bits; the *_f16 entry points) or 8-bit floats (OCP FP8 E4M3 "fn" and E5M2 bits; the
// *_f8e4m3 and *_f8e5m2 entry points): narrower caches are written rounded to nearest even and
// widened to float32 on read, so all arithmetic stays float32 and only the stored K/V lose
// precision. A float16 or FP8 cache stores what lies beyond its range (infinities included) as
// its largest finite value (+-65504, +-448 for E4M3, +-57344 for E5M2); NaN stays NaN. FP8
// values are stored unscaled (vLLM's k_scale = v_scale = 1). A token's slot is block_id * block_size + offset; its K
// row for kv head g starts at (slot * num_kv_heads + g) * head_dim.
//
// Entry points (all extern "C", loaded with ctypes or through MindSpore's ops.Custom "aot"):
//   lls_reshape_and_cache      write this step's K/V rows into their slots (slot < 0: skip)
//   lls_paged_attention        causal attention of a ragged batch of query rows over the cache
//   lls_attention_fused        both of the above in one call
//   lls_aot_attention          the fused call with MindSpore's CPU aot signature
//   lls_aot_paged_attention    attention only, aot signature
//   lls_reshape_and_cache_bf16, lls_paged_attention_bf16, lls_attention_fused_bf16: the same
//                              contracts with bfloat16 caches; *_f16: with float16 caches;
//                              *_f8e4m3 and *_f8e5m2: with FP8 caches
// lls_paged_attention* and lls_attention_fused* take ALiBi slopes last (float [H], one per
// query head, or null): a score then gets slope * (key position - query position) added after
// the scale, as Baichuan2-13B's and BLOOM's attention do.
// Every function returns 0 on success and a negative code on bad input, or -5 when the kernel
// could not allocate its work buffers; lls_last_error() then describes the problem. Nothing is
// written to the caches or the output when input validation fails. No C++ exception leaves an
// entry point.
//
// Work split: one work item = (sequence, block of query rows, range of kv heads). All query heads
// of a kv head group are processed together so each K/V row is read once per item; decode batches
// take all kv heads of a sequence per item so that whole cache rows stream from memory. Items are
// handed out dynamically (an atomic counter), most expensive first, to the calling thread and the
// helper threads of a small pool (see ThreadPool below for why not OpenMP's runtime; build with
// -DLLS_USE_OPENMP -fopenmp for an OpenMP "parallel for schedule(dynamic)" version). Inside an
// item the context is walked in tiles of 16 positions with an online (running max) softmax,
// summed in segments of 128 positions folded in order, so that a decode step of fewer
// sequences than threads can split a context between them (kSegment). The AVX-512 path
// computes 16 q.k dot products per tile and reduces them with a transpose tree; a
// portable path, written in C++ and vectorized by the compiler (AVX2 on AMD Zen 3), is compiled
// when AVX-512 is unavailable (or with -DLLS_FORCE_SCALAR). In both, decode rows read a tile
// position by position and prefill chunks head by head (see decode_tiles), with the same
// operations in the same order for each output: a row's bits are the same whether a decode step
// or a prefill chunk computed it. A prefill chunk first widens (or copies) each tile's K/V rows
// of a kv head into a small float32 scratch that all its query rows read (see WideTile).

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include <atomic>
#include <chrono>
#include <mutex>
#include <system_error>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(LLS_USE_OPENMP) && defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) && !defined(LLS_FORCE_SCALAR)
#include <immintrin.h>
#define LLS_AVX512 1
#else
#define LLS_AVX512 0
#endif
// The portable path built for AVX2 with FMA and F16C (AMD Zen 3, or -mno-avx512f): see dot8.
#if !LLS_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !defined(LLS_FORCE_SCALAR)
#include <immintrin.h>
#define LLS_AVX2 1
#else
#define LLS_AVX2 0
#endif

// float16 caches convert with F16C's instructions where the CPU has them (every x86 CPU with
// AVX2 this project runs on), and in portable C++ elsewhere (see tof(f16_t)).
#if defined(__F16C__)
#include <immintrin.h>
#define LLS_F16C 1
#else
#define LLS_F16C 0
#endif

#define LLS_RESTRICT __restrict__

namespace {

constexpr int kTile = 16;            // context positions per tile (one AVX-512 vector of scores)
constexpr int kTargetRowsHeads = 32; // query rows * heads per work item (prefill)
int64_t g_parallel_min_work = 4096;  // below this much work (rows*heads*ctx*D/16) run serially

thread_local char g_err[512];
int g_num_threads = 0;  // 0: OpenMP default

int set_error(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof(g_err), fmt, ap);
  va_end(ap);
  return code;
}

int default_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

int num_threads() {
  static const int def = default_threads();
  return g_num_threads > 0 ? g_num_threads : def;
}

// ---------------------------------------------------------------------------------------------
// Thread pool.
//
// Why not OpenMP's runtime: the process already has libgomp loaded by MindSpore, configured
// before we load. By default its threads spin about 300,000 pause instructions (~10 ms here)
// at every barrier and after every parallel region. On two cores that steals a core from
// MindSpore's own compute threads after each attention call, and when anything else is
// runnable the spinning thread and a descheduled teammate wait on each other for whole
// scheduler ticks (measured: a B=16 decode going from 1.0 ms to 8 ms under load). The wait
// policy can only be changed through environment variables read when libgomp loads.
//
// This pool: the caller and up to nthreads-1 helpers take items from an atomic counter. Helpers
// spin briefly (~30 us) for the next job and then sleep on a futex. The caller waits only for
// helpers that actually joined the job (they are running items), never for a helper that has
// not woken up yet, so a descheduled helper cannot stall a call. Concurrent callers do not
// block: if the pool is busy the call runs on the calling thread.
//
// The pool is shared: the layer ops (layers/kernels/cpu_layer_ops.cpp) run on it through
// lls_parallel_for. They pass a linger time: during a decode step Python runs for tens of
// microseconds between their ~0.1-1 ms jobs, and waking a sleeping helper costs about as much
// on a VM, so the caller would do most of the next job alone (measured: half of the batch-1
// matmuls ran at single-core speed). After such a job the idle helpers spin until the linger
// time has passed, and only then sleep.

typedef void (*TaskFn)(void* ctx, int64_t i);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class ThreadPool {
 public:
  // linger_ns: after this job, idle helpers keep spinning (instead of sleeping) for this long,
  // because the caller expects another job soon.
  void run(TaskFn fn, void* ctx, int64_t n, int nthreads, int64_t linger_ns = 0) {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || nthreads <= 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    ensure_helpers(nthreads - 1);
    fn_ = fn;
    ctx_ = ctx;
    n_ = n;
    allowed_ = nthreads - 1;
    next_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;  // odd: job open
    state_.store(gen << 32, std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&wake_);
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) fn(ctx, i);
    // close the job once no helper is inside it (active count 0)
    for (int spins = 0;; ++spins) {
      uint64_t open = gen << 32;
      if (state_.compare_exchange_weak(open, (gen + 1) << 32, std::memory_order_acq_rel,
                                       std::memory_order_relaxed))
        break;
      if (spins < kCallerSpins) cpu_relax();
      else std::this_thread::yield();
    }
    if (linger_ns > 0) {
      const int64_t until = now_ns() + linger_ns;
      int64_t cur = linger_until_.load(std::memory_order_relaxed);
      while (cur < until && !linger_until_.compare_exchange_weak(cur, until)) {
      }
    }
  }

 private:
  static constexpr int kIdleSpins = 1000;   // x ~32 ns pause, then sleep unless lingering
  static constexpr int kCallerSpins = 4000;

  static void futex_wait(std::atomic<uint32_t>* w, uint32_t val) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAIT_PRIVATE, val, nullptr, nullptr, 0);
#else
    std::this_thread::yield();
#endif
  }
  static void futex_wake_all(std::atomic<uint32_t>* w) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE_PRIVATE, 0x7fffffff, nullptr, nullptr, 0);
#endif
  }

  // A helper the system refuses to start (a thread limit, no memory for its stack) is not an
  // error: the job runs on the helpers there are, or on the caller alone.
  void ensure_helpers(int k) {
    while ((int)nthreads_ < k) {
      try {
        std::thread(&ThreadPool::helper, this, nthreads_).detach();
      } catch (const std::system_error&) {
        return;
      }
      ++nthreads_;
    }
  }

  void helper(int idx) {
    uint64_t last_gen = 0;
    uint32_t seen = wake_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      const uint64_t gen = s >> 32;
      if ((gen & 1) && gen != last_gen) {
        if (idx >= allowed_.load(std::memory_order_relaxed)) {
          last_gen = gen;
          continue;
        }
        if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                         std::memory_order_relaxed)) {
          last_gen = gen;
          const int64_t n = n_;
          const TaskFn fn = fn_;
          void* ctx = ctx_;
          for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) fn(ctx, i);
          state_.fetch_sub(1, std::memory_order_release);
        }
        continue;
      }
      // no open job we have not served: wait for the next one
      const uint32_t w = wake_.load(std::memory_order_acquire);
      if (w != seen) { seen = w; continue; }
      int spins = 0;
      while (wake_.load(std::memory_order_acquire) == w) {
        cpu_relax();
        if (++spins < kIdleSpins || (spins & 63)) continue;
        // past the short spin: go on only while a recent job asked helpers to linger
        if (now_ns() >= linger_until_.load(std::memory_order_relaxed)) break;
      }
      if (wake_.load(std::memory_order_acquire) == w) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (wake_.load(std::memory_order_seq_cst) == w) futex_wait(&wake_, w);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
  }

  std::mutex mu_;                      // one job at a time
  std::atomic<uint64_t> state_{0};     // (generation << 32) | helpers inside the job
  std::atomic<uint32_t> wake_{0};      // futex word, bumped for every job
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> linger_until_{0};  // steady_clock ns; helpers spin until then
  std::atomic<int64_t> next_{0};
  std::atomic<int> allowed_{0};
  int nthreads_ = 0;
  int64_t n_ = 0;
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
};

// Never destroyed (helpers are detached). A forked child gets a fresh pool: the parent's helper
// threads do not exist there.
std::atomic<ThreadPool*> g_pool{nullptr};

void pool_after_fork_in_child() { g_pool.store(new ThreadPool(), std::memory_order_release); }

ThreadPool& pool() {
  ThreadPool* p = g_pool.load(std::memory_order_acquire);
  if (p) return *p;
  static std::once_flag once;
  std::call_once(once, [] {
    g_pool.store(new ThreadPool(), std::memory_order_release);
#if defined(__linux__)
    pthread_atfork(nullptr, nullptr, pool_after_fork_in_child);
#endif
  });
  return *g_pool.load(std::memory_order_acquire);
}

// Run fn(ctx, i) for i in [0, n), in parallel when `parallel`; idle helpers then spin for
// linger_ns before sleeping (see ThreadPool::run).
void parallel_for(TaskFn fn, void* ctx, int64_t n, bool parallel, int64_t linger_ns = 0) {
  const int nt = parallel ? num_threads() : 1;
#if defined(LLS_USE_OPENMP) && defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
  for (int64_t i = 0; i < n; ++i) fn(ctx, i);
#else
  pool().run(fn, ctx, n, nt, linger_ns);
#endif
}

struct AttnArgs {
  const float* q;
  int64_t q_stride;  // floats between consecutive tokens of q
  const void* k_cache;  // float, bf16_t or f16_t: the element type is a template argument
  const void* v_cache;
  const int32_t* block_tables;
  int64_t max_blocks;
  const int32_t* qsl;
  const int32_t* seq_lens;
  int64_t S, T, H, KVH, D, block_size, num_blocks;
  float scale;
  float* out;
  int64_t out_stride;
  float* seg_out;  // SegmentSplit: per segment record, per query head (max, sum, output[D])
  const float* alibi;  // ALiBi slope per query head [H], or null
};

struct Item {
  int32_t seq;
  int32_t row0;   // first query row of the block, relative to the sequence
  int32_t nrows;
  int32_t kv0;    // first kv head
  int32_t nkv;    // number of kv heads (all query heads of each are processed)
  int64_t cost;
  int32_t seg = -1;   // decode: only this context segment (SegmentSplit)
  int32_t rec = 0;    // SegmentSplit: its record in AttnArgs::seg_out
};

// 64-byte aligned float buffer (AVX-512 aligned loads/stores), grown on demand.
struct AlignedBuf {
  float* p = nullptr;
  size_t n = 0;
  ~AlignedBuf() { std::free(p); }
  float* get(size_t need) {
    if (need > n) {
      std::free(p);
      const size_t bytes = ((need * sizeof(float) + 63) / 64) * 64;
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      n = p ? bytes / sizeof(float) : 0;  // a failed get leaves an empty buffer, not a stale size
      if (!p) throw std::bad_alloc();
    }
    return p;
  }
};

// Cache elements: float, uint16_t holding bfloat16 bits, or f16_t holding IEEE half bits (a
// struct, so that it is a type of its own beside bf16_t).
typedef uint16_t bf16_t;
struct f16_t {
  uint16_t bits;
};
static_assert(sizeof(f16_t) == 2, "f16_t must be two bytes, as the cache's elements are");
inline float tof(float x) { return x; }
inline float tof(bf16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// float -> bfloat16, round to nearest even (NaN stays a quiet NaN).
inline bf16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (bf16_t)((u >> 16) | 0x40u);
  return (bf16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

constexpr float kF16Max = 65504.f;  // the largest finite float16

inline float tof(f16_t h) {
#if LLS_F16C
  return _cvtsh_ss(h.bits);
#else
  const uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
  const uint32_t e = (h.bits >> 10) & 0x1Fu, man = h.bits & 0x3FFu;
  uint32_t u;
  if (e == 0) {                        // zero or subnormal: man * 2^-24, exact in float
    const float f = (float)man * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (e == 31) {                // infinity or NaN
    u = sign | 0x7F800000u | (man << 13);
  } else {
    u = sign | ((e + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// float -> float16, round to nearest even; beyond the range (infinities included): +-65504;
// NaN stays a NaN.
inline f16_t to_f16(float f) {
#if LLS_F16C
  if (!std::isnan(f)) f = std::min(std::max(f, -kF16Max), kF16Max);
  return f16_t{(uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)};
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return f16_t{(uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu))};
  if (a >= 0x477FF000u) return f16_t{(uint16_t)(sign | 0x7BFFu)};  // rounds to 65520 or more
  if (a < 0x38800000u) {
    // below 2^-14 (half's subnormals): adding 0.5 leaves the sum's last bit worth 2^-24, so the
    // float addition rounds |f| to a multiple of the half's subnormal step, to nearest even
    float af;
    std::memcpy(&af, &a, 4);
    const float t = af + 0.5f;
    uint32_t tu;
    std::memcpy(&tu, &t, 4);
    return f16_t{(uint16_t)(sign | (tu - 0x3F000000u))};
  }
  // normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even
  a += (uint32_t)(15 - 127) * (1u << 23) + 0xFFFu + ((a >> 13) & 1u);
  return f16_t{(uint16_t)(sign | (a >> 13))};
#endif
}

// FP8 cache elements (OCP 8-bit floats), a byte each: E4M3 "fn" (bias 7, no infinities, NaN
// = S.1111.111, largest 448, smallest subnormal 2^-9) and E5M2 (float16's top byte: bias 15,
// largest finite 57344, smallest subnormal 2^-16).
struct f8e4m3_t {
  uint8_t bits;
};
struct f8e5m2_t {
  uint8_t bits;
};
constexpr float kE4M3Max = 448.f, kE5M2Max = 57344.f;

inline float tof(f8e4m3_t x) {
  const uint32_t sign = (uint32_t)(x.bits & 0x80u) << 24, mag = x.bits & 0x7Fu;
  float f;
  if (mag == 0x7Fu) {
    f = std::numeric_limits<float>::quiet_NaN();
  } else if (mag < 8) {                // zero or subnormal: mag * 2^-9, exact
    f = (float)mag * 0.001953125f;
  } else {                             // rebias the exponent (7 -> 127), widen the mantissa
    const uint32_t u = (mag << 20) + (120u << 23);
    std::memcpy(&f, &u, 4);
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= sign;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float tof(f8e5m2_t x) { return tof(f16_t{(uint16_t)(x.bits << 8)}); }

// float -> an 8-bit float with `man` mantissa bits and exponent bias `bias`, rounded to nearest
// even; beyond the largest finite value `max_code` (infinities included) saturates to it; NaN
// is `nan_code`.
template <int man, int bias>
inline uint8_t to_f8(float f, uint8_t max_code, float max_value, uint8_t nan_code) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | nan_code;
  float af;
  std::memcpy(&af, &a, 4);
  if (af >= max_value) return sign | max_code;
  constexpr uint32_t kMinNormal = (uint32_t)(127 + 1 - bias) << 23;
  if (a < kMinNormal) {
    // subnormal: a multiple of 2^(1 - bias - man), rounded to nearest even (the default
    // rounding mode); a result of 2^man steps is the smallest normal's code, as it should be
    constexpr float kSteps = (float)(1ull << (bias - 1 + man));
    return sign | (uint8_t)std::nearbyint(af * kSteps);
  }
  constexpr int drop = 23 - man;
  a -= (uint32_t)(127 - bias) << 23;
  a += (1u << (drop - 1)) - 1 + ((a >> drop) & 1u);
  const uint32_t code = a >> drop;
  return sign | (uint8_t)std::min<uint32_t>(code, max_code);
}
inline f8e4m3_t to_f8e4m3(float f) { return f8e4m3_t{to_f8<3, 7>(f, 0x7E, kE4M3Max, 0x7F)}; }
inline f8e5m2_t to_f8e5m2(float f) { return f8e5m2_t{to_f8<2, 15>(f, 0x7B, kE5M2Max, 0x7E)}; }

template <class C>
struct Scratch {
  AlignedBuf qbuf, obuf, mbuf, lbuf, sbuf, pbuf, fobuf, fmbuf, flbuf, q8buf;
  float *q = nullptr, *o = nullptr, *m = nullptr, *l = nullptr;
  float* q8 = nullptr;  // decode over an E4M3 cache: q * 256 (see widen_e4m3_unscaled)
  float *fo = nullptr, *fm = nullptr, *fl = nullptr;  // the segments folded so far
  float *part = nullptr, *p = nullptr;  // decode tiles: per-position partial scores, weights
  const C* kp[kTile];
  const C* vp[kTile];
  void ensure(size_t mrows, size_t dp) {
    q = qbuf.get(mrows * dp);
    o = obuf.get(mrows * dp);
    m = mbuf.get(mrows);
    l = lbuf.get(mrows);
    fo = fobuf.get(mrows * dp);
    fm = fmbuf.get(mrows);
    fl = flbuf.get(mrows);
  }
  void ensure_decode(size_t mrows) {
#if LLS_AVX512
    part = sbuf.get(mrows * kTile * 16);  // the portable path keeps no partial sums
#endif
    p = pbuf.get(mrows * kTile);
  }
  void ensure_q8(size_t mrows, size_t dp) { q8 = q8buf.get(mrows * dp); }
};

// ---------------------------------------------------------------------------------------------
// Validation (cheap: O(S + used blocks)); run before anything is written.

int validate_attention(const AttnArgs& a) {
  if (a.S < 0 || a.T < 0) return set_error(-1, "negative batch size");
  if (a.H <= 0 || a.KVH <= 0 || a.D <= 0 || a.block_size <= 0)
    return set_error(-1, "num_heads, num_kv_heads, head_dim and block_size must be positive");
  if (a.H % a.KVH != 0)
    return set_error(-1, "num_heads (%lld) must be a multiple of num_kv_heads (%lld)",
                     (long long)a.H, (long long)a.KVH);
  if (a.S == 0) return 0;
  if (a.qsl[0] < 0) return set_error(-2, "query_start_loc[0] = %d < 0", a.qsl[0]);
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t q0 = a.qsl[s], q1 = a.qsl[s + 1];
    if (q1 < q0)
      return set_error(-2, "query_start_loc must be non-decreasing (index %lld)", (long long)s);
    const int64_t qlen = q1 - q0, sl = a.seq_lens[s];
    if (qlen > sl)
      return set_error(-2, "sequence %lld: query length %lld exceeds seq_len %lld", (long long)s,
                       (long long)qlen, (long long)sl);
    if (qlen == 0) continue;
    const int64_t nblk = (sl + a.block_size - 1) / a.block_size;
    if (nblk > a.max_blocks)
      return set_error(-2, "sequence %lld: seq_len %lld needs %lld blocks but block_tables has %lld",
                       (long long)s, (long long)sl, (long long)nblk, (long long)a.max_blocks);
    const int32_t* bt = a.block_tables + s * a.max_blocks;
    for (int64_t b = 0; b < nblk; ++b)
      if (bt[b] < 0 || bt[b] >= a.num_blocks)
        return set_error(-2, "sequence %lld: block_tables[%lld] = %d out of range [0, %lld)",
                         (long long)s, (long long)b, bt[b], (long long)a.num_blocks);
  }
  if (a.qsl[a.S] > a.T)
    return set_error(-2, "query_start_loc[-1] = %d exceeds the number of query rows %lld",
                     a.qsl[a.S], (long long)a.T);
  return 0;
}

int validate_slots(const int32_t* slots, int64_t T, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= num_slots)
      return set_error(-3, "slot_mapping[%lld] = %d out of range (cache has %lld slots)",
                       (long long)t, slots[t], (long long)num_slots);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// reshape_and_cache

struct CacheWriteCtx {
  const float* key; int64_t key_stride;
  const float* value; int64_t value_stride;
  void* k_cache; void* v_cache;
  const int32_t* slots; int64_t T, row, chunk;
};

inline void store_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, (size_t)n * sizeof(float));
}
inline void store_row(bf16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}
inline void store_row(f16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if LLS_F16C
  const __m256 hi = _mm256_set1_ps(kF16Max), lo = _mm256_set1_ps(-kF16Max);
  for (; i + 8 <= n; i += 8) {
    // min/max return their second operand when it is NaN: a NaN passes through
    const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) dst[i] = to_f16(src[i]);
}

inline void store_row(f8e4m3_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f8e4m3(src[i]);
}
inline void store_row(f8e5m2_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f8e5m2(src[i]);
}

template <class C>
void cache_write_task(void* p, int64_t c) {
  const CacheWriteCtx& w = *static_cast<const CacheWriteCtx*>(p);
  C* kc = static_cast<C*>(w.k_cache);
  C* vc = static_cast<C*>(w.v_cache);
  const int64_t t1 = std::min(w.T, (c + 1) * w.chunk);
  for (int64_t t = c * w.chunk; t < t1; ++t) {
    const int64_t s = w.slots[t];
    if (s < 0) continue;
    store_row(kc + s * w.row, w.key + t * w.key_stride, w.row);
    store_row(vc + s * w.row, w.value + t * w.value_stride, w.row);
  }
}

template <class C>
void do_reshape_and_cache(const float* key, int64_t key_stride, const float* value,
                          int64_t value_stride, C* k_cache, C* v_cache,
                          const int32_t* slots, int64_t T, int64_t row) {
  const int64_t chunk = std::max<int64_t>(1, (1 << 14) / row);  // ~64 KB of K per task
  CacheWriteCtx w{key, key_stride, value, value_stride, k_cache, v_cache, slots, T, row, chunk};
  const int64_t ntasks = (T + chunk - 1) / chunk;
  parallel_for(cache_write_task<C>, &w, ntasks, T * row >= (1 << 16));
}

// ---------------------------------------------------------------------------------------------
// Tile setup shared by both paths: pointers to the K/V rows (at kv head kv0) of context positions
// t0 .. t0+n-1. Slots past n repeat the first pointer (their scores are masked out).

template <class C>
inline void tile_pointers(const AttnArgs& a, const int32_t* bt, int64_t t0, int n, int64_t kv0,
                          const C** kp, const C** vp) {
  const int64_t bs = a.block_size;
  int64_t bi = t0 / bs, off = t0 - bi * bs;
  const int64_t row = a.KVH * a.D;
  for (int j = 0; j < n; ++j) {
    const int64_t idx = ((int64_t)bt[bi] * bs + off) * row + kv0 * a.D;
    kp[j] = static_cast<const C*>(a.k_cache) + idx;
    vp[j] = static_cast<const C*>(a.v_cache) + idx;
    if (++off == bs) { off = 0; ++bi; }
  }
  for (int j = n; j < kTile; ++j) { kp[j] = kp[0]; vp[j] = vp[0]; }
}

// The tile of positions from t0 (up to kTile of them, below nctx), as every loop over a
// context starts it: its K/V row pointers (kv heads from kv0) into kp/vp. Returns its length.
template <class C>
inline int start_tile(const AttnArgs& a, const int32_t* bt, int64_t t0, int64_t nctx,
                      int64_t kv0, const C** kp, const C** vp) {
  const int n = (int)std::min<int64_t>(kTile, nctx - t0);
  tile_pointers<C>(a, bt, t0, n, kv0, kp, vp);
  return n;
}

// A software prefetch of one cache line into L2 that the compiler keeps. GCC 12 (-O1 and up)
// deleted the __builtin_prefetch calls of a loop nest that did nothing else: this file's earlier
// "prefetch the next tile" compiled to no instruction at all. An asm volatile is never deleted.
inline void prefetch_line_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, [%0]" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Decode reads each cache row once, a stream with a jump at every block (which the hardware
// prefetchers do not follow), and does little arithmetic per byte. Left to demand misses, the
// core computed with nothing in flight and then waited with nothing to compute. So the next
// tile's rows are requested into L2 a position at a time, as this tile's loops reach that
// position (its K rows in the q.k loop, its V rows in the p.v loop): the requests go out while
// the arithmetic runs. Per layer call at ctx 256, caches on huge pages (AMD Zen 4): bfloat16
// cache B=64 1.85 -> 1.33 ms (blocks in order) and 2.27 -> 1.45 ms (scattered blocks); float32
// B=64 the same with blocks in order, -7% scattered; B=2 and B=4 -37 to -43%; B=16 the same.
// Measured worse or no better: every other line (bfloat16 lost its gain), the whole next tile
// asked for at once at the tile's start (into L1 or L2), two tiles ahead, the requests spread
// per query head. Prefill chunks (process_item) reuse each tile for many query rows and are
// bound by arithmetic: a working prefetch changed nothing there, so they have none.
template <class C>
struct NextTile {
  const C* k[kTile];
  const C* v[kTile];
  int n = 0;            // its positions (0: past the context)
  const int64_t bytes;  // of one position's rows (the item's kv heads)
  NextTile(const AttnArgs& a, int64_t nkv) : bytes(nkv * a.D * (int64_t)sizeof(C)) {}
  void set(const AttnArgs& a, const int32_t* bt, int64_t t0, int64_t nctx, int64_t kv0) {
    n = t0 < nctx ? (int)std::min<int64_t>(kTile, nctx - t0) : 0;
    if (n) tile_pointers<C>(a, bt, t0, n, kv0, k, v);
  }
  void prefetch_k(int j) const { if (j < n) prefetch_l2(k[j], bytes); }
  void prefetch_v(int j) const { if (j < n) prefetch_l2(v[j], bytes); }
  static void prefetch_l2(const C* row, int64_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63);
    const uintptr_t end = reinterpret_cast<uintptr_t>(row) + bytes;
    for (uintptr_t l = first; l < end; l += 64) prefetch_line_l2(reinterpret_cast<const void*>(l));
  }
};

// Online softmax: what the sum and output accumulated under the running max mold are scaled
// by when the max becomes mnew >= mold. exp(mold - mnew); exactly 1 when the max is unchanged,
// and 0 from the empty start (mold = -inf).
inline float rescale_factor(float mold, float mnew) {
  return mold == mnew ? 1.f
         : mold == -std::numeric_limits<float>::infinity() ? 0.f
                                                           : std::exp(mold - mnew);
}

// Context segments. A row's context is summed in segments of kSegment positions from
// position 0, each with an online softmax of its own; the segments' (max, sum, output) are then
// folded in order (fold_segment). A decode batch of fewer sequences than threads can so give
// one sequence's segments to several threads (SegmentSplit in run_attention): splitting its kv
// heads instead left each thread a strided slice of every cache row, and two threads read no
// faster than one (AMD Zen 3, bfloat16 cache, in step). Every row, decode or prefill, split or
// not, at any batch size and thread count, goes through the same segments and the same folds:
// the same bits. A row of one segment keeps the bits it had before segments. The folds cost a
// 512-token prefill about 3% of its attention; 128 positions keep a context of 256 (the
// benchmarks') in two halves.
constexpr int64_t kSegment = 128;  // positions per segment: a multiple of kTile

inline int64_t num_segments(int64_t nctx) { return (nctx + kSegment - 1) / kSegment; }

inline void reset_rows(float* LLS_RESTRICT m, float* LLS_RESTRICT l, float* LLS_RESTRICT o,
                       int64_t M, int64_t D) {
  std::fill(m, m + M, -std::numeric_limits<float>::infinity());
  std::fill(l, l + M, 0.f);
  std::fill(o, o + M * D, 0.f);
}

// acc (mf, lf, of) <- acc (+) segment (m, l, o), both scaled to the larger max. Explicit fmas:
// the same operations wherever the compiler inlines it. From the empty acc it copies the
// segment exactly.
inline void fold_segment(float& mf, float& lf, float* LLS_RESTRICT of, float m, float l,
                         const float* LLS_RESTRICT o, int64_t D) {
  const float mn = std::max(mf, m);
  const float a = rescale_factor(mf, mn), b = rescale_factor(m, mn);
  lf = std::fma(l, b, lf * a);
  for (int64_t d = 0; d < D; ++d) of[d] = std::fma(o[d], b, of[d] * a);
  mf = mn;
}

// Rows [m0, m1) of the scratch close their segment: folded into their accumulators, then
// reset for the next one. D: the scratch's row length (the AVX-512 path's padded DP).
template <class C>
void close_segments(Scratch<C>& sc, int64_t m0, int64_t m1, int64_t D) {
  for (int64_t m = m0; m < m1; ++m) {
    fold_segment(sc.fm[m], sc.fl[m], sc.fo + m * D, sc.m[m], sc.l[m], sc.o + m * D, D);
    reset_rows(sc.m + m, sc.l + m, sc.o + m * D, 1, D);
  }
}

// SegmentSplit: a one-segment decode item's record for scratch row m (query head
// (kv0 + m / G) * G + m % G = kv0 * G + m) in a.seg_out, which fold_split_segments reads:
// (max, sum) written here, the D floats of output left to the caller at the pointer returned.
template <class C>
inline float* segment_record(const AttnArgs& a, const Item& it, int64_t G, int64_t m,
                             const Scratch<C>& sc) {
  float* rec = a.seg_out + ((int64_t)it.rec * a.H + it.kv0 * G + m) * (a.D + 2);
  rec[0] = sc.m[m];
  rec[1] = sc.l[m];
  return rec + 2;
}

// ---------------------------------------------------------------------------------------------
#if LLS_AVX512

inline __m512 exp512(__m512 x) {
  // exp for x <= 0 (arguments are score - running max). Cody-Waite reduction, degree-7
  // polynomial on |r| <= ln2/2 (relative error ~1e-8 before rounding), scalef to rebuild.
  // The clamp keeps -inf (masked lanes) from producing NaN; callers zero lanes below -87.
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Reduce 16 vectors to one: lane 4*L + c of the result is the horizontal sum of acc[4*c + L].
// Callers store the partial sums of context position j in acc[kSigma[j]] (kSigma is its own
// inverse) so that lane j of the result belongs to position j.
inline __m512 reduce16(__m512* acc) {
  __m512 z[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = acc[2 * i], y = acc[2 * i + 1];
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  __m512 w[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 x = z[2 * i], y = z[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  const __m512 r0 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
  const __m512 r1 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
  const __m512d a = _mm512_castps_pd(r0), b = _mm512_castps_pd(r1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

constexpr int kSigma[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// 16 cache elements as floats (bf16: zero-extend to 32 bits, shift into the high half), with
// the lanes outside `m` zero and never read.
inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 widen16(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
// The 16-bit elements of p in the lanes of `m`, zero elsewhere (bf16_t and f16_t alike).
inline __m256i ld16_bits(__mmask16 m, const void* p) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_loadu_epi16(m, p);
#else
  alignas(32) uint16_t t[16] = {};
  const uint16_t* u = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) t[i] = u[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
#endif
}
inline __m512 ld16(const bf16_t* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 ld16(__mmask16 m, const bf16_t* p) { return widen16(ld16_bits(m, p)); }
inline __m512 ld16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 ld16(__mmask16 m, const f16_t* p) { return _mm512_cvtph_ps(ld16_bits(m, p)); }
// The 8-bit elements of p in the lanes of `m`, zero elsewhere (both FP8 kinds).
inline __m128i ld16_bytes(__mmask16 m, const void* p) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm_maskz_loadu_epi8(m, p);
#else
  alignas(16) uint8_t t[16] = {};
  const uint8_t* u = static_cast<const uint8_t*>(p);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) t[i] = u[i];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
#endif
}
// E5M2 is float16's top byte: shift each byte into the high half of a 16-bit lane.
inline __m512 widen_e5m2(__m128i b) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}
// E4M3 as float16 bits: the byte's magnitude shifted to the half's exponent and mantissa
// (byte << 8, arithmetic >> 1, the copied sign bit cleared), which F16C widens exactly, normals
// and subnormals alike; * 2^8 rebiases (15 -> 7). The NaN code is a NaN.
inline __m512 widen_e4m3(__m128i b) {
  const __m256i h = _mm256_and_si256(
      _mm256_srai_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8), 1),
      _mm256_set1_epi16((short)0xBFFF));
  const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)),
                                            _mm_set1_epi8(0x7F));
#else
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(
      _mm512_and_si512(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7F));
#endif
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
// E4M3 bytes without NaN codes (see e4m3_tile_has_nan) -> their values / 256: widen_e4m3
// without its rebias and NaN fix, three vector ops of its seven. Decode tiles over an E4M3
// cache read K and V so and put the 256 on the query row and on the weights instead: a power of
// two, so each product, hence every rounding, is the same as widen_e4m3's (decode B=64 over an
// E4M3 cache: 0.84x the time, bench_attention_kernel --before HEAD --cache-dtype fp8). A tile
// with a NaN code anywhere is read as stored.
inline __m512 widen_e4m3_unscaled(__m128i b) {
  return _mm512_cvtph_ps(_mm256_and_si256(
      _mm256_srai_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8), 1),
      _mm256_set1_epi16((short)0xBFFF)));
}
struct as_stored {};      // a tag: ld16 of a row as its cache stores it
struct e4m3_unscaled {};  // a tag: ld16 of an E4M3 row without its scale
template <class C> inline __m512 ld16(as_stored, const C* p) { return ld16(p); }
template <class C> inline __m512 ld16(as_stored, __mmask16 m, const C* p) { return ld16(m, p); }
inline __m512 ld16(e4m3_unscaled, const f8e4m3_t* p) {
  return widen_e4m3_unscaled(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 ld16(e4m3_unscaled, __mmask16 m, const f8e4m3_t* p) {
  return widen_e4m3_unscaled(ld16_bytes(m, p));
}
template <class C> inline __m512 ld16(e4m3_unscaled, const C* p) { return ld16(p); }
template <class C> inline __m512 ld16(e4m3_unscaled, __mmask16 m, const C* p) { return ld16(m, p); }

// Whether the n positions' K or V rows (`bytes` each, from kp[j] and vp[j]) hold an E4M3 NaN
// code (S.1111.111): a byte | 0x80 of 0xFF.
inline bool e4m3_tile_has_nan(const f8e4m3_t* const* kp, const f8e4m3_t* const* vp, int n,
                              int64_t bytes) {
#if !defined(__AVX512BW__)
  return true;  // (read them as stored)
#else
  const __m512i top = _mm512_set1_epi8((char)0x80);
  __m512i hi = _mm512_setzero_si512();
  for (int j = 0; j < n; ++j)
    for (const f8e4m3_t* row : {kp[j], vp[j]}) {
      int64_t i = 0;
      for (; i + 64 <= bytes; i += 64)
        hi = _mm512_max_epu8(hi, _mm512_or_si512(_mm512_loadu_si512(row + i), top));
      if (i < bytes)
        hi = _mm512_max_epu8(hi, _mm512_or_si512(
            _mm512_maskz_loadu_epi8(~0ull >> (64 - (bytes - i)), row + i), top));
    }
  return _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)0xFF)) != 0;
#endif
}

inline __m512 ld16(const f8e5m2_t* p) {
  return widen_e5m2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 ld16(__mmask16 m, const f8e5m2_t* p) { return widen_e5m2(ld16_bytes(m, p)); }
inline __m512 ld16(const f8e4m3_t* p) {
  return widen_e4m3(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 ld16(__mmask16 m, const f8e4m3_t* p) { return widen_e4m3(ld16_bytes(m, p)); }

// Scores of one (pre-scaled, zero-padded) query row against 16 context rows kr[j], widened
// rows of nc chunks of 16 floats, zero-padded (WideTile).
template <int NC>
inline __m512 qk16(const float* LLS_RESTRICT q, const float* const* kr, int nc_rt) {
  const int nc = NC > 0 ? NC : nc_rt;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) {
    const float* LLS_RESTRICT k = kr[kSigma[i]];
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < nc; ++c)
      s = _mm512_fmadd_ps(_mm512_load_ps(q + 16 * c), _mm512_load_ps(k + 16 * c), s);
    acc[i] = s;
  }
  return reduce16(acc);
}

// o = o * corr + sum_{j < n} p[j] * vr[j] (widened rows, as qk16's)
template <int NC>
inline void pv16(float* LLS_RESTRICT o, float corr, const float* LLS_RESTRICT p,
                 const float* const* vr, int n, int nc_rt) {
  const __m512 vc = _mm512_set1_ps(corr);
  if (NC > 0) {
    __m512 acc[NC > 0 ? NC : 1];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_mul_ps(_mm512_load_ps(o + 16 * c), vc);
    for (int j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      const float* LLS_RESTRICT v = vr[j];
      for (int c = 0; c < NC; ++c)
        acc[c] = _mm512_fmadd_ps(pj, _mm512_load_ps(v + 16 * c), acc[c]);
    }
    for (int c = 0; c < NC; ++c) _mm512_store_ps(o + 16 * c, acc[c]);
  } else {
    for (int c = 0; c < nc_rt; ++c) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(o + 16 * c), vc);
      for (int j = 0; j < n; ++j)
        x = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_load_ps(vr[j] + 16 * c), x);
      _mm512_store_ps(o + 16 * c, x);
    }
  }
}

// ---- bf16 caches, 32 elements at a time ------------------------------------------------------
// Widening 16 bf16 values one by one (zero-extend, shift) costs two vector ops per 16 values on
// top of the FMA, which made a bf16 cache as slow as a float32 one of twice the bytes. Read 32
// at a time as 16 32-bit pairs instead: the even elements are the pairs shifted left by 16, the
// odd ones the pairs with the low half cleared, one op per 16 values and no shuffle. The rows
// they meet (the scaled query, the output accumulator) are kept in that order: per 32
// elements, the 16 even then the 16 odd ("paired" order), and put back in order at the end.
// Scores then sum even and odd products in another order than the float32 path; each output
// element's sum over the context is the same chain as before.
#if defined(__AVX512BW__)
#define LLS_BF16_PAIRS 1

// A full group is read with a plain load: masked loads of rows that come from memory cost far
// more (decode B=64 ctx 256 over DRAM-resident caches: 15 -> 20 GB/s, bench_attention_kernel
// --cache-dtype bfloat16, Intel Xeon); only a row's last group, when D % 32, is masked.
inline void ld32(const bf16_t* p, __mmask32 m, __m512& ev, __m512& od) {
  const __m512i u = m == (__mmask32)0xFFFFFFFFu ? _mm512_loadu_si512(p)
                                                : _mm512_maskz_loadu_epi16(m, p);
  ev = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  od = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

inline __mmask32 pair_mask(int64_t D, int c, int np) {
  return (c == np - 1 && D % 32) ? (__mmask32)((1u << (D % 32)) - 1) : (__mmask32)0xFFFFFFFFu;
}

// 32 floats of a row (masked to the row's length) -> even and odd elements.
inline void to_pairs(const float* src, __mmask32 m, __m512& ev, __m512& od) {
  const __m512 a = _mm512_maskz_loadu_ps((__mmask16)m, src);
  const __m512 b = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), src + 16);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  ev = _mm512_permutex2var_ps(a, even, b);
  od = _mm512_permutex2var_ps(a, odd, b);
}

// even and odd elements * s -> 32 floats of a row (masked).
inline void from_pairs(float* dst, __mmask32 m, __m512 ev, __m512 od, __m512 s) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  _mm512_mask_storeu_ps(dst, (__mmask16)m, _mm512_mul_ps(_mm512_permutex2var_ps(ev, lo, od), s));
  _mm512_mask_storeu_ps(dst + 16, (__mmask16)(m >> 16),
                        _mm512_mul_ps(_mm512_permutex2var_ps(ev, hi, od), s));
}

#else
#define LLS_BF16_PAIRS 0
#endif

// ALiBi: scores s of the tile whose lane i is key position q_rel0 + i relative to the query's
// own (<= 0 where it may attend) plus slope * that distance; exact integers in float, then
// one fma, as the portable path's alibi_tile.
inline __m512 add_alibi(__m512 s, float slope, int64_t q_rel0) {
  const __m512 rel = _mm512_add_ps(_mm512_set1_ps((float)q_rel0),
                                   _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                  14, 15));
  return _mm512_fmadd_ps(_mm512_set1_ps(slope), rel, s);
}

// Online softmax step of one query head over a tile: scores s (lanes outside `valid` are
// ignored) -> the tile's weights exp(s - max) into p[16], the running max m and sum l updated;
// returns the factor the output accumulated so far must be scaled by.
inline float softmax_tile(__m512 s, __mmask16 valid, float& m, float& l, float* p) {
  s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, s);
  const float mold = m;
  const float mnew = std::max(mold, _mm512_reduce_max_ps(s));
  const float corr = rescale_factor(mold, mnew);
  // exp(x) for x >= -87 (a normal float); lanes below, and invalid lanes, are exactly 0, so no
  // denormals enter the accumulators
  const __m512 x = _mm512_sub_ps(s, _mm512_set1_ps(mnew));
  const __mmask16 keep = valid & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 e = _mm512_maskz_mov_ps(keep, exp512(x));
  _mm512_store_ps(p, e);
  l = l * corr + _mm512_reduce_add_ps(e);
  m = mnew;
  return corr;
}

// One query row per sequence (decode), over positions [t_begin, t_end) of its context (one
// segment; the next tile's rows are prefetched up to t_ahead, the context's end when the item
// goes on to the next segment): the same sums as the tiles of process_item below, in
// the same order (so the same bits), but each tile's K rows, then its V rows, are read in
// address order: position by position, all of the item's kv heads of a position (one
// contiguous run of the cache) at once. Going head by head instead (16 rows 256 bytes each,
// a row apart, then the next head) read the cache from memory at 15-17 GB/s against 27-29 GB/s
// for the same bytes in order (AMD Zen 4, decode B=64 ctx 256). A position's partial q.k sums
// go to sc.part, in the lane order reduce16 takes; the weights to sc.p; the output rows stay
// in sc.o (L1-sized: 16 x 16 floats of partial sums and D floats of output per query head).
template <int NC, class C>
void decode_tiles(const AttnArgs& a, const int32_t* bt, int64_t t_begin, int64_t t_end,
                  int64_t t_ahead, int64_t qpos, int64_t kv0, int64_t nkv, int64_t G, int nc,
                  __mmask16 tail, int64_t D, int64_t DP, Scratch<C>& sc) {
  constexpr bool kPairs = LLS_BF16_PAIRS && std::is_same<C, bf16_t>::value;
  constexpr int NP = NC > 0 ? (NC + 1) / 2 : 0;
  const int np = (int)((D + 31) / 32);
  const int64_t M = G * nkv;
  float* LLS_RESTRICT qb = sc.q;
  float* LLS_RESTRICT ob = sc.o;
  float* LLS_RESTRICT part = sc.part;
  float* LLS_RESTRICT pw = sc.p;
  const C** kp = sc.kp;
  const C** vp = sc.vp;
  NextTile<C> next(a, nkv);
  int n = 0;
  // q.k partial sums, position-major; lanes of positions past n are zeros (masked below).
  // `how` reads the rows as stored (as_stored) or an E4M3 cache's unscaled (e4m3_unscaled:
  // with the query rows sc.q8 and the weights * 256)
  auto qk_tile = [&](auto how) {
    constexpr bool kUnscaled = std::is_same<decltype(how), e4m3_unscaled>::value;
    const float* LLS_RESTRICT qrows = kUnscaled ? sc.q8 : qb;
    for (int j = 0; j < kTile; ++j) {
      next.prefetch_k(j);
      for (int64_t m = 0; m < M; ++m) {
        float* dst = part + (m * kTile + kSigma[j]) * 16;
        if (j >= n) {
          _mm512_store_ps(dst, _mm512_setzero_ps());
          continue;
        }
        const C* LLS_RESTRICT k = kp[j] + (m / G) * D;
        const float* LLS_RESTRICT q = qrows + m * DP;
        __m512 s = _mm512_setzero_ps();
#if LLS_BF16_PAIRS
        if constexpr (kPairs) {
          for (int c = 0; c < np; ++c) {
            __m512 ev, od;
            ld32(reinterpret_cast<const bf16_t*>(k) + 32 * c, pair_mask(D, c, np), ev, od);
            s = _mm512_fmadd_ps(_mm512_load_ps(q + 32 * c), ev, s);
            s = _mm512_fmadd_ps(_mm512_load_ps(q + 32 * c + 16), od, s);
          }
          _mm512_store_ps(dst, s);
          continue;
        }
#endif
        const int ncr = NC > 0 ? NC : nc;
        for (int c = 0; c < ncr - 1; ++c)
          s = _mm512_fmadd_ps(_mm512_load_ps(q + 16 * c), ld16(how, k + 16 * c), s);
        s = _mm512_fmadd_ps(_mm512_load_ps(q + 16 * (ncr - 1)),
                            ld16(how, tail, k + 16 * (ncr - 1)), s);
        _mm512_store_ps(dst, s);
      }
    }
  };
  // online softmax per query head; the output rows rescaled
  auto softmax_rows = [&](int64_t t0) {
    const __mmask16 valid = (__mmask16)(n >= 16 ? 0xFFFFu : ((1u << n) - 1));
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_load_ps(part + (m * kTile + i) * 16);
      __m512 s = reduce16(acc);
      if (a.alibi) s = add_alibi(s, a.alibi[kv0 * G + m], t0 - qpos);  // query head kv0*G+m
      const float corr = softmax_tile(s, valid, sc.m[m], sc.l[m], pw + m * kTile);
      const __m512 vc = _mm512_set1_ps(corr);
      for (int64_t c = 0; c < DP; c += 16)
        _mm512_store_ps(ob + m * DP + c, _mm512_mul_ps(_mm512_load_ps(ob + m * DP + c), vc));
    }
  };
  // o += p * v, position-major
  auto pv_tile = [&](auto how) {
    constexpr bool kUnscaled = std::is_same<decltype(how), e4m3_unscaled>::value;
    for (int j = 0; j < n; ++j) {
      next.prefetch_v(j);
      for (int64_t m = 0; m < M; ++m) {
        const C* LLS_RESTRICT v = vp[j] + (m / G) * D;
        float* LLS_RESTRICT o = ob + m * DP;
        const __m512 pj = _mm512_set1_ps(kUnscaled ? pw[m * kTile + j] * 256.f : pw[m * kTile + j]);
#if LLS_BF16_PAIRS
        if constexpr (kPairs) {
          for (int c = 0; c < np; ++c) {
            __m512 ev, od;
            ld32(reinterpret_cast<const bf16_t*>(v) + 32 * c, pair_mask(D, c, np), ev, od);
            _mm512_store_ps(o + 32 * c, _mm512_fmadd_ps(pj, ev, _mm512_load_ps(o + 32 * c)));
            _mm512_store_ps(o + 32 * c + 16,
                            _mm512_fmadd_ps(pj, od, _mm512_load_ps(o + 32 * c + 16)));
          }
          continue;
        }
#endif
        const int ncr = NC > 0 ? NC : nc;
        for (int c = 0; c < ncr - 1; ++c)
          _mm512_store_ps(o + 16 * c,
                          _mm512_fmadd_ps(pj, ld16(how, v + 16 * c), _mm512_load_ps(o + 16 * c)));
        _mm512_store_ps(o + 16 * (ncr - 1),
                        _mm512_fmadd_ps(pj, ld16(how, tail, v + 16 * (ncr - 1)),
                                        _mm512_load_ps(o + 16 * (ncr - 1))));
      }
    }
  };
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    n = start_tile<C>(a, bt, t0, t_end, kv0, kp, vp);
    next.set(a, bt, t0 + kTile, t_ahead, kv0);
    bool unscaled = false;
    if constexpr (std::is_same<C, f8e4m3_t>::value)
      unscaled = !e4m3_tile_has_nan(kp, vp, n, nkv * D);
    if (unscaled) qk_tile(e4m3_unscaled{});
    else qk_tile(as_stored{});
    softmax_rows(t0);
    if (unscaled) pv_tile(e4m3_unscaled{});
    else pv_tile(as_stored{});
  }
}

// A scratch output row (DP floats, in paired order for a bf16 cache read in pairs) * s -> D
// floats of dst in natural order.
template <class C>
inline void store_output(float* dst, const float* LLS_RESTRICT src, __m512 s, int64_t D, int np,
                         int nc, __mmask16 tail) {
#if LLS_BF16_PAIRS
  if constexpr (LLS_BF16_PAIRS && std::is_same<C, bf16_t>::value) {
    for (int c = 0; c < np; ++c)
      from_pairs(dst + 32 * c, pair_mask(D, c, np), _mm512_load_ps(src + 32 * c),
                 _mm512_load_ps(src + 32 * c + 16), s);
    return;
  }
#endif
  for (int c = 0; c < nc; ++c) {
    const __mmask16 mk = c == nc - 1 ? tail : (__mmask16)0xFFFF;
    _mm512_mask_storeu_ps(dst + 16 * c, mk, _mm512_mul_ps(_mm512_load_ps(src + 16 * c), s));
  }
}

// WideTile. A prefill chunk reads each tile's K/V rows for every query row of its item. Read in
// place, a narrow cache's bytes (bfloat16, float16, FP8) were widened again for each query row
// (E4M3: about ten vector ops per 16 values), so an E4M3 cache's prefill took 1.6-1.8x
// float32's time. So a tile's K and V rows of one kv head are first widened into a small aligned scratch,
// 2 x 16 rows of DP floats (8 KB at D = 64: L1), by the same ld16/ld32 as before, zero past D,
// and qk16/pv16 read them there: the same values into the same FMAs in the same order, so the
// same bits as before and as decode_tiles. A bfloat16 row is kept in paired order (per 32
// elements the even, then the odd ones, as ld32 yields them): its 2 * np chunks of 16 go
// through the FMAs in the order decode_tiles' paired loop uses. float32 rows are copied too: read from
// the copy they were faster still than in place (12 kv heads -28%, 1 kv head -14%; in place a
// tile's rows of one kv head lie a cache row apart). A 512-token prefill, AMD Zen 5, one thread,
// us per layer call: float32 7500 -> 5790, bfloat16 6110 -> 5630, float16 6910 -> 5600, E4M3
// 13640 -> 5750, E5M2 8290 -> 5480 (bench/bench_attention_kernel.py --before; benchmarks.md).

// Row j < n of rows (plus off) widened into dst + j * DP, zero past D.
template <int NC, class C>
inline void widen_rows(float* LLS_RESTRICT dst, const C* const* rows, int64_t off, int n,
                       int64_t D, int64_t DP, int nc_rt, __mmask16 tail) {
  const int nc = NC > 0 ? NC : nc_rt;
  for (int j = 0; j < n; ++j) {
    const C* LLS_RESTRICT src = rows[j] + off;
    float* LLS_RESTRICT row = dst + j * DP;
#if LLS_BF16_PAIRS
    if constexpr (std::is_same<C, bf16_t>::value) {
      const int np = (int)(DP / 32);
      for (int c = 0; c < np; ++c) {
        __m512 ev, od;
        ld32(src + 32 * c, pair_mask(D, c, np), ev, od);
        _mm512_store_ps(row + 32 * c, ev);
        _mm512_store_ps(row + 32 * c + 16, od);
      }
      continue;
    }
#endif
    for (int c = 0; c < nc - 1; ++c) _mm512_store_ps(row + 16 * c, ld16(src + 16 * c));
    _mm512_store_ps(row + 16 * (nc - 1), ld16(tail, src + 16 * (nc - 1)));
  }
}

// The tile's K and V rows (kp/vp plus off: one kv head) widened into buf (2 * kTile * DP
// floats); kr/vr get their row pointers (positions past n: row 0, as tile_pointers does).
template <int NC, class C>
inline void widen_tile(float* buf, const float** kr, const float** vr, const C* const* kp,
                       const C* const* vp, int64_t off, int n, int64_t D, int64_t DP, int nc,
                       __mmask16 tail) {
  float* vb = buf + kTile * DP;
  widen_rows<NC, C>(buf, kp, off, n, D, DP, nc, tail);
  widen_rows<NC, C>(vb, vp, off, n, D, DP, nc, tail);
  for (int j = 0; j < kTile; ++j) {
    kr[j] = buf + (j < n ? j : 0) * DP;
    vr[j] = vb + (j < n ? j : 0) * DP;
  }
}

// Scratch row m = (hh * nrows + r) * G + gh holds query row r, query head gh of kv head kv0+hh.
template <int NC, class C>
void process_item(const AttnArgs& a, const Item& it, Scratch<C>& sc) {
  const int64_t D = a.D, G = a.H / a.KVH, nrows = it.nrows, nkv = it.nkv;
  const int nc = (int)((D + 15) / 16);
  const __mmask16 tail = (D % 16) ? (__mmask16)((1u << (D % 16)) - 1) : (__mmask16)0xFFFF;
  // a bf16 cache: rows in paired order, 32-element groups (NP of them, 0 = known at run time)
  constexpr bool kPairs = LLS_BF16_PAIRS && std::is_same<C, bf16_t>::value;
  constexpr int NP = NC > 0 ? (NC + 1) / 2 : 0;
  const int np = (int)((D + 31) / 32);
  const int64_t DP = kPairs ? (int64_t)np * 32 : (int64_t)nc * 16;
  const int64_t M = nrows * G * nkv;
  sc.ensure(M, DP);
  float* LLS_RESTRICT qb = sc.q;
  float* LLS_RESTRICT ob = sc.o;
  float* LLS_RESTRICT mrow = sc.m;
  float* LLS_RESTRICT lrow = sc.l;
  const C** kp = sc.kp;
  const C** vp = sc.vp;

  const int64_t qrow0 = a.qsl[it.seq] + it.row0;  // absolute query row of the block's first row
  const int64_t qlen = a.qsl[it.seq + 1] - a.qsl[it.seq];
  const int64_t pos0 = a.seq_lens[it.seq] - qlen + it.row0;  // context position of that row
  const __m512 vscale = _mm512_set1_ps(a.scale);
  for (int64_t hh = 0; hh < nkv; ++hh)
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t gh = 0; gh < G; ++gh) {
        const int64_t m = (hh * nrows + r) * G + gh;
        const float* src = a.q + (qrow0 + r) * a.q_stride + ((it.kv0 + hh) * G + gh) * D;
#if LLS_BF16_PAIRS
        if constexpr (kPairs) {
          for (int c = 0; c < np; ++c) {
            __m512 ev, od;
            to_pairs(src + 32 * c, pair_mask(D, c, np), ev, od);
            _mm512_store_ps(qb + m * DP + 32 * c, _mm512_mul_ps(ev, vscale));
            _mm512_store_ps(qb + m * DP + 32 * c + 16, _mm512_mul_ps(od, vscale));
          }
          continue;
        }
#endif
        for (int c = 0; c < nc; ++c) {
          const __mmask16 mk = c == nc - 1 ? tail : (__mmask16)0xFFFF;
          _mm512_store_ps(qb + m * DP + 16 * c,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, src + 16 * c), vscale));
        }
      }
  reset_rows(sc.fm, sc.fl, sc.fo, M, DP);
  reset_rows(mrow, lrow, ob, M, DP);

  const int32_t* bt = a.block_tables + (int64_t)it.seq * a.max_blocks;
  const int64_t nctx = pos0 + nrows;  // positions 0 .. last row's position
  alignas(64) float p[16];
  if (nrows == 1) {  // decode: read each tile's cache rows in address order
    sc.ensure_decode(M);
    if constexpr (std::is_same<C, f8e4m3_t>::value) {  // (see widen_e4m3_unscaled)
      sc.ensure_q8(M, DP);
      for (int64_t i = 0; i < M * DP; i += 16)
        _mm512_store_ps(sc.q8 + i, _mm512_mul_ps(_mm512_load_ps(qb + i), _mm512_set1_ps(256.f)));
    }
    if (it.seg >= 0) {
      const int64_t t_end = std::min(nctx, (it.seg + 1) * kSegment);
      decode_tiles<NC, C>(a, bt, it.seg * kSegment, t_end, t_end, pos0, it.kv0, nkv, G, nc,
                          tail, D, DP, sc);
      for (int64_t m = 0; m < M; ++m)
        store_output<C>(segment_record(a, it, G, m, sc), ob + m * DP, _mm512_set1_ps(1.f), D,
                        np, nc, tail);
      return;
    }
    for (int64_t t = 0; t < nctx; t += kSegment) {  // as many as num_segments(nctx)
      decode_tiles<NC, C>(a, bt, t, std::min(nctx, t + kSegment), nctx, pos0, it.kv0, nkv, G,
                          nc, tail, D, DP, sc);
      close_segments(sc, 0, M, DP);
    }
  } else for (int64_t t0 = 0; t0 < nctx; t0 += kTile) {
    // the tile's rows of each kv head widened (WideTile) into a thread's buffer, named once per
    // tile: GCC calls __tls_get_addr wherever a thread_local is named, and inside the p.v loop
    // that spilled its accumulators (+19%). A widened row is NW (nw) chunks of 16 floats.
    static thread_local AlignedBuf wide_buf;
    float* wide = wide_buf.get((size_t)(2 * kTile * DP));
    const float* kr[kTile];
    const float* vr[kTile];
    constexpr int NW = kPairs ? 2 * NP : NC;
    const int nw = (int)(DP / 16);
    const int n = start_tile<C>(a, bt, t0, nctx, it.kv0, kp, vp);
    // rows whose position is below t0 see nothing of this tile
    const int64_t rfirst = std::max<int64_t>(0, t0 - pos0);
    if (t0 > 0 && t0 % kSegment == 0)  // the rows that see it close their segment
      for (int64_t hh = 0; hh < nkv; ++hh)
        close_segments(sc, (hh * nrows + rfirst) * G, (hh + 1) * nrows * G, DP);
    for (int64_t hh = 0; hh < nkv; ++hh) {
      widen_tile<NC, C>(wide, kr, vr, kp, vp, hh * D, n, D, DP, nc, tail);
      for (int64_t r = rfirst; r < nrows; ++r) {
        const int nvalid = (int)std::min<int64_t>(n, pos0 + r - t0 + 1);
        const __mmask16 valid = (__mmask16)((nvalid >= 16) ? 0xFFFFu : ((1u << nvalid) - 1));
        for (int64_t gh = 0; gh < G; ++gh) {
          const int64_t m = (hh * nrows + r) * G + gh;
          __m512 s = qk16<NW>(qb + m * DP, kr, nw);
          if (a.alibi) s = add_alibi(s, a.alibi[(it.kv0 + hh) * G + gh], t0 - (pos0 + r));
          const float corr = softmax_tile(s, valid, mrow[m], lrow[m], p);
          pv16<NW>(ob + m * DP, corr, p, vr, nvalid, nw);
        }
      }
    }
  }
  if (nrows > 1) close_segments(sc, 0, M, DP);  // (a decode row closed its last one above)
  for (int64_t hh = 0; hh < nkv; ++hh)
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t gh = 0; gh < G; ++gh) {
        const int64_t m = (hh * nrows + r) * G + gh;
        float* dst = a.out + (qrow0 + r) * a.out_stride + ((it.kv0 + hh) * G + gh) * D;
        store_output<C>(dst, sc.fo + m * DP, _mm512_set1_ps(1.0f / sc.fl[m]), D, np, nc, tail);
      }
}

#else  // portable path

#if LLS_AVX2
// With AVX2 and D a multiple of 8, q . k and o += p * v are written out in 8-wide FMAs, in both
// paths below (so decode and prefill rows keep the same bits). Against the compiler's
// vectorization of the portable loops below (separate multiplies and adds, an integer division
// per decode row, AMD Zen 3, ctx 256, per layer call): decode float32 -3 to -9%, bfloat16 cache
// -9 to -16%; a 512-token prefill -14% (float32) and -24 to -28% (bfloat16). Computing several
// dot products at once (interleaved loads of several rows) was slower at decode: the cache is
// best read in address order.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const f8e5m2_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}
// E4M3 as widen_e4m3 does it, 8 at a time (the NaN code by a blend).
inline __m256 load8(const f8e4m3_t* p) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1),
                                  _mm_set1_epi16((short)0xBFFF));
  const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  const __m128i nan16 = _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)),
                                        _mm_set1_epi16(0x7F));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16));
  return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
}

// q . k: 8 partial sums (element d in lane d % 8, one FMA chain per lane in the order of d),
// added in the tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
template <class C>
inline float dot8(const float* LLS_RESTRICT q, const C* LLS_RESTRICT k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int64_t d = 0; d < D; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  const __m256 h = _mm256_hadd_ps(acc, acc);  // [l0+l1, l2+l3, ., . | l4+l5, l6+l7, ., .]
  const __m256 t = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

template <class C>
inline void axpy8(float* LLS_RESTRICT o, float p, const C* LLS_RESTRICT v, int64_t D) {
  const __m256 pv = _mm256_set1_ps(p);
#pragma GCC unroll 16
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(o + d)));
}
#endif

// q . k over D elements in 8 interleaved partial sums (element d into sum d % 8), added in a
// fixed tree at the end: the compiler turns the 8 sums into one vector (AVX2: a ymm), where a
// single running sum is one scalar FMA chain, latency-bound (6x slower prefill attention, AMD
// Zen 4 built without AVX-512). The order is fixed, so every row's scores are the same bits
// wherever the row is computed.
template <class C>
inline float dot_lanes(const float* LLS_RESTRICT q, const C* LLS_RESTRICT k, int64_t D) {
#if LLS_AVX2
  if (D % 8 == 0) return dot8(q, k, D);
#endif
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * tof(k[d + l]);
  for (int64_t t = 0; t < D % 8; ++t) acc[t] += q[d + t] * tof(k[d + t]);  // d % 8 == 0 here
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// o += p * v over D elements (both paths below: the same operations, so the same bits).
template <class C>
inline void axpy(float* LLS_RESTRICT o, float p, const C* LLS_RESTRICT v, int64_t D) {
#if LLS_AVX2
  if (D % 8 == 0) return axpy8(o, p, v, D);
#endif
  for (int64_t d = 0; d < D; ++d) o[d] += p * tof(v[d]);
}

// exp(x) for x <= 0 (a score minus the running max), as the AVX-512 path's exp512 computes it
// (Cody-Waite reduction, degree-7 polynomial, exponent rebuilt), written so that the compiler
// vectorizes a loop of it: libm's expf, one call per score, was ~22% of this path's prefill
// attention (AMD Zen 4 built -mno-avx512f). Exactly 0 below -87, so no denormals enter the
// sums.
inline float exp_nonpos(float x) {
  const float xc = std::max(x, -87.f);
  const float t = xc * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // t rounded to the nearest integer
  float r = std::fma(-n, 0.693359375f, xc);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = ((int32_t)n + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale * (float)(x >= -87.f);  // a select, vectorized (-fno-trapping-math)
}

// ALiBi: the n scores s of a tile whose key j is q_rel0 + j positions from the query plus
// slope * that distance (the AVX-512 path's add_alibi: the same fma, the same bits).
inline void alibi_tile(float* LLS_RESTRICT s, int n, float slope, int64_t q_rel0) {
  for (int j = 0; j < n; ++j) s[j] = std::fma(slope, (float)(q_rel0 + j), s[j]);
}

// Online softmax step of one query row over a tile's n scores s: the weights exp(s - max) in
// place, the running max m and sum l updated, the output row o [D] rescaled.
inline void softmax_tile(float* LLS_RESTRICT s, int n, float& m, float& l,
                         float* LLS_RESTRICT o, int64_t D) {
  float tmax = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; ++j) tmax = std::max(tmax, s[j]);
  const float mold = m, mnew = std::max(mold, tmax);
  const float corr = rescale_factor(mold, mnew);
  for (int j = 0; j < n; ++j) s[j] = exp_nonpos(s[j] - mnew);
  float lsum = 0.f;
  for (int j = 0; j < n; ++j) lsum += s[j];
  l = l * corr + lsum;
  m = mnew;
  for (int64_t d = 0; d < D; ++d) o[d] *= corr;
}

// One query row per sequence (decode), over positions [t_begin, t_end) of its context
// (prefetching up to t_ahead, as in the AVX-512 path's decode_tiles): the sums of item_rows'
// prefill tiles below, in the same order (the same bits), with each tile's
// K rows, then its V rows, read in address order: position by position, all of the item's kv
// heads of a position (one contiguous run of the cache) at once, as the AVX-512 path's
// decode_tiles does. sc.p holds the M x kTile scores. Against head by head (AMD Zen 4 built
// -mno-avx512f, ctx 256, per layer call): decode B=64 6.3-6.7 -> 4.0 ms float32 and 5.2-5.6 ->
// 3.2-3.3 ms bfloat16, B=16 1.6-1.7 -> 0.94 ms and 2.1 -> 0.74 ms (bench_attention_kernel.py).
template <int DC, class C>
void decode_tiles(const AttnArgs& a, const int32_t* bt, int64_t t_begin, int64_t t_end,
                  int64_t t_ahead, int64_t qpos, int64_t kv0, int64_t nkv, int64_t G,
                  Scratch<C>& sc) {
  const int64_t D = DC ? DC : a.D, M = G * nkv;
  float* LLS_RESTRICT s = sc.p;
  const C** kp = sc.kp;
  const C** vp = sc.vp;
  NextTile<C> next(a, nkv);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int n = start_tile<C>(a, bt, t0, t_end, kv0, kp, vp);
    next.set(a, bt, t0 + kTile, t_ahead, kv0);
    for (int j = 0; j < n; ++j) {
      next.prefetch_k(j);
      // query row m reads kv head m / G, at offset off of the row (no division per row)
      for (int64_t m = 0, g = 0, off = 0; m < M; ++m) {
        s[m * kTile + j] = dot_lanes(sc.q + m * D, kp[j] + off, D);
        if (++g == G) { g = 0; off += D; }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      if (a.alibi) alibi_tile(s + m * kTile, n, a.alibi[kv0 * G + m], t0 - qpos);
      softmax_tile(s + m * kTile, n, sc.m[m], sc.l[m], sc.o + m * D, D);
    }
    for (int j = 0; j < n; ++j) {
      next.prefetch_v(j);
      for (int64_t m = 0, g = 0, off = 0; m < M; ++m) {
        axpy(sc.o + m * D, s[m * kTile + j], vp[j] + off, D);
        if (++g == G) { g = 0; off += D; }
      }
    }
  }
}

// Query rows pos0 .. pos0 + nrows - 1 of a prefill chunk over their context, head by head,
// each row's segments closed as it goes past them (the last one is left open). Where dot_lanes
// and axpy run AVX2's 8-wide code (D % 8 == 0), each tile's K and V rows of a kv head are
// first widened (or copied) into a small buffer, 2 x 16 rows of D floats, by load8 as they
// would widen them, and all the item's query rows read them there, as in the AVX-512 path (see
// WideTile): the same values through the same FMAs, the same bits. A 512-token prefill, AMD
// Zen 5 built -mno-avx512f, one thread, us per layer call: float32 9270 -> 7870, bfloat16
// 10270 -> 7740, float16 9510 -> 7680, E4M3 26210 -> 8120, E5M2 13590 -> 7750. The scalar
// loops read the cache in place: GCC compiles them for a float row and a narrow one into other
// operations (fused or not), so widened rows gave other bits than a decode row's.
template <int DC, class C>
void prefill_tiles(const AttnArgs& a, const int32_t* bt, int64_t pos0, int64_t nrows,
                   int64_t kv0, int64_t nkv, int64_t G, Scratch<C>& sc) {
  const int64_t D = DC ? DC : a.D, nctx = pos0 + nrows;
  float* LLS_RESTRICT qb = sc.q;
  float* LLS_RESTRICT ob = sc.o;
  float* LLS_RESTRICT mrow = sc.m;
  float* LLS_RESTRICT lrow = sc.l;
  const C** kp = sc.kp;
  const C** vp = sc.vp;
  float s[kTile];
#if LLS_AVX2
  static thread_local AlignedBuf wide_buf;  // (named once: see the AVX-512 path's tile loop)
  float* LLS_RESTRICT kw = D % 8 == 0 ? wide_buf.get((size_t)(2 * kTile * D)) : nullptr;
#endif
  // the rows of kv head hh that see the tile; krow(j) and vrow(j): position j's K and V rows
  auto tile_rows = [&](int64_t t0, int n, int64_t rfirst, int64_t hh, auto krow, auto vrow) {
    for (int64_t r = rfirst; r < nrows; ++r) {
      const int nvalid = (int)std::min<int64_t>(n, pos0 + r - t0 + 1);
      for (int64_t gh = 0; gh < G; ++gh) {
        const int64_t m = (hh * nrows + r) * G + gh;
        const float* LLS_RESTRICT q = qb + m * D;
        for (int j = 0; j < nvalid; ++j) s[j] = dot_lanes(q, krow(j), D);
        if (a.alibi) alibi_tile(s, nvalid, a.alibi[(kv0 + hh) * G + gh], t0 - (pos0 + r));
        float* LLS_RESTRICT o = ob + m * D;
        softmax_tile(s, nvalid, mrow[m], lrow[m], o, D);
        for (int j = 0; j < nvalid; ++j) axpy(o, s[j], vrow(j), D);
      }
    }
  };
  for (int64_t t0 = 0; t0 < nctx; t0 += kTile) {
    const int n = start_tile<C>(a, bt, t0, nctx, kv0, kp, vp);
    const int64_t rfirst = std::max<int64_t>(0, t0 - pos0);  // rows that see this tile
    if (t0 > 0 && t0 % kSegment == 0)
      for (int64_t hh = 0; hh < nkv; ++hh)
        close_segments(sc, (hh * nrows + rfirst) * G, (hh + 1) * nrows * G, D);
    for (int64_t hh = 0; hh < nkv; ++hh) {
      const int64_t off = hh * D;
#if LLS_AVX2
      if (kw) {
        float* LLS_RESTRICT vw = kw + kTile * D;
        for (int j = 0; j < n; ++j)
          for (int64_t d = 0; d < D; d += 8) {
            _mm256_storeu_ps(kw + j * D + d, load8(kp[j] + off + d));
            _mm256_storeu_ps(vw + j * D + d, load8(vp[j] + off + d));
          }
        tile_rows(t0, n, rfirst, hh, [&](int j) { return kw + j * D; },
                  [&](int j) { return vw + j * D; });
        continue;
      }
#endif
      tile_rows(t0, n, rfirst, hh, [&](int j) { return kp[j] + off; },
                [&](int j) { return vp[j] + off; });
    }
  }
}

// An item's rows over their context. DC: the head size when known at compile time (16 * NC,
// else 0), so the q.k and p.v loops of 8-wide FMAs unroll: left as loops, each dot product's
// 8 FMAs waited on the loop's branch and on each other. The same operations in the same order
// (the same bits). AMD Zen 3, ctx 256, per layer call against the runtime D, interleaved
// (bench_attention_kernel.py --before): in step (--in-step), bfloat16 decode -3 to -10% (B=1 to
// 64), float32 within +-3%; back to back, bfloat16 -6 to -27%; a 512-token prefill -31 to -38%
// in both. Tried and not kept: 8 rows' q.k at once with one shared reduction (within +-2%,
// float32 B=4 +7%); starting the prefetch one tile earlier, or two tiles ahead (the same, or
// 6-12% slower).
// An item of one segment (it.seg >= 0, a decode row) leaves that segment's (max, sum, output)
// per query head in a.seg_out, for run_attention to fold.
template <int DC, class C>
void item_rows(const AttnArgs& a, const Item& it, Scratch<C>& sc) {
  const int64_t D = DC ? DC : a.D, G = a.H / a.KVH, nrows = it.nrows, nkv = it.nkv;
  const int64_t M = nrows * G * nkv;
  sc.ensure(M, D);
  const int64_t qrow0 = a.qsl[it.seq] + it.row0;
  const int64_t qlen = a.qsl[it.seq + 1] - a.qsl[it.seq];
  const int64_t pos0 = a.seq_lens[it.seq] - qlen + it.row0;
  for (int64_t hh = 0; hh < nkv; ++hh)
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t gh = 0; gh < G; ++gh) {
        const float* src = a.q + (qrow0 + r) * a.q_stride + ((it.kv0 + hh) * G + gh) * D;
        float* dst = sc.q + ((hh * nrows + r) * G + gh) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
      }
  reset_rows(sc.fm, sc.fl, sc.fo, M, D);
  reset_rows(sc.m, sc.l, sc.o, M, D);
  const int32_t* bt = a.block_tables + (int64_t)it.seq * a.max_blocks;
  const int64_t nctx = pos0 + nrows;
  if (nrows == 1) {  // decode: read each tile's cache rows in address order
    sc.ensure_decode(M);
    if (it.seg >= 0) {
      const int64_t t_end = std::min(nctx, (it.seg + 1) * kSegment);
      decode_tiles<DC, C>(a, bt, it.seg * kSegment, t_end, t_end, pos0, it.kv0, nkv, G, sc);
      for (int64_t m = 0; m < M; ++m)
        std::copy(sc.o + m * D, sc.o + (m + 1) * D, segment_record(a, it, G, m, sc));
      return;
    }
    for (int64_t t = 0; t < nctx; t += kSegment) {  // as many as num_segments(nctx)
      decode_tiles<DC, C>(a, bt, t, std::min(nctx, t + kSegment), nctx, pos0, it.kv0, nkv, G,
                          sc);
      close_segments(sc, 0, M, D);
    }
  } else {
    prefill_tiles<DC, C>(a, bt, pos0, nrows, it.kv0, nkv, G, sc);
    close_segments(sc, 0, M, D);
  }
  for (int64_t hh = 0; hh < nkv; ++hh)
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t gh = 0; gh < G; ++gh) {
        const int64_t m = (hh * nrows + r) * G + gh;
        const float inv = 1.0f / sc.fl[m];
        float* dst = a.out + (qrow0 + r) * a.out_stride + ((it.kv0 + hh) * G + gh) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = sc.fo[m * D + d] * inv;
      }
}

template <int NC, class C>
void process_item(const AttnArgs& a, const Item& it, Scratch<C>& sc) {
  if (NC > 0 && a.D == 16 * NC) item_rows<16 * NC, C>(a, it, sc);
  else item_rows<0, C>(a, it, sc);
}

#endif

template <class C>
using ItemFn = void (*)(const AttnArgs&, const Item&, Scratch<C>&);

template <class C>
ItemFn<C> pick_item_fn(int64_t D) {
  switch ((D + 15) / 16) {
    case 1: return process_item<1, C>;
    case 2: return process_item<2, C>;
    case 3: return process_item<3, C>;
    case 4: return process_item<4, C>;
    case 5: return process_item<5, C>;
    case 6: return process_item<6, C>;
    case 7: return process_item<7, C>;
    case 8: return process_item<8, C>;
    default: return process_item<0, C>;
  }
}

template <class C>
struct AttnTaskCtx {
  const AttnArgs* a;
  const Item* items;
  ItemFn<C> fn;
  std::atomic<bool> out_of_memory{false};  // an item could not grow its scratch buffers
};

// Items run on the pool's helper threads too, where an exception would end the process: an
// item that cannot allocate is recorded, and run_attention throws on the calling thread.
template <class C>
void attn_task(void* p, int64_t i) {
  static thread_local Scratch<C> sc;
  AttnTaskCtx<C>& c = *static_cast<AttnTaskCtx<C>*>(p);
  try {
    c.fn(*c.a, c.items[i], sc);
  } catch (const std::bad_alloc&) {
    c.out_of_memory.store(true, std::memory_order_relaxed);
  }
}

// SegmentSplit's last step: each split decode row's segment records folded in order and
// written out, as item_rows does with the segments it sums itself (the same bits).
void fold_split_segments(const AttnArgs& a, const std::vector<int32_t>& first_rec) {
  const int64_t D = a.D, rec_len = D + 2;
  thread_local AlignedBuf acc_buf;
  float* of = acc_buf.get((size_t)D);
  for (int64_t s = 0; s < a.S; ++s) {
    if (first_rec[s] < 0) continue;
    const int64_t rec = first_rec[s], nseg = num_segments(a.seq_lens[s]);
    for (int64_t h = 0; h < a.H; ++h) {
      float mf = -std::numeric_limits<float>::infinity(), lf = 0.f;
      std::fill(of, of + D, 0.f);
      for (int64_t k = 0; k < nseg; ++k) {
        const float* r = a.seg_out + ((rec + k) * a.H + h) * rec_len;
        fold_segment(mf, lf, of, r[0], r[1], r + 2, D);
      }
      const float inv = 1.0f / lf;
      float* dst = a.out + (int64_t)a.qsl[s] * a.out_stride + h * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = of[d] * inv;
    }
  }
}

template <class C>
void run_attention(const AttnArgs& args) {
  AttnArgs a = args;
  const int64_t G = a.H / a.KVH;
  const int64_t rows_per_item = std::max<int64_t>(1, kTargetRowsHeads / G);
  // zero query rows that belong to no sequence (padding), so the output is fully defined
  const int64_t qa = a.S > 0 ? a.qsl[0] : a.T, qz = a.S > 0 ? a.qsl[a.S] : a.T;
  for (int64_t t = 0; t < a.T; ++t)
    if (t < qa || t >= qz) std::memset(a.out + t * a.out_stride, 0, sizeof(float) * a.H * a.D);

  // Work items. All kv heads of a (sequence, row block) go in one item when there are enough
  // row blocks to keep the threads busy: the item then reads whole contiguous cache rows (all
  // heads of a slot), which streams from memory far better than one head's strided slice.
  // Otherwise the kv heads are split into groups until there are about 4 items per thread
  // (prefill chunks: their items are arithmetic, and many balance better), or for a batch of
  // decode rows only, one per thread: those items read each byte once, and a slice of a row
  // streams slower than the row (cache on huge pages, ctx 256, 12 of 12 kv heads: B=2 87 ->
  // 50 us a layer, B=4 185 -> 95, B=1 50 -> 42 in bfloat16; float32 alike, AMD Zen 4).
  const int nt = num_threads();
  int64_t nrb = 0, max_qlen = 0;
  std::vector<int64_t> seq_cost((size_t)a.S);
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t qlen = a.qsl[s + 1] - a.qsl[s];
    nrb += (qlen + rows_per_item - 1) / rows_per_item;
    max_qlen = std::max(max_qlen, qlen);
    seq_cost[s] = qlen * (int64_t)a.seq_lens[s];
  }
  // SegmentSplit (see kSegment): a decode batch of fewer sequences than
  // threads gives each segment of a context longer than one segment an item of its own, with
  // all kv heads (whole cache rows), and folds the segments once the items ran
  // (fold_split_segments). Per layer call at ctx 256, in step, B=1, AMD Zen 3: bfloat16 cache
  // 138 -> 93 us, float32 223 -> 149 us (bench_attention_kernel.py --before 8a88963 --in-step;
  // docs/benchmarks.md). AMD Zen 4, the AVX-512 path: float32 -7 to -8%, bfloat16 -11 to -31%,
  // float16 -6 to -11%; B >= 16 within 1-4% (the folds; two compiles of one source differ as
  // much), a 512-token prefill +2 to +7%.
  std::vector<int32_t> first_rec;  // a split sequence's first segment record, else -1
  int64_t nsegs = 0, units = nrb;  // segment records; items before any kv head split
  if (nt > 1 && max_qlen <= 1 && nrb < nt) {
    first_rec.assign((size_t)a.S, -1);
    for (int64_t s = 0; s < a.S; ++s) {
      const int64_t nseg = num_segments(a.seq_lens[s]);
      if (a.qsl[s + 1] > a.qsl[s] && nseg > 1) {
        first_rec[s] = (int32_t)nsegs;
        nsegs += nseg;
        units += nseg - 1;
      }
    }
  }
  const int64_t target = (max_qlen <= 1 ? 1 : 4) * (int64_t)nt;
  const int64_t splits = nt > 1 ? std::min<int64_t>(a.KVH, std::max<int64_t>(1, (target + units - 1) / std::max<int64_t>(units, 1))) : 1;
  const int64_t hpi = (a.KVH + splits - 1) / splits;  // kv heads per item
  static thread_local AlignedBuf seg_buf;
  if (nsegs) a.seg_out = seg_buf.get((size_t)(nsegs * a.H * (a.D + 2)));

  // most expensive sequences first (dynamic scheduling then balances the tail)
  std::vector<int32_t> order((size_t)a.S);
  for (int64_t s = 0; s < a.S; ++s) order[s] = (int32_t)s;
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return seq_cost[x] > seq_cost[y]; });
  std::vector<Item> items;
  items.reserve((size_t)(units * ((a.KVH + hpi - 1) / hpi) + 1));
  int64_t total = 0;
  for (int32_t s : order) {
    const int64_t qlen = a.qsl[s + 1] - a.qsl[s];
    if (qlen <= 0) continue;
    if (nsegs && first_rec[s] >= 0) {  // SegmentSplit
      const int64_t nseg = num_segments(a.seq_lens[s]);
      for (int64_t k = 0; k < nseg; ++k)
        for (int64_t g = 0; g < a.KVH; g += hpi) {
          const int64_t nkv = std::min(hpi, a.KVH - g);
          const int64_t cost =
              G * nkv * (std::min<int64_t>(a.seq_lens[s], (k + 1) * kSegment) - k * kSegment);
          items.push_back(Item{s, 0, 1, (int32_t)g, (int32_t)nkv, cost, (int32_t)k,
                               first_rec[s] + (int32_t)k});
          total += cost;
        }
      continue;
    }
    const int64_t ctx0 = a.seq_lens[s] - qlen;
    const int64_t nblocks = (qlen + rows_per_item - 1) / rows_per_item;
    for (int64_t b = nblocks - 1; b >= 0; --b) {  // later rows see more context: first
      const int64_t r0 = b * rows_per_item;
      const int64_t nr = std::min(rows_per_item, qlen - r0);
      for (int64_t g = 0; g < a.KVH; g += hpi) {
        const int64_t nkv = std::min(hpi, a.KVH - g);
        const int64_t cost = nr * G * nkv * (ctx0 + r0 + nr);
        items.push_back(Item{s, (int32_t)r0, (int32_t)nr, (int32_t)g, (int32_t)nkv, cost});
        total += cost;
      }
    }
  }
  AttnTaskCtx<C> ctx{&a, items.data(), pick_item_fn<C>(a.D)};
  const int64_t nitems = (int64_t)items.size();
  const bool par = nt > 1 && nitems > 1 && total * ((a.D + 15) / 16) >= g_parallel_min_work;
  parallel_for(attn_task<C>, &ctx, nitems, par);
  if (ctx.out_of_memory.load(std::memory_order_relaxed)) throw std::bad_alloc();
  if (nsegs) fold_split_segments(a, first_rec);
}

// run_attention's buffers (work items, segment records, scratch) are allocated per call: one
// that fails is this call's error, not an exception through the extern "C" entry points,
// which would end the process.
template <class C>
int run_attention_or_error(const AttnArgs& a) {
  try {
    run_attention<C>(a);
  } catch (const std::bad_alloc&) {
    return set_error(-5, "attention: out of memory for the kernel's work buffers");
  }
  return 0;
}

}  // namespace

// =============================================================================================
extern "C" {

int lls_abi_version() { return 3; }

int lls_has_avx512() { return LLS_AVX512; }

const char* lls_last_error() { return g_err; }

void lls_set_num_threads(int n) { g_num_threads = n; }

int lls_get_num_threads() { return num_threads(); }

// The kernels' thread pool, shared with the other C++ kernel libraries (the layer ops register
// this function): fn(ctx, i) for i in [0, n), on the caller and the pool's helpers when
// `parallel` is non-zero. One pool for all our kernels, so they never compete for the cores.
// linger_us > 0: the caller expects another job within about that long, so idle helpers keep
// spinning that long after this job instead of going to sleep (waking one costs tens of us).
void lls_parallel_for(TaskFn fn, void* ctx, int64_t n, int parallel, int64_t linger_us) {
  parallel_for(fn, ctx, n, parallel != 0, linger_us * 1000);
}

// Attention runs serially below this much work (sum over items of rows*heads*context*ceil(D/16)).
void lls_set_parallel_threshold(int64_t work) { g_parallel_min_work = work; }

}  // extern "C"

namespace {

template <class C>
int reshape_and_cache_impl(const float* key, int64_t key_stride, const float* value,
                           int64_t value_stride, C* k_cache, C* v_cache,
                           const int32_t* slot_mapping, int64_t T, int64_t KVH, int64_t D,
                           int64_t num_slots) {
  if (T < 0 || KVH <= 0 || D <= 0) return set_error(-1, "bad shapes for reshape_and_cache");
  if (int rc = validate_slots(slot_mapping, T, num_slots)) return rc;
  do_reshape_and_cache<C>(key, key_stride, value, value_stride, k_cache, v_cache, slot_mapping,
                          T, KVH * D);
  return 0;
}

template <class C>
int paged_attention_impl(const float* q, int64_t q_stride, const C* k_cache, const C* v_cache,
                         const int32_t* block_tables, int64_t max_blocks,
                         const int32_t* query_start_loc, const int32_t* seq_lens, int64_t S,
                         int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                         int64_t num_blocks, float scale, float* out, int64_t out_stride,
                         const float* alibi) {
  AttnArgs a{q, q_stride, k_cache, v_cache, block_tables, max_blocks, query_start_loc, seq_lens,
             S, T, H, KVH, D, block_size, num_blocks, scale, out, out_stride, nullptr, alibi};
  if (int rc = validate_attention(a)) return rc;
  return run_attention_or_error<C>(a);
}

template <class C>
int attention_fused_impl(const float* q, int64_t q_stride, const float* key, int64_t key_stride,
                         const float* value, int64_t value_stride, C* k_cache, C* v_cache,
                         const int32_t* slot_mapping, int64_t T_kv, const int32_t* block_tables,
                         int64_t max_blocks, const int32_t* query_start_loc,
                         const int32_t* seq_lens, int64_t S, int64_t T, int64_t H, int64_t KVH,
                         int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                         float* out, int64_t out_stride, const float* alibi) {
  AttnArgs a{q, q_stride, k_cache, v_cache, block_tables, max_blocks, query_start_loc, seq_lens,
             S, T, H, KVH, D, block_size, num_blocks, scale, out, out_stride, nullptr, alibi};
  if (int rc = validate_attention(a)) return rc;
  if (int rc = validate_slots(slot_mapping, T_kv, num_blocks * block_size)) return rc;
  do_reshape_and_cache<C>(key, key_stride, value, value_stride, k_cache, v_cache, slot_mapping,
                          T_kv, KVH * D);
  return run_attention_or_error<C>(a);
}

}  // namespace

extern "C" {

#define LLS_CACHE_ENTRY_POINTS(SUFFIX, C)                                                      \
  int lls_reshape_and_cache##SUFFIX(const float* key, int64_t key_stride, const float* value, \
                                    int64_t value_stride, C* k_cache, C* v_cache,             \
                                    const int32_t* slot_mapping, int64_t T, int64_t KVH,      \
                                    int64_t D, int64_t num_slots) {                           \
    return reshape_and_cache_impl<C>(key, key_stride, value, value_stride, k_cache, v_cache,  \
                                     slot_mapping, T, KVH, D, num_slots);                     \
  }                                                                                           \
  int lls_paged_attention##SUFFIX(const float* q, int64_t q_stride, const C* k_cache,         \
                                  const C* v_cache, const int32_t* block_tables,              \
                                  int64_t max_blocks, const int32_t* query_start_loc,         \
                                  const int32_t* seq_lens, int64_t S, int64_t T, int64_t H,   \
                                  int64_t KVH, int64_t D, int64_t block_size,                 \
                                  int64_t num_blocks, float scale, float* out,                \
                                  int64_t out_stride, const float* alibi) {                   \
    return paged_attention_impl<C>(q, q_stride, k_cache, v_cache, block_tables, max_blocks,   \
                                   query_start_loc, seq_lens, S, T, H, KVH, D, block_size,    \
                                   num_blocks, scale, out, out_stride, alibi);                \
  }                                                                                           \
  int lls_attention_fused##SUFFIX(                                                            \
      const float* q, int64_t q_stride, const float* key, int64_t key_stride,                 \
      const float* value, int64_t value_stride, C* k_cache, C* v_cache,                       \
      const int32_t* slot_mapping, int64_t T_kv, const int32_t* block_tables,                 \
      int64_t max_blocks, const int32_t* query_start_loc, const int32_t* seq_lens, int64_t S, \
      int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t num_blocks,   \
      float scale, float* out, int64_t out_stride, const float* alibi) {                      \
    return attention_fused_impl<C>(q, q_stride, key, key_stride, value, value_stride,         \
                                   k_cache, v_cache, slot_mapping, T_kv, block_tables,        \
                                   max_blocks, query_start_loc, seq_lens, S, T, H, KVH, D,    \
                                   block_size, num_blocks, scale, out, out_stride, alibi);    \
  }

LLS_CACHE_ENTRY_POINTS(, float)
LLS_CACHE_ENTRY_POINTS(_bf16, bf16_t)
LLS_CACHE_ENTRY_POINTS(_f16, f16_t)
LLS_CACHE_ENTRY_POINTS(_f8e4m3, f8e4m3_t)
LLS_CACHE_ENTRY_POINTS(_f8e5m2, f8e5m2_t)

// ---------------------------------------------------------------------------------------------
// MindSpore CPU aot entry points:
//   int f(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
//         void* stream, void* extra)
// params = inputs followed by the output.

static int check_dtype(const char** dtypes, int i, const char* want, const char* name) {
  if (std::strcmp(dtypes[i], want) != 0)
    return set_error(-4, "%s must be %s, got %s", name, want, dtypes[i]);
  return 0;
}

static int64_t numel(int nd, const int64_t* sh, int from) {
  int64_t n = 1;
  for (int i = from; i < nd; ++i) n *= sh[i];
  return n;
}

// inputs: q [T, H*D] (or [T, H, D]), key [T, KVH*D], value [T, KVH*D],
//         k_cache [NB, BS, KVH, D], v_cache (same), slot_mapping int32 [T],
//         block_tables int32 [S, MB], query_start_loc int32 [S+1], seq_lens int32 [S],
//         scale float32 [1]
// output: out [T, H*D] (same shape as q)
int lls_aot_attention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                      void* stream, void* extra) {
  (void)stream; (void)extra;
  if (nparam != 11) return set_error(-4, "lls_aot_attention expects 10 inputs and 1 output");
  static const char* names[] = {"q", "key", "value", "k_cache", "v_cache", "slot_mapping",
                                "block_tables", "query_start_loc", "seq_lens", "scale", "out"};
  static const char* kinds[] = {"float32", "float32", "float32", "float32", "float32", "int32",
                                "int32", "int32", "int32", "float32", "float32"};
  for (int i = 0; i < 11; ++i)
    if (int rc = check_dtype(dtypes, i, kinds[i], names[i])) return rc;
  if (ndims[3] != 4 || ndims[4] != 4 || ndims[6] != 2)
    return set_error(-4, "caches must be 4-D and block_tables 2-D");
  const int64_t NB = shapes[3][0], BS = shapes[3][1], KVH = shapes[3][2], D = shapes[3][3];
  const int64_t T = shapes[0][0];
  const int64_t H = numel(ndims[0], shapes[0], 1) / D;
  const int64_t S = shapes[8][0];
  const int64_t Tkv = shapes[5][0];
  if (H * D != numel(ndims[0], shapes[0], 1) || shapes[7][0] != S + 1 || shapes[6][0] != S ||
      numel(ndims[1], shapes[1], 1) != KVH * D || numel(ndims[2], shapes[2], 1) != KVH * D ||
      shapes[1][0] != Tkv || shapes[2][0] != Tkv)
    return set_error(-4, "inconsistent shapes for lls_aot_attention");
  const float scale = *static_cast<const float*>(params[9]);
  return lls_attention_fused(
      static_cast<const float*>(params[0]), H * D, static_cast<const float*>(params[1]), KVH * D,
      static_cast<const float*>(params[2]), KVH * D, static_cast<float*>(params[3]),
      static_cast<float*>(params[4]), static_cast<const int32_t*>(params[5]), Tkv,
      static_cast<const int32_t*>(params[6]), shapes[6][1], static_cast<const int32_t*>(params[7]),
      static_cast<const int32_t*>(params[8]), S, T, H, KVH, D, BS, NB, scale,
      static_cast<float*>(params[10]), H * D, nullptr);
}

// inputs: q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale; output: out
int lls_aot_paged_attention(int nparam, void** params, int* ndims, int64_t** shapes,
                            const char** dtypes, void* stream, void* extra) {
  (void)stream; (void)extra;
  if (nparam != 8) return set_error(-4, "lls_aot_paged_attention expects 7 inputs and 1 output");
  static const char* kinds[] = {"float32", "float32", "float32", "int32",
                                "int32",   "int32",   "float32", "float32"};
  for (int i = 0; i < 8; ++i)
    if (int rc = check_dtype(dtypes, i, kinds[i], "input")) return rc;
  if (ndims[1] != 4 || ndims[3] != 2) return set_error(-4, "caches must be 4-D");
  const int64_t NB = shapes[1][0], BS = shapes[1][1], KVH = shapes[1][2], D = shapes[1][3];
  const int64_t T = shapes[0][0], H = numel(ndims[0], shapes[0], 1) / D, S = shapes[5][0];
  return lls_paged_attention(
      static_cast<const float*>(params[0]), H * D, static_cast<const float*>(params[1]),
      static_cast<const float*>(params[2]), static_cast<const int32_t*>(params[3]), shapes[3][1],
      static_cast<const int32_t*>(params[4]), static_cast<const int32_t*>(params[5]), S, T, H, KVH,
      D, BS, NB, *static_cast<const float*>(params[6]), static_cast<float*>(params[7]), H * D,
      nullptr);
}

}  // extern "C"
