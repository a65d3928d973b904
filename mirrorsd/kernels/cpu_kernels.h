// The kernels one C++ file calls in another, on raw pointers: the fused decoder block (cpu_block.cpp) runs the very
// functions the Python ops wrap, so both paths give the same bits, and a one-token block makes no tensor at all.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#if !defined(__AVX512F__)
#include "cpu_avx2.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <vector>

namespace mirrorsd {

// A packed quantized weight, checked (check_weight): raw pointers into its tensors, valid for one call (a storage
// can move under a tensor, e.g. share_memory_()).
struct QuantWeight {
  int64_t K = 0, N = 0, bits = 0, group = 0, blocks = 0, per_super = 1;
  bool two_level = false;
  const uint8_t* codes = nullptr;
  const uint64_t* planes = nullptr;
  const char* scales = nullptr;
  const char* offsets = nullptr;  // nullptr: symmetric, W = scale * (code - zero)
  const uint16_t* super_scales = nullptr;
  const uint16_t* super_offsets = nullptr;
  const float* bias = nullptr;
  const float* f32 = nullptr;  // bits == 32: fp32 weights packed [N/16, K, 16] (mirrorsd.kernels.pack_f32), no codes
  int64_t zero = 0;
  int64_t code_block = 0, plane_block = 0, scale_block = 0, super_block = 0;  // per 16-output block (scale: bytes)
};

QuantWeight check_weight(int64_t K, const torch::Tensor& codes, const std::optional<torch::Tensor>& planes,
                         const torch::Tensor& scales, const std::optional<torch::Tensor>& offsets,
                         const std::optional<torch::Tensor>& super_scales,
                         const std::optional<torch::Tensor>& super_offsets, const std::optional<torch::Tensor>& bias,
                         int64_t N, int64_t bits, int64_t group, int64_t zero);
QuantWeight check_f32_weight(int64_t K, const torch::Tensor& packed, const std::optional<torch::Tensor>& bias, int64_t N);

// Memory a thread reuses from call to call, so a one-token forward allocates nothing: take() hands out 64-byte
// aligned pieces and rewind() frees them all at once. Pieces never move (a full chunk is followed by another), so a
// pointer stays valid until the next rewind.
class Scratch {
 public:
  template <typename T>
  T* take(int64_t count) {
    const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + 63) & ~size_t{63};
    while (chunk_ < chunks_.size() && used_ + bytes > chunks_[chunk_].size) {
      ++chunk_;
      used_ = 0;
    }
    if (chunk_ == chunks_.size()) {
      const size_t size = std::max(bytes, kMinChunk);
      void* data = std::aligned_alloc(64, size);
      TORCH_CHECK(data, "out of memory: ", size, " bytes of kernel scratch");
      chunks_.push_back(Chunk{std::unique_ptr<char, Free>(static_cast<char*>(data)), size});
      used_ = 0;
    }
    char* piece = chunks_[chunk_].data.get() + used_;
    used_ += bytes;
    return reinterpret_cast<T*>(piece);
  }
  void rewind() {
    chunk_ = 0;
    used_ = 0;
  }

 private:
  static constexpr size_t kMinChunk = size_t{1} << 20;
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  struct Chunk {
    std::unique_ptr<char, Free> data;
    size_t size;
  };
  std::vector<Chunk> chunks_;
  size_t chunk_ = 0, used_ = 0;
};

// Elementwise and row-local loops split over threads from this many elements (ATen's grain): a prompt's rows share
// the cores, a decoding step's few rows run on the calling thread. Row-local, so the bits never change.
constexpr int64_t kParallelGrain = 32768;

// f(begin, end) over [0, n), split over threads only above `grain` items. Below it f runs directly: at::parallel_for's
// own inline path costs ~0.5 us of bookkeeping a call, and a one-token forward makes ~9 such calls a layer.
template <typename F>
inline void parallel_rows(int64_t n, int64_t grain, const F& f) {
  if (n > grain)
    at::parallel_for(0, n, grain, f);
  else if (n > 0)
    f(0, n);
}

// x [M, K] (contiguous) times `count` weights that read it (q/k/v; gate/up) into outs[i] [M, weights[i].N]: the
// activations are quantized once and one parallel region covers every weight's blocks. Each output is computed
// exactly as a call of its own computes it, row by row (a row's bits do not depend on the others). The weights are
// all quantized or all fp32 (bits == 32: no activation quantization, `split` ignored).
constexpr int64_t kMaxSharedWeights = 4;
void linear_into(const float* x, int64_t M, int64_t K, const QuantWeight* weights, int64_t count,
                       float* const* outs, bool split);

// y [M, K] = weight * x / sqrt(mean(x^2) + eps) per row; y may be x.
void rms_norm_rows(const float* x, const float* weight, float* y, int64_t M, int64_t K, double eps);

// A [rows, heads, positions, dim] array with dim contiguous: its base and strides (in floats).
struct Heads {
  float* data;
  int64_t row, head, pos;
};

// Rotary embedding (NeoX halves) of x [R, T, H, D] (contiguous) with cos/sin [R or 1 (shared), T, D] into out.
void rope_rows(const float* x, int64_t R, int64_t T, int64_t H, int64_t D, const float* cos, const float* sin,
               bool shared, Heads out);

// Batch-invariant attention of q [R, H, T, D] over k/v [R, Hkv, S, D] into out [R, H, T, D]. mask: bool
// [R or 1, T, S] (mask_row_stride 0 or T * S; True = attend), or nullptr for causal over a cache whose last T keys
// are the queries' own.
void attend_into(Heads q, Heads k, Heads v, int64_t R, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 const bool* mask, int64_t mask_row_stride, Heads out);

// y [n] = silu(gate) * up = gate * up / (1 + exp(-gate)); y may be gate.
void silu_mul_rows(const float* gate, const float* up, float* y, int64_t n);

// x [n] += delta (a residual connection: the same sums as ATen's x + delta).
void add_into(float* x, const float* delta, int64_t n);

// out [s, N] = ((x [s, K] A^T) B^T) * scale for A [r, K] and Bt = B^T [r, N] (fp32): a LoRA adapter's delta, each
// row in a fixed order of its own (u = x A^T sixteen dots at a time through sum16, then out = sum over j of u_j Bt_j,
// FMA by FMA), so a row's bits do not depend on the other rows. The Speculative Streaming stream rows take it after
// each base product: ATen's two tiny products per projection cost more in dispatch than in arithmetic (~2 ms of a
// 0.5B pass), and rows share each load of Bt here. u: scratch for s * r floats.
void lora_delta_rows(const float* x, int64_t s, int64_t K, const float* A, int64_t r, const float* Bt, int64_t N,
                     float scale, float* out, float* u);

// Exact integer dots of a weight group: per int32 lane, the sum over its steps of 4 u8 codes (at most kMaxCode) times
// 4 s8 activations (|a| <= 127). AVX-512 VNNI adds each step into the int32 lanes (vpdpbusd). AVX2 has no such
// instruction: vpmaddubsw's int16 pair sums (2 * kMaxCode * 127 at most) add up in int16 for as many steps as
// cannot overflow, and are widened into the int32 lanes once (vpmaddwd). Integer sums are exact: the same bits.
template <int kMaxCode, int kSteps>
struct CodeDots {
#if defined(__AVX512F__)
  __m512i add(__m512i acc, int /*step*/, __m512i codes, __m512i acts) { return _mm512_dpbusd_epi32(acc, codes, acts); }
#else
  static constexpr int kPairSteps = kMaxCode < 128 ? 32767 / (2 * kMaxCode * 127) : 0;
  __m512i pairs = _mm512_setzero_si512();
  __m512i add(__m512i acc, int step, __m512i codes, __m512i acts) {
    if constexpr (kPairSteps < 2) {
      return avx2::dpbusd(acc, codes, acts);
    } else {
      pairs = avx2::add_pair_sums(pairs, codes, acts);
      if ((step + 1) % kPairSteps && step + 1 < kSteps) return acc;
      const __m512i widened = avx2::widen_pair_sums(acc, pairs);
      pairs = _mm512_setzero_si512();
      return widened;
    }
  }
#endif
};

// Sixteen dot products summed at once: lane L of the result is the sum of acc[L]'s lanes. Every accumulator goes
// through the same tree ((a_i + a_i+8) + (a_i+4 + a_i+12), then pairs), so a score does not depend on which slot
// of which block it took: where a key or query sits in a tile cannot change its value. Slot L must hold what
// lane kSlot[L] reports (the shuffles leave the sums in this order; kSlot is its own inverse).
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int p = 0; p < 8; ++p)  // [a_p: lane i + lane i+8 (8 lanes) | a_p+8: the same]
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[p], a[p + 8], 0x44), _mm512_shuffle_f32x4(a[p], a[p + 8], 0xEE));
  for (int p = 0; p < 4; ++p)  // four lanes each of a_p, a_p+8, a_p+4, a_p+12
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[p], b[p + 4], 0x88), _mm512_shuffle_f32x4(b[p], b[p + 4], 0xDD));
  for (int p = 0; p < 2; ++p)  // two lanes each, per 128-bit block: c_p's accumulator, then c_p+2's
    d[p] = _mm512_add_ps(_mm512_shuffle_ps(c[p], c[p + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[p], c[p + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp on 16 lanes, ~1.5 ulp (the polynomial of ggml's ggml_v_expf, MIT licence). Elementwise: a lane's value does
// not depend on its neighbours, so where an element sits in a vector cannot change its result.
inline __m512 exp16(__m512 x) {
  const __m512 r = _mm512_set1_ps(0x1.8p23f);
  const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
  const __m512 n = _mm512_sub_ps(z, r);
  const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
  const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
  const __m512 u = _mm512_mul_ps(b, b);
  const __m512 j = _mm512_fmadd_ps(
      _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                      _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
  const __m512 res = _mm512_scalef_ps(j, n);
  if (_mm512_kortestz(big, big)) return res;
  const __m512 zero = _mm512_setzero_ps();
  const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, zero, _CMP_LE_OQ), _mm512_set1_ps(INFINITY), zero);
  return _mm512_mask_blend_ps(big, res, alt);
}

}  // namespace mirrorsd
