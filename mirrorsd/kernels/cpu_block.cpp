// A quantized model's decoder blocks in one call (issue 18, items 1 and 5: overhead outside the kernels).
//
// At one token per forward, what surrounds a block's kernels runs on one core while the other waits: Python and op
// dispatch for seven linears, two norms, two rotary calls, a cache write, attention, SiLU and two residual adds, and,
// once the block ran as one op, still ~25 ATen calls and ~33 allocations per block (perf: ~3.8 ms of a ~31 ms
// Qwen2.5-1.5B token on the main thread outside the kernels; 1.4 ms after this file's raw-pointer path). Here the block's weights are bound once into a QuantBlock, one
// op runs every block of a range, and a block runs on raw pointers: its intermediates live in scratch memory the
// thread reuses, the residual stream is updated in place, and the rotated keys and the values are written straight
// into the cache. It calls the very kernel functions mirrorsd.model's Python path calls through the ops, in the same
// order, so both give the same bits (tested) and every batch-invariance argument carries over. q/k/v, and gate/up,
// read one input: their activations are quantized once and one parallel region covers them (each output unchanged).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cstring>
#include <optional>
#include <vector>

#include "cpu_kernels.h"

namespace {

using OptTensor = std::optional<torch::Tensor>;

// One QuantLinear's packed weight (mirrorsd.kernels.PackedQuant), checked once when the block is bound. Its raw
// pointers are taken again at each call, never kept: a storage can move under a tensor (share_memory_() when the
// processes backend sends the model).
struct Linear {
  torch::Tensor codes, scales;
  OptTensor planes, offsets, super_scales, super_offsets, bias;
  mirrorsd::QuantWeight checked;

  mirrorsd::QuantWeight view() const {
    mirrorsd::QuantWeight w = checked;
    const auto data = [](const OptTensor& t) { return t ? t->data_ptr() : nullptr; };
    w.codes = static_cast<const uint8_t*>(codes.data_ptr());
    w.planes = static_cast<const uint64_t*>(data(planes));
    w.scales = static_cast<const char*>(scales.data_ptr());
    w.offsets = static_cast<const char*>(data(offsets));
    w.super_scales = static_cast<const uint16_t*>(data(super_scales));
    w.super_offsets = static_cast<const uint16_t*>(data(super_offsets));
    w.bias = static_cast<const float*>(data(bias));
    return w;
  }
};

constexpr int64_t kLinears = 7;           // q, k, v, o, gate, up, down
constexpr int64_t kTensorsPerLinear = 7;  // codes, planes, scales, offsets, super_scales, super_offsets, bias
constexpr int64_t kIntsPerLinear = 4;     // n, bits, group, zero

struct QuantBlock : torch::CustomClassHolder {
  std::vector<Linear> linears;
  torch::Tensor input_norm, post_norm;
  OptTensor q_norm, k_norm;
  int64_t heads, kv_heads, head_dim, hidden;
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
      linears.push_back(Linear{*t[0], *t[2], t[1], t[3], t[4], t[5], t[6],
                               mirrorsd::check_weight(k, *t[0], t[1], *t[2], t[3], t[4], t[5], t[6], v[0], v[1], v[2],
                                                      v[3])});
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
    hidden = input_norm.numel();
    const auto is_fp32 = [](const torch::Tensor& t, int64_t n) {
      return t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == n;
    };
    TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 256 && kv_heads > 0 && heads % kv_heads == 0,
                "QuantBlock: head_dim must be a multiple of 16 (at most 256) and heads a multiple of kv_heads");
    TORCH_CHECK(is_fp32(input_norm, hidden) && is_fp32(post_norm, hidden) &&
                    (!q_norm || is_fp32(*q_norm, head_dim)) && (!k_norm || is_fp32(*k_norm, head_dim)) &&
                    q_norm.has_value() == k_norm.has_value(),
                "QuantBlock: norm weights must be contiguous fp32 (q and k norms of head_dim, both or neither)");
    const int64_t q_out = heads * head_dim, kv_out = kv_heads * head_dim, inner = linears[4].checked.N;
    const int64_t ins[kLinears] = {hidden, hidden, hidden, q_out, hidden, hidden, inner};
    const int64_t outs[kLinears] = {q_out, kv_out, kv_out, hidden, inner, inner, hidden};
    for (int64_t i = 0; i < kLinears; ++i)
      TORCH_CHECK(linears[i].checked.K == ins[i] && linears[i].checked.N == outs[i], "QuantBlock: linear ", i,
                  " is [", linears[i].checked.N, ", ", linears[i].checked.K, "], expected [", outs[i], ", ", ins[i], "]");
  }
};

// One layer's cache buffers [rows, kv_heads, capacity, head_dim] and how many positions they hold.
struct LayerCache {
  float* keys;
  float* values;
  int64_t capacity, start;
};

// The window's cos/sin [rows or 1, T, head_dim] and mask [rows or 1, T, start + T] (nullptr: causal).
struct Window {
  int64_t rows, t;
  const float* cos;
  const float* sin;
  bool shared_angles;
  const bool* mask;
  int64_t mask_row_stride;
};

// Speculative Streaming's stream rows (mirrorsd.model.SSRows): the last `count` positions of each row's window
// get the stream adapters' low-rank deltas (x A^T) B^T * scale after each base product, as SSRows.project adds
// them in Python; main rows keep the base weights, so the target's own tokens cannot change.
struct StreamLora {
  int64_t count = 0;
  const torch::Tensor* a[kLinears] = {};  // [rank, K] fp32
  const torch::Tensor* b[kLinears] = {};  // [N, rank] fp32
  double scale[kLinears] = {};
};

// out [rows * T, N] += the delta of linear `which` on its input in [rows * T, K], for the stream rows only. Every
// row's stream rows go through one pair of products, [rows * count, K] high, as peft's modules take x[:, -count:]:
// a BLAS product's bits can depend on its height.
void add_stream_delta(const StreamLora* lora, int64_t which, const float* in, int64_t K, float* out, int64_t N,
                      int64_t rows, int64_t t) {
  if (lora == nullptr || lora->count == 0) return;
  const int64_t s = lora->count;
  const auto all = torch::from_blob(const_cast<float*>(in), {rows, t, K}, torch::kFloat);
  const torch::Tensor x = all.narrow(1, t - s, s).reshape({rows * s, K});  // a copy when rows > 1
  const torch::Tensor delta =
      at::mm(at::mm(x, lora->a[which]->t()), lora->b[which]->t()).mul_(lora->scale[which]).view({rows, s, N});
  torch::from_blob(out, {rows, t, N}, torch::kFloat).narrow(1, t - s, s).add_(delta);
}

// One block on hidden [rows, T, hidden] in place, writing the window's keys and values into the cache at start
// (stream rows' too, past the main rows: the caller keeps them out of the cache's length). Every intermediate lives
// in this thread's scratch: no tensor is made and no ATen op is dispatched, unless stream rows take their deltas.
void block_forward(const QuantBlock& b, float* hidden, const Window& w, const LayerCache& cache, bool split,
                   const StreamLora* lora = nullptr) {
  static thread_local mirrorsd::Scratch scratch;
  scratch.rewind();
  const int64_t rows = w.rows, t = w.t, m = rows * t, end = cache.start + t;
  const int64_t H = b.heads, Hkv = b.kv_heads, D = b.head_dim, inner = b.linears[4].checked.N;
  float* h = scratch.take<float>(m * b.hidden);
  float* q = scratch.take<float>(m * H * D);
  float* k = scratch.take<float>(m * Hkv * D);
  float* v = scratch.take<float>(m * Hkv * D);
  float* q_rot = scratch.take<float>(m * H * D);
  float* attended = scratch.take<float>(m * H * D);
  float* delta = scratch.take<float>(m * b.hidden);
  float* gate = scratch.take<float>(m * inner);
  float* up = scratch.take<float>(m * inner);

  mirrorsd::rms_norm_rows(hidden, b.input_norm.data_ptr<float>(), h, m, b.hidden, b.eps);
  const mirrorsd::QuantWeight qkv[3] = {b.linears[0].view(), b.linears[1].view(), b.linears[2].view()};
  float* const qkv_out[3] = {q, k, v};
  mirrorsd::linear_quant_into(h, m, b.hidden, qkv, 3, qkv_out, split);
  for (int64_t i = 0; i < 3; ++i) add_stream_delta(lora, i, h, b.hidden, qkv_out[i], qkv[i].N, rows, t);
  if (b.q_norm) {
    mirrorsd::rms_norm_rows(q, b.q_norm->data_ptr<float>(), q, m * H, D, b.eps);
    mirrorsd::rms_norm_rows(k, b.k_norm->data_ptr<float>(), k, m * Hkv, D, b.eps);
  }
  // Rotated queries in attention's layout [rows, H, T, D]; rotated keys and the values straight into the cache.
  const int64_t cache_row = Hkv * cache.capacity * D, cache_head = cache.capacity * D;
  mirrorsd::rope_rows(q, rows, t, H, D, w.cos, w.sin, w.shared_angles, mirrorsd::Heads{q_rot, H * t * D, t * D, D});
  mirrorsd::rope_rows(k, rows, t, Hkv, D, w.cos, w.sin, w.shared_angles,
                      mirrorsd::Heads{cache.keys + cache.start * D, cache_row, cache_head, D});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < t; ++i)
      for (int64_t kvh = 0; kvh < Hkv; ++kvh)
        std::memcpy(cache.values + r * cache_row + kvh * cache_head + (cache.start + i) * D,
                    v + ((r * t + i) * Hkv + kvh) * D, D * sizeof(float));
  // The output in [rows, T, H, D], which is o_proj's input [rows * T, H * D] as it is.
  mirrorsd::attend_into(mirrorsd::Heads{q_rot, H * t * D, t * D, D}, mirrorsd::Heads{cache.keys, cache_row, cache_head, D},
                        mirrorsd::Heads{cache.values, cache_row, cache_head, D}, rows, H, Hkv, t, end, D, w.mask,
                        w.mask_row_stride, mirrorsd::Heads{attended, t * H * D, D, H * D});
  const mirrorsd::QuantWeight o_proj = b.linears[3].view();
  mirrorsd::linear_quant_into(attended, m, H * D, &o_proj, 1, &delta, split);
  add_stream_delta(lora, 3, attended, H * D, delta, b.hidden, rows, t);
  mirrorsd::add_into(hidden, delta, m * b.hidden);

  mirrorsd::rms_norm_rows(hidden, b.post_norm.data_ptr<float>(), h, m, b.hidden, b.eps);
  const mirrorsd::QuantWeight gate_up[2] = {b.linears[4].view(), b.linears[5].view()};
  float* const gate_up_out[2] = {gate, up};
  mirrorsd::linear_quant_into(h, m, b.hidden, gate_up, 2, gate_up_out, split);
  add_stream_delta(lora, 4, h, b.hidden, gate, inner, rows, t);
  add_stream_delta(lora, 5, h, b.hidden, up, inner, rows, t);
  mirrorsd::silu_mul_rows(gate, up, gate, m * inner);
  const mirrorsd::QuantWeight down_proj = b.linears[6].view();
  mirrorsd::linear_quant_into(gate, m, inner, &down_proj, 1, &delta, split);
  add_stream_delta(lora, 6, gate, inner, delta, b.hidden, rows, t);
  mirrorsd::add_into(hidden, delta, m * b.hidden);
}

void check_fp32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous(), "blocks_forward: ", what, " must be contiguous fp32");
}

// Blocks in turn on x [rows, T, hidden], in one op call: the residual stream is one tensor updated in place, and the
// Python between per-block calls (~1.8 ms of a 28-block one-token forward, while the other core waited) is gone.
// keys[i]/values[i] are block i's whole cache buffers [rows, kv_heads, capacity, head_dim] with room for positions
// starts[i] .. starts[i] + T (the caller grows the cache and advances its lengths).
//
// stream_rows > 0 (stream_blocks_forward): the window's last stream_rows positions are Speculative Streaming stream
// rows, and lora_a/lora_b/lora_scale hold each block's 7 adapters in turn (q, k, v, o, gate, up, down).
torch::Tensor run_blocks(const c10::List<c10::intrusive_ptr<QuantBlock>>& blocks, const torch::Tensor& x,
                         const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                         const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                         const OptTensor& mask, bool split, const std::vector<torch::Tensor>& lora_a,
                         const std::vector<torch::Tensor>& lora_b, const std::vector<double>& lora_scale,
                         int64_t stream_rows) {
  const size_t n = blocks.size();
  TORCH_CHECK(keys.size() == n && values.size() == n && starts.size() == n,
              "blocks_forward: one cache buffer pair and start per block");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat, "blocks_forward: x must be fp32 [rows, T, hidden]");
  const int64_t rows = x.size(0), t = x.size(1);
  const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
  check_fp32(c, "cos");
  check_fp32(s, "sin");
  TORCH_CHECK(c.dim() == 3 && c.sizes() == s.sizes() && (c.size(0) == 1 || c.size(0) == rows) && c.size(1) == t,
              "blocks_forward: cos/sin must be [rows or 1, T, head_dim]");
  const OptTensor seen = mask ? OptTensor(mask->contiguous()) : std::nullopt;
  if (seen)
    TORCH_CHECK(seen->scalar_type() == torch::kBool && seen->dim() == 3 && (seen->size(0) == 1 || seen->size(0) == rows) &&
                    seen->size(1) == t,
                "blocks_forward: mask must be bool [rows or 1, T, S]");
  const Window window{rows, t, c.data_ptr<float>(), s.data_ptr<float>(), c.size(0) == 1,
                      seen ? seen->data_ptr<bool>() : nullptr, seen && seen->size(0) > 1 ? seen->size(1) * seen->size(2) : 0};
  if (stream_rows > 0) {
    const size_t adapters = n * kLinears;
    TORCH_CHECK(lora_a.size() == adapters && lora_b.size() == adapters && lora_scale.size() == adapters,
                "stream_blocks_forward: ", kLinears, " adapters (A, B, scale) per block");
    TORCH_CHECK(stream_rows <= x.size(1), "stream_blocks_forward: more stream rows than the window holds");
  }
  torch::Tensor out = x.clone(at::MemoryFormat::Contiguous);  // the residual stream
  for (size_t i = 0; i < n; ++i) {
    const QuantBlock& b = *blocks.get(i);
    StreamLora lora;
    if (stream_rows > 0) {
      lora.count = stream_rows;
      for (int64_t j = 0; j < kLinears; ++j) {
        const torch::Tensor &a = lora_a[i * kLinears + j], &bm = lora_b[i * kLinears + j];
        const mirrorsd::QuantWeight& w = b.linears[j].checked;
        TORCH_CHECK(a.scalar_type() == torch::kFloat && bm.scalar_type() == torch::kFloat && a.dim() == 2 &&
                        bm.dim() == 2 && a.size(1) == w.K && bm.size(0) == w.N && bm.size(1) == a.size(0),
                    "stream_blocks_forward: adapter ", j, " of block ", i, " must be fp32 A [rank, ", w.K, "] and B [",
                    w.N, ", rank]");
        lora.a[j] = &a;
        lora.b[j] = &bm;
        lora.scale[j] = lora_scale[i * kLinears + j];
      }
    }
    const torch::Tensor &k = keys[i], &v = values[i];
    const int64_t start = starts[i], end = start + t;
    check_fp32(k, "keys");
    check_fp32(v, "values");
    TORCH_CHECK(x.size(2) == b.hidden && c.size(2) == b.head_dim, "blocks_forward: x or cos/sin do not fit block ", i);
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == rows && k.size(1) == b.kv_heads &&
                    k.size(3) == b.head_dim && start >= 0 && end <= k.size(2),
                "blocks_forward: block ", i, "'s cache buffers must be [rows, kv_heads, capacity >= ", end, ", head_dim]");
    TORCH_CHECK(!seen || seen->size(2) == end, "blocks_forward: the mask must cover ", end, " keys at block ", i);
    block_forward(b, out.data_ptr<float>(), window, LayerCache{k.data_ptr<float>(), v.data_ptr<float>(), k.size(2), start},
                  split, stream_rows > 0 ? &lora : nullptr);
  }
  return out;
}

torch::Tensor blocks_forward(const c10::List<c10::intrusive_ptr<QuantBlock>>& blocks, const torch::Tensor& x,
                             const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                             const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                             const OptTensor& mask, bool split) {
  return run_blocks(blocks, x, cos, sin, keys, values, starts, mask, split, {}, {}, {}, 0);
}

torch::Tensor stream_blocks_forward(const c10::List<c10::intrusive_ptr<QuantBlock>>& blocks, const torch::Tensor& x,
                                    const torch::Tensor& cos, const torch::Tensor& sin,
                                    const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                    const std::vector<int64_t>& starts, const torch::Tensor& mask, bool split,
                                    const std::vector<torch::Tensor>& lora_a, const std::vector<torch::Tensor>& lora_b,
                                    const std::vector<double>& lora_scale, int64_t stream_rows) {
  TORCH_CHECK(stream_rows > 0, "stream_blocks_forward: stream_rows must be > 0 (blocks_forward runs none)");
  return run_blocks(blocks, x, cos, sin, keys, values, starts, mask, split, lora_a, lora_b, lora_scale, stream_rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mirrorsd, m) {
  m.class_<QuantBlock>("QuantBlock").def(torch::init<std::vector<OptTensor>, std::vector<int64_t>, double>());
  m.def("blocks_forward(__torch__.torch.classes.mirrorsd.QuantBlock[] blocks, Tensor x, Tensor cos, Tensor sin, "
        "Tensor[] keys, Tensor[] values, int[] starts, Tensor? mask, bool split) -> Tensor");
  m.def("stream_blocks_forward(__torch__.torch.classes.mirrorsd.QuantBlock[] blocks, Tensor x, Tensor cos, Tensor sin, "
        "Tensor[] keys, Tensor[] values, int[] starts, Tensor mask, bool split, Tensor[] lora_a, Tensor[] lora_b, "
        "float[] lora_scale, int stream_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(mirrorsd, CPU, m) {
  m.impl("blocks_forward", blocks_forward);
  m.impl("stream_blocks_forward", stream_blocks_forward);
}
