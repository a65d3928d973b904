// The kernels one C++ file calls in another: the fused decoder block (cpu_block.cpp) runs the very functions the
// Python ops run, so both paths give the same bits.
#pragma once

#include <torch/types.h>

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
  int64_t zero = 0;
  int64_t code_block = 0, plane_block = 0, scale_block = 0, super_block = 0;  // per 16-output block (scale: bytes)
};

QuantWeight check_weight(int64_t K, const torch::Tensor& codes, const std::optional<torch::Tensor>& planes,
                         const torch::Tensor& scales, const std::optional<torch::Tensor>& offsets,
                         const std::optional<torch::Tensor>& super_scales,
                         const std::optional<torch::Tensor>& super_offsets, const std::optional<torch::Tensor>& bias,
                         int64_t N, int64_t bits, int64_t group, int64_t zero);

// x [M, K] times several weights that read it (q/k/v; gate/up): the activations are quantized once and one parallel
// region covers every weight's blocks. Each output is computed exactly as a call of its own computes it.
std::vector<torch::Tensor> linear_quant_many(const torch::Tensor& x, const std::vector<QuantWeight>& weights, bool split);

torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& codes, const std::optional<torch::Tensor>& planes,
                           const torch::Tensor& scales, const std::optional<torch::Tensor>& offsets,
                           const std::optional<torch::Tensor>& super_scales,
                           const std::optional<torch::Tensor>& super_offsets, const std::optional<torch::Tensor>& bias,
                           int64_t N, int64_t bits, int64_t group, bool split, int64_t zero);

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const std::optional<torch::Tensor>& mask);

}  // namespace mirrorsd
