// Single-core issue rate of VDPBF16PS (zmm) against FMA (zmm), in GFLOP/s, registers only:
// whether the bf16 dot-product kernel (lls_linear_bf16_dot) can beat the widening one here.
// 24 independent accumulator chains, enough to hide either instruction's latency. Returns 0
// where the build has no AVX512-BF16 (or no AVX-512).
#include <chrono>
#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {
template <class F>
double gflops(int64_t n, double flops_per_op, F op) {
  __m512 acc[24];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n / 24; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = op(acc[i]);
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
  volatile float keep = sink;
  (void)keep;
  return n * flops_per_op / dt / 1e9;
}
}  // namespace

extern "C" double dpbf16_gflops(int64_t n) {
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1, 1)
  return gflops(n, 64.0, [a](__m512 acc) { return _mm512_dpbf16_ps(acc, a, a); });
}

extern "C" double fma_gflops(int64_t n) {
  const __m512 a = _mm512_set1_ps(1e-9f), b = _mm512_set1_ps(1.0f);
  return gflops(n, 32.0, [a, b](__m512 acc) { return _mm512_fmadd_ps(a, b, acc); });
}
#else
extern "C" double dpbf16_gflops(int64_t) { return 0.0; }
extern "C" double fma_gflops(int64_t) { return 0.0; }
#endif
