// The small per-layer operations of a decoder block as single C++ calls (AVX-512), built with the other kernels.
//
// At one token per forward, a Qwen2.5-1.5B layer spends more time dispatching its small PyTorch ops than
// computing them: RMSNorm is pow, mean, add, rsqrt, mul, mul and two casts; rotary embedding is slices, neg,
// cat, two muls, an add and a transpose, for q and for k. Each function here is one call and row-local (a row's
// result depends only on that row, in a fixed order), so a k-token forward still reproduces one-token decoding bit
// for bit. SiLU is here too, with our own exp, so that the fused block (cpu_block.cpp) and the Python path share it.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cpu_kernels.h"

#include <algorithm>
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

void rms_norm_rows(const float* x, const float* weight, float* y, int64_t M, int64_t K, double eps) {
  parallel_rows(M, std::max<int64_t>(1, kParallelGrain / K), [=](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
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
        _mm512_mask_storeu_ps(y + m * K + k, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, weight + k), v));
      }
    }
  });
}

void rope_rows(const float* x, int64_t R, int64_t T, int64_t H, int64_t D, const float* cos, const float* sin,
               bool shared, Heads out) {
  const int64_t half = D / 2, angle_rows = shared ? 0 : T * D;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cos + r * angle_rows + t * D;
      const float* s = sin + r * angle_rows + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* in = x + ((r * T + t) * H + h) * D;
        float* o = out.data + r * out.row + h * out.head + t * out.pos;
        for (int64_t d = 0; d < half; d += kLanes) {  // out = x * cos + rotate_half(x) * sin
          const __mmask16 mask = tail_mask(half - d);
          const __m512 lo = _mm512_maskz_loadu_ps(mask, in + d), hi = _mm512_maskz_loadu_ps(mask, in + half + d);
          const __m512 lo_out = _mm512_sub_ps(_mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mask, c + d)),
                                              _mm512_mul_ps(hi, _mm512_maskz_loadu_ps(mask, s + d)));
          const __m512 hi_out = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_maskz_loadu_ps(mask, c + half + d)),
                                              _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mask, s + half + d)));
          _mm512_mask_storeu_ps(o + d, mask, lo_out);
          _mm512_mask_storeu_ps(o + half + d, mask, hi_out);
        }
      }
    }
}

void silu_mul_rows(const float* gate, const float* up, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  parallel_rows((n + kLanes - 1) / kLanes, kParallelGrain / kLanes, [=](int64_t begin, int64_t end) {
    for (int64_t i = begin * kLanes; i < std::min(end * kLanes, n); i += kLanes) {
      const __mmask16 mask = tail_mask(n - i);
      const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
      const __m512 denominator = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
      _mm512_mask_storeu_ps(y + i, mask, _mm512_div_ps(_mm512_mul_ps(g, _mm512_maskz_loadu_ps(mask, up + i)),
                                                       denominator));
    }
  });
}

void add_into(float* x, const float* delta, int64_t n) {
  parallel_rows((n + kLanes - 1) / kLanes, kParallelGrain / kLanes, [=](int64_t begin, int64_t end) {
    for (int64_t i = begin * kLanes; i < std::min(end * kLanes, n); i += kLanes) {
      const __mmask16 mask = tail_mask(n - i);
      _mm512_mask_storeu_ps(x + i, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, x + i),
                                                       _mm512_maskz_loadu_ps(mask, delta + i)));
    }
  });
}

namespace {

// Sixteen dot products of length n (lane L: row L of `rows`, rows past `count` left out) against `v`, masked tail.
inline __m512 dots16(const float* rows, int64_t stride, int64_t count, const float* v, int64_t n) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 vv = _mm512_maskz_loadu_ps(mask, v + i);
    for (int64_t j = 0; j < count; ++j)
      acc[kSlot[j]] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, rows + j * stride + i), vv, acc[kSlot[j]]);
  }
  return sum16(acc);
}

}  // namespace

void lora_delta_rows(const float* x, int64_t s, int64_t K, const float* A, int64_t r, const float* Bt, int64_t N,
                     float scale, float* out, float* u) {
  constexpr int64_t kGrainMacs = 262144;  // ~25 us on one core: below it a parallel region costs more than it saves
  parallel_rows(s, std::max<int64_t>(1, kGrainMacs / (K * r)), [=](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)  // u = x A^T
      for (int64_t j = 0; j < r; j += kLanes)
        _mm512_mask_storeu_ps(u + row * r + j, tail_mask(r - j),
                              dots16(A + j * K, K, std::min(kLanes, r - j), x + row * K, K));
  });
  constexpr int64_t kRows = 8;  // rows sharing each load of Bt (their accumulators stay in registers)
  const __m512 sv = _mm512_set1_ps(scale);
  const int64_t blocks = (N + kLanes - 1) / kLanes;
  parallel_rows(blocks, std::max<int64_t>(1, kGrainMacs / (kLanes * r * s)), [=](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < s; first += kRows) {
      const int64_t rows = std::min(kRows, s - first);
      for (int64_t n = begin * kLanes; n < std::min(N, end * kLanes); n += kLanes) {  // out = (u Bt) * scale
        const __mmask16 mask = tail_mask(N - n);
        __m512 acc[kRows];
        for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < r; ++j) {
          const __m512 b = _mm512_maskz_loadu_ps(mask, Bt + j * N + n);
          for (int64_t i = 0; i < rows; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(u[(first + i) * r + j]), b, acc[i]);
        }
        for (int64_t i = 0; i < rows; ++i)
          _mm512_mask_storeu_ps(out + (first + i) * N + n, mask, _mm512_mul_ps(acc[i], sv));
      }
    }
  });
}

}  // namespace mirrorsd

namespace {

// ((x A^T) B^T) * scale over x's last dimension, given B^T: the stream adapters' delta as the C++ blocks add it
// (mirrorsd.decoding.streams.adapters uses it outside training, so the Python blocks give the same bits).
torch::Tensor lora_delta(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt, double scale) {
  check_rows(x, "lora_delta: x");
  check_rows(a, "lora_delta: a");
  check_rows(bt, "lora_delta: bt");
  const int64_t K = x.size(-1), r = a.size(0), N = bt.size(-1);
  TORCH_CHECK(a.dim() == 2 && a.size(1) == K && bt.dim() == 2 && bt.size(0) == r,
              "lora_delta: a must be [rank, ", K, "] and bt [rank, out]");
  TORCH_CHECK(K > 0 && r > 0, "lora_delta: features and rank must be positive");  // (they divide the grain)
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const int64_t s = x.numel() / K;
  if (s == 0) return y;
  std::vector<float> u(s * r);
  mirrorsd::lora_delta_rows(x.data_ptr<float>(), s, K, a.data_ptr<float>(), r, bt.data_ptr<float>(), N,
                            static_cast<float>(scale), y.data_ptr<float>(), u.data());
  return y;
}

// y = weight * x / sqrt(mean(x^2) + eps), per row of the last dimension.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  check_rows(weight, "rms_norm: weight");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0, "rms_norm: rows must not be empty");  // (K divides the grain)
  const int64_t M = x.numel() / K;
  TORCH_CHECK(weight.numel() == K, "rms_norm: weight must have ", K, " elements");
  auto y = torch::empty_like(x);
  mirrorsd::rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), M, K, eps);
  return y;
}

// Rotary embedding of x [rows, T, heads, dim] (NeoX halves) with cos/sin [rows or 1, T, dim]; returns
// [rows, heads, T, dim], the layout attention reads.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_rows(x, "rope: x");
  check_rows(cos, "rope: cos");
  check_rows(sin, "rope: sin");
  TORCH_CHECK(x.dim() == 4, "rope: x must be [rows, T, heads, dim]");
  const int64_t R = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 3 && cos.sizes() == sin.sizes() && (cos.size(0) == 1 || cos.size(0) == R) &&
              cos.size(1) == T && cos.size(2) == D, "rope: cos/sin must be [rows or 1, T, dim]");
  auto y = torch::empty({R, H, T, D}, x.options());
  mirrorsd::rope_rows(x.data_ptr<float>(), R, T, H, D, cos.data_ptr<float>(), sin.data_ptr<float>(),
                      cos.size(0) == 1, mirrorsd::Heads{y.data_ptr<float>(), H * T * D, T * D, D});
  return y;
}

// silu(gate) * up, elementwise (the MLP's activation): one call, and the same bits as the fused block's.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up must have the same shape");
  const torch::Tensor g = gate.contiguous(), u = up.contiguous();
  check_rows(g, "silu_mul: gate");
  check_rows(u, "silu_mul: up");
  auto y = torch::empty_like(g);
  mirrorsd::silu_mul_rows(g.data_ptr<float>(), u.data_ptr<float>(), y.data_ptr<float>(), g.numel());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mirrorsd, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("lora_delta(Tensor x, Tensor a, Tensor bt, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mirrorsd, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rope", rope);
  m.impl("silu_mul", silu_mul);
  m.impl("lora_delta", lora_delta);
}
