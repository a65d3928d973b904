// The kernels one C++ file calls in another: the fused decoder block (cpu_block.cpp) runs the very functions the
// Python ops run, so both paths give the same bits.
#pragma once

#include <torch/types.h>

#include <optional>

namespace mirrorsd {

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
