// A whole decoder block of a quantized model in one call (issue 18, item 5: overhead outside the kernels).
//
// At one token per forward a Qwen2.5-1.5B block does ~35 us of Python and op dispatch around its kernels (seven
// linear calls of 13 arguments each, two norms, two rotary calls, a cache write, attention, SiLU, two residual
// adds): ~4 ms of a ~38 ms token. Here the block's weights are bound once into a QuantBlock and one op runs the
// block, calling the same kernel functions and ATen ops, in the same order, as mirrorsd.model's Python path, so
// both give the same bits (tested) and every batch-invariance argument carries over. q/k/v, and gate/up, read one
// input: their activations are quantized once and one parallel region covers them (each output unchanged).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/types.h>

#include <initializer_list>
#include <optional>
#include <vector>

#include "cpu_kernels.h"

namespace {

using OptTensor = std::optional<torch::Tensor>;

// One QuantLinear's packed weight (mirrorsd.kernels.PackedQuant) and shape. Its raw pointers are taken at each call,
// never cached: a storage can move under a tensor (share_memory_() when the processes backend sends the model).
struct Linear {
  torch::Tensor codes, scales;
  OptTensor planes, offsets, super_scales, super_offsets, bias;
  int64_t k = 0, n = 0, bits = 0, group = 0, zero = 0;

  mirrorsd::QuantWeight view() const {
    return mirrorsd::check_weight(k, codes, planes, scales, offsets, super_scales, super_offsets, bias, n, bits, group,
                                  zero);
  }
};

// x [..., K] through linears that share it -> [..., n] each, as QuantLinear.forward computes each of them.
std::vector<torch::Tensor> project(const torch::Tensor& x, std::initializer_list<const Linear*> linears, bool split) {
  const torch::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  std::vector<mirrorsd::QuantWeight> views;
  for (const Linear* linear : linears) views.push_back(linear->view());
  std::vector<torch::Tensor> ys = mirrorsd::linear_quant_many(rows, views, split);
  for (size_t i = 0; i < ys.size(); ++i) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = views[i].N;
    ys[i] = ys[i].view(shape);
  }
  return ys;
}

constexpr int64_t kLinears = 7;           // q, k, v, o, gate, up, down
constexpr int64_t kTensorsPerLinear = 7;  // codes, planes, scales, offsets, super_scales, super_offsets, bias
constexpr int64_t kIntsPerLinear = 4;     // n, bits, group, zero

struct QuantBlock : torch::CustomClassHolder {
  std::vector<Linear> linears;
  torch::Tensor input_norm, post_norm;
  OptTensor q_norm, k_norm;
  int64_t heads, kv_heads, head_dim;
  double eps;

  // tensors: 7 per linear (q, k, v, o, gate, up, down), then input_norm, post_attention_norm, q_norm, k_norm;
  // ints: n, bits, group, zero per linear, then heads, kv_heads, head_dim.
  QuantBlock(std::vector<OptTensor> tensors, std::vector<int64_t> ints, double eps_) : eps(eps_) {
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == kLinears * kTensorsPerLinear + 4 &&
                    static_cast<int64_t>(ints.size()) == kLinears * kIntsPerLinear + 3,
                "QuantBlock: expected ", kLinears * kTensorsPerLinear + 4, " tensors and ", kLinears * kIntsPerLinear + 3,
                " ints");
    for (int64_t i = 0; i < kLinears; ++i) {
      const OptTensor* t = tensors.data() + i * kTensorsPerLinear;
      const int64_t* v = ints.data() + i * kIntsPerLinear;
      TORCH_CHECK(t[0] && t[2], "QuantBlock: linear ", i, " needs codes and scales");
      const int64_t k = t[0]->size(1) * (v[1] == 8 ? 4 : 8);  // codes [N/16, K/4 or K/8, 64]
      linears.push_back(Linear{*t[0], *t[2], t[1], t[3], t[4], t[5], t[6], k, v[0], v[1], v[2], v[3]});
    }
    const OptTensor* norms = tensors.data() + kLinears * kTensorsPerLinear;
    TORCH_CHECK(norms[0] && norms[1], "QuantBlock: needs both layer norms");
    input_norm = *norms[0];
    post_norm = *norms[1];
    q_norm = norms[2];
    k_norm = norms[3];
    const int64_t* dims = ints.data() + kLinears * kIntsPerLinear;
    heads = dims[0];
    kv_heads = dims[1];
    head_dim = dims[2];
  }
};

// x [rows, T, hidden] -> the block's output. keys/values: this layer's whole cache buffers [rows, kv_heads, cap, D]
// with room for positions start .. start + T (the caller grows the cache and advances its length).
torch::Tensor block_forward(const c10::intrusive_ptr<QuantBlock>& block, const torch::Tensor& x,
                            const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& keys,
                            const torch::Tensor& values, int64_t start, const OptTensor& mask, bool split) {
  TORCH_CHECK(x.dim() == 3, "block_forward: x must be [rows, T, hidden]");
  const int64_t rows = x.size(0), t = x.size(1), end = start + t;
  TORCH_CHECK(start >= 0 && end <= keys.size(2) && end <= values.size(2), "block_forward: the cache has no room");
  const QuantBlock& b = *block;
  const Linear& q_proj = b.linears[0];
  const Linear& k_proj = b.linears[1];
  const Linear& v_proj = b.linears[2];
  const Linear& o_proj = b.linears[3];
  const Linear& gate_proj = b.linears[4];
  const Linear& up_proj = b.linears[5];
  const Linear& down_proj = b.linears[6];

  const torch::Tensor h = mirrorsd::rms_norm(x.contiguous(), b.input_norm, b.eps);
  const std::vector<torch::Tensor> qkv = project(h, {&q_proj, &k_proj, &v_proj}, split);
  torch::Tensor q = qkv[0].view({rows, t, b.heads, b.head_dim});
  torch::Tensor k = qkv[1].view({rows, t, b.kv_heads, b.head_dim});
  const torch::Tensor v = qkv[2].view({rows, t, b.kv_heads, b.head_dim});
  if (b.q_norm) {
    q = mirrorsd::rms_norm(q.contiguous(), *b.q_norm, b.eps);
    k = mirrorsd::rms_norm(k.contiguous(), *b.k_norm, b.eps);
  }
  const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
  q = mirrorsd::rope(q.contiguous(), c, s);
  k = mirrorsd::rope(k.contiguous(), c, s);
  keys.slice(2, start, end).copy_(k);
  values.slice(2, start, end).copy_(v.transpose(1, 2));
  const OptTensor seen = mask ? OptTensor(mask->contiguous()) : std::nullopt;
  const torch::Tensor attended = mirrorsd::attend(q, keys.slice(2, 0, end), values.slice(2, 0, end), seen);
  const torch::Tensor out =
      x + project(attended.transpose(1, 2).reshape({rows, t, b.heads * b.head_dim}), {&o_proj}, split)[0];
  const torch::Tensor h2 = mirrorsd::rms_norm(out.contiguous(), b.post_norm, b.eps);
  const std::vector<torch::Tensor> gate_up = project(h2, {&gate_proj, &up_proj}, split);
  return out + project(at::silu(gate_up[0]) * gate_up[1], {&down_proj}, split)[0];
}

// Blocks in turn, each as block_forward, in one op call: a 28-block model's one-token forward spent ~1.8 ms in Python
// between 28 calls of one block each, while the other core waited. keys[i]/values[i]/starts[i] are block i's cache
// buffers and length.
torch::Tensor blocks_forward(const c10::List<c10::intrusive_ptr<QuantBlock>>& blocks, const torch::Tensor& x,
                             const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                             const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                             const OptTensor& mask, bool split) {
  const size_t n = blocks.size();
  TORCH_CHECK(keys.size() == n && values.size() == n && starts.size() == n,
              "blocks_forward: one cache buffer pair and start per block");
  torch::Tensor h = x;
  for (size_t i = 0; i < n; ++i) h = block_forward(blocks.get(i), h, cos, sin, keys[i], values[i], starts[i], mask, split);
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mirrorsd, m) {
  m.class_<QuantBlock>("QuantBlock").def(torch::init<std::vector<OptTensor>, std::vector<int64_t>, double>());
  m.def("blocks_forward(__torch__.torch.classes.mirrorsd.QuantBlock[] blocks, Tensor x, Tensor cos, Tensor sin, "
        "Tensor[] keys, Tensor[] values, int[] starts, Tensor? mask, bool split) -> Tensor");
}

TORCH_LIBRARY_IMPL(mirrorsd, CPU, m) { m.impl("blocks_forward", blocks_forward); }
