// The small per-layer operations of a decoder block as single C++ calls (AVX-512), built with the other kernels.
//
// At one token per forward, a Qwen2.5-1.5B layer spends more time dispatching its small PyTorch ops than
// computing them: RMSNorm is pow, mean, add, rsqrt, mul, mul and two casts; rotary embedding is slices, neg,
// cat, two muls, an add and a transpose, for q and for k. Each function here is one call and row-local: a row's result depends only on that row, in a fixed order, so a k-token
// forward still reproduces one-token decoding bit for bit.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;

inline __mmask16 tail_mask(int64_t left) {
  return static_cast<__mmask16>(left >= kLanes ? 0xFFFF : (1u << left) - 1u);
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() >= 1, what,
              " must be contiguous fp32");
}

}  // namespace

// Called from Python through the ops below, and by the fused decoder block (cpu_block.cpp) directly.
namespace mirrorsd {

// y = weight * x / sqrt(mean(x^2) + eps), per row of the last dimension.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  check_rows(weight, "rms_norm: weight");
  const int64_t K = x.size(-1), M = x.numel() / K;
  TORCH_CHECK(weight.numel() == K, "rms_norm: weight must have ", K, " elements");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += kLanes) {
      const __m512 v = _mm512_maskz_loadu_ps(tail_mask(K - k), row + k);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(K) + static_cast<float>(eps));
    const __m512 invv = _mm512_set1_ps(inv);
    for (int64_t k = 0; k < K; k += kLanes) {
      const __mmask16 mask = tail_mask(K - k);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + k), invv);
      _mm512_mask_storeu_ps(yp + m * K + k, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, wp + k), v));
    }
  }
  return y;
}

// Rotary embedding of x [rows, T, heads, dim] (NeoX halves) with cos/sin [rows or 1, T, dim]; returns
// [rows, heads, T, dim], the layout attention reads.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_rows(x, "rope: x");
  check_rows(cos, "rope: cos");
  check_rows(sin, "rope: sin");
  TORCH_CHECK(x.dim() == 4, "rope: x must be [rows, T, heads, dim]");
  const int64_t R = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 3 && cos.sizes() == sin.sizes() && (cos.size(0) == 1 || cos.size(0) == R) &&
              cos.size(1) == T && cos.size(2) == D, "rope: cos/sin must be [rows or 1, T, dim]");
  auto y = torch::empty({R, H, T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t angle_rows = cos.size(0) == 1 ? 0 : T * D;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cp + r * angle_rows + t * D;
      const float* s = sp + r * angle_rows + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* in = xp + ((r * T + t) * H + h) * D;
        float* out = yp + ((r * H + h) * T + t) * D;
        for (int64_t d = 0; d < half; d += kLanes) {  // out = x * cos + rotate_half(x) * sin
          const __mmask16 mask = tail_mask(half - d);
          const __m512 lo = _mm512_maskz_loadu_ps(mask, in + d), hi = _mm512_maskz_loadu_ps(mask, in + half + d);
          const __m512 lo_out = _mm512_sub_ps(_mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mask, c + d)),
                                              _mm512_mul_ps(hi, _mm512_maskz_loadu_ps(mask, s + d)));
          const __m512 hi_out = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_maskz_loadu_ps(mask, c + half + d)),
                                              _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mask, s + half + d)));
          _mm512_mask_storeu_ps(out + d, mask, lo_out);
          _mm512_mask_storeu_ps(out + half + d, mask, hi_out);
        }
      }
    }
  return y;
}

}  // namespace mirrorsd

TORCH_LIBRARY_FRAGMENT(mirrorsd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(mirrorsd, CPU, m) {
  m.impl("rms_norm", mirrorsd::rms_norm);
  m.impl("rope", mirrorsd::rope);
}
