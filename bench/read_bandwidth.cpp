// Streaming read of a large buffer with every core: the memory-bandwidth reference for the
// batch-1 decode floor (weight bytes / bandwidth).
#include <cstdint>
extern "C" double sum_f32(const float* __restrict a, int64_t n) {
  double total = 0.0;
#pragma omp parallel for reduction(+ : total) schedule(static)
  for (int64_t blk = 0; blk < n / 4096; ++blk) {
    float s[16] = {0};
    const float* p = a + blk * 4096;
    for (int64_t i = 0; i < 4096; i += 16)
#pragma omp simd
      for (int j = 0; j < 16; ++j) s[j] += p[i + j];
    for (int j = 0; j < 16; ++j) total += s[j];
  }
  return total;
}
