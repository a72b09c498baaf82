// Fused element-wise kernels for the CPU backend: RMSNorm (with fused residual add),
// rotary embedding and SiLU-and-mul. MindSpore's CPU element-wise ops cost ~60 us each in
// PyNative, more than the matmuls they sit between at decode time; these cost a few us.
// All tensors are contiguous row-major float32. Rows are split across OpenMP threads.
#include <cmath>
#include <cstdint>

extern "C" {

// out[t] = x[t] / rms(x[t]) * w
void rms_norm_f32(const float* __restrict x, const float* __restrict w, float* __restrict out,
                  int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows > 8) schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * dim;
    float* o = out + t * dim;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// residual[t] += x[t]; out[t] = rms_norm(residual[t]) * w   (residual is updated in place)
void add_rms_norm_f32(const float* __restrict x, float* __restrict residual,
                      const float* __restrict w, float* __restrict out, int64_t rows,
                      int64_t dim, float eps) {
#pragma omp parallel for if (rows > 8) schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
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
}

// Rotary embedding, "rotate half" (GPT-NeoX / HF Llama) layout, in place on q and k.
// q: [T, nq, D], k: [T, nk, D], rows q_stride / k_stride floats apart (they may be column
// slices of one fused qkv buffer); cos_sin: [max_pos, D], cos in [:D/2] and sin in [D/2:].
void rotary_embedding_f32(float* __restrict q, float* __restrict k,
                          const int32_t* __restrict positions,
                          const float* __restrict cos_sin, int64_t tokens, int64_t nq,
                          int64_t nk, int64_t head_dim, int64_t q_stride, int64_t k_stride) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens > 8) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cs = cos_sin + (int64_t)positions[t] * head_dim;
    const float* c = cs;
    const float* s = cs + half;
    for (int64_t h = 0; h < nq + nk; ++h) {
      float* v = h < nq ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - nq) * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

// out[t, i] = silu(x[t, i]) * x[t, F + i], x: [T, 2F]
void silu_and_mul_f32(const float* __restrict x, float* __restrict out, int64_t rows,
                      int64_t f) {
#pragma omp parallel for if (rows > 4) schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = x + t * 2 * f;
    const float* u = g + f;
    float* o = out + t * f;
#pragma omp simd
    for (int64_t i = 0; i < f; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

}  // extern "C"
