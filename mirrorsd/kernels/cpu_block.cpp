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

// One QuantLinear's packed weight (mirrorsd.kernels.PackedQuant), or a PackedLinear's fp32 one (bits 32, in
// `codes`), checked once when the block is bound. Its raw pointers are taken again at each call, never kept: a
// storage can move under a tensor (share_memory_() when the processes backend sends the model).
struct Linear {
  torch::Tensor codes;
  OptTensor scales, planes, offsets, super_scales, super_offsets, bias;
  mirrorsd::QuantWeight checked;

  mirrorsd::QuantWeight view() const {
    mirrorsd::QuantWeight w = checked;
    const auto data = [](const OptTensor& t) { return t ? t->data_ptr() : nullptr; };
    if (checked.bits == 32) {
      w.f32 = codes.data_ptr<float>();
      w.bias = static_cast<const float*>(data(bias));
      return w;
    }
    w.codes = static_cast<const uint8_t*>(codes.data_ptr());
    w.planes = static_cast<const uint64_t*>(data(planes));
    w.scales = static_cast<const char*>(scales->data_ptr());
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
  // ints: n, bits, group, zero per linear, then heads, kv_heads, head_dim. An fp32 linear has bits 32 and its
  // packed weight in place of the codes (nothing else but its bias); a block's linears are all fp32 or none.
  QuantBlock(std::vector<OptTensor> tensors, std::vector<int64_t> ints, double eps_) : eps(eps_) {
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == kLinears * kTensorsPerLinear + 4 &&
                    static_cast<int64_t>(ints.size()) == kLinears * kIntsPerLinear + 3,
                "QuantBlock: expected ", kLinears * kTensorsPerLinear + 4, " tensors and ", kLinears * kIntsPerLinear + 3,
                " ints");
    for (int64_t i = 0; i < kLinears; ++i) {
      const OptTensor* t = tensors.data() + i * kTensorsPerLinear;
      const int64_t* v = ints.data() + i * kIntsPerLinear;
      TORCH_CHECK((v[1] == 32) == (ints[1] == 32), "QuantBlock: the linears must be all fp32 or all quantized");
      if (v[1] == 32) {
        TORCH_CHECK(t[0], "QuantBlock: fp32 linear ", i, " needs its packed weight");
        linears.push_back(Linear{*t[0], {}, {}, {}, {}, {}, t[6], mirrorsd::check_f32_weight(t[0]->size(1), *t[0], t[6],
                                                                                             v[0])});
        continue;
      }
      TORCH_CHECK(t[0] && t[2], "QuantBlock: linear ", i, " needs codes and scales");
      const int64_t k = t[0]->size(1) * (v[1] == 8 ? 4 : 8);  // codes [N/16, K/4 or K/8, 64]
      linears.push_back(Linear{*t[0], t[2], t[1], t[3], t[4], t[5], t[6],
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

// A part of the window that attends over one cache: `rows` sequences of `t` positions each at token row `offset` of
// x [M, hidden], sharing one start (blocks_forward's window is one part; ragged_blocks_forward's sequences are one
// part each, with a cache and a length of their own). cos/sin [rows or 1, t, head_dim]; mask [rows or 1, t,
// start + t] (nullptr: causal); the last `streams` positions of each row are Speculative Streaming stream rows.
struct Part {
  int64_t offset, rows, t, streams;
  const float* cos;
  const float* sin;
  bool shared_angles;
  const bool* mask;
  int64_t mask_row_stride;
  LayerCache cache;
};

// Speculative Streaming's stream adapters (mirrorsd.model.SSRows): stream rows get the low-rank deltas
// (x A^T) B^T * scale after each base product, as SSRows.project adds them in Python; main rows keep the base
// weights, so the target's own tokens cannot change.
struct StreamLora {
  const torch::Tensor* a[kLinears] = {};  // [rank, K] fp32
  const torch::Tensor* b[kLinears] = {};  // B^T [rank, N] fp32
  double scale[kLinears] = {};
};

// out [M, N] += the delta of linear `which` on its input in [M, K], for each part's stream rows (lora_delta_rows: row
// by row, the bits of mirrorsd.decoding.streams.adapters' delta outside training, whoever shares the call).
void add_stream_delta(const StreamLora* lora, int64_t which, const float* in, int64_t K, float* out, int64_t N,
                      const std::vector<Part>& parts) {
  if (lora == nullptr) return;
  static thread_local std::vector<float> delta, u;
  const torch::Tensor& a = *lora->a[which];
  const torch::Tensor& bt = *lora->b[which];
  for (const Part& p : parts) {
    if (p.streams == 0) continue;
    const int64_t s = p.streams;
    delta.resize(s * N);
    u.resize(s * a.size(0));
    for (int64_t row = 0; row < p.rows; ++row) {
      const int64_t first = p.offset + row * p.t + p.t - s;  // this row's stream rows, consecutive
      mirrorsd::lora_delta_rows(in + first * K, s, K, a.data_ptr<float>(), a.size(0), bt.data_ptr<float>(), N,
                                static_cast<float>(lora->scale[which]), delta.data(), u.data());
      mirrorsd::add_into(out + first * N, delta.data(), s * N);
    }
  }
}

// One block on hidden [M, hidden] in place, writing each part's keys and values into its cache at its start (stream
// rows' too, past the main rows: the caller keeps them out of the cache's length). The linears run once over all M
// rows (the weights are read once for every sequence); norms and linears are row-local, and rotary embedding, the
// cache write and attention run part by part, so a part's bits do not depend on the others. Every intermediate lives
// in this thread's scratch: no tensor is made and no ATen op is dispatched, unless stream rows take their deltas.
void block_forward(const QuantBlock& b, float* hidden, int64_t m, const std::vector<Part>& parts, bool split,
                   const StreamLora* lora = nullptr) {
  static thread_local mirrorsd::Scratch scratch;
  scratch.rewind();
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
  mirrorsd::linear_into(h, m, b.hidden, qkv, 3, qkv_out, split);
  for (int64_t i = 0; i < 3; ++i) add_stream_delta(lora, i, h, b.hidden, qkv_out[i], qkv[i].N, parts);
  if (b.q_norm) {
    mirrorsd::rms_norm_rows(q, b.q_norm->data_ptr<float>(), q, m * H, D, b.eps);
    mirrorsd::rms_norm_rows(k, b.k_norm->data_ptr<float>(), k, m * Hkv, D, b.eps);
  }
  for (const Part& p : parts) {
    // Rotated queries in attention's layout [rows, H, T, D]; rotated keys and the values straight into the cache.
    const LayerCache& cache = p.cache;
    const int64_t rows = p.rows, t = p.t, end = cache.start + t;
    const int64_t cache_row = Hkv * cache.capacity * D, cache_head = cache.capacity * D;
    float* const pq = q_rot + p.offset * H * D;
    const float* const pk = k + p.offset * Hkv * D;
    const float* const pv = v + p.offset * Hkv * D;
    mirrorsd::rope_rows(q + p.offset * H * D, rows, t, H, D, p.cos, p.sin, p.shared_angles,
                        mirrorsd::Heads{pq, H * t * D, t * D, D});
    mirrorsd::rope_rows(pk, rows, t, Hkv, D, p.cos, p.sin, p.shared_angles,
                        mirrorsd::Heads{cache.keys + cache.start * D, cache_row, cache_head, D});
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < t; ++i)
        for (int64_t kvh = 0; kvh < Hkv; ++kvh)
          std::memcpy(cache.values + r * cache_row + kvh * cache_head + (cache.start + i) * D,
                      pv + ((r * t + i) * Hkv + kvh) * D, D * sizeof(float));
    // The output in [rows, T, H, D], which is o_proj's input [rows * T, H * D] as it is.
    mirrorsd::attend_into(mirrorsd::Heads{pq, H * t * D, t * D, D}, mirrorsd::Heads{cache.keys, cache_row, cache_head, D},
                          mirrorsd::Heads{cache.values, cache_row, cache_head, D}, rows, H, Hkv, t, end, D, p.mask,
                          p.mask_row_stride, mirrorsd::Heads{attended + p.offset * H * D, t * H * D, D, H * D});
  }
  const mirrorsd::QuantWeight o_proj = b.linears[3].view();
  mirrorsd::linear_into(attended, m, H * D, &o_proj, 1, &delta, split);
  add_stream_delta(lora, 3, attended, H * D, delta, b.hidden, parts);
  mirrorsd::add_into(hidden, delta, m * b.hidden);

  mirrorsd::rms_norm_rows(hidden, b.post_norm.data_ptr<float>(), h, m, b.hidden, b.eps);
  const mirrorsd::QuantWeight gate_up[2] = {b.linears[4].view(), b.linears[5].view()};
  float* const gate_up_out[2] = {gate, up};
  mirrorsd::linear_into(h, m, b.hidden, gate_up, 2, gate_up_out, split);
  add_stream_delta(lora, 4, h, b.hidden, gate, inner, parts);
  add_stream_delta(lora, 5, h, b.hidden, up, inner, parts);
  mirrorsd::silu_mul_rows(gate, up, gate, m * inner);
  const mirrorsd::QuantWeight down_proj = b.linears[6].view();
  mirrorsd::linear_into(gate, m, inner, &down_proj, 1, &delta, split);
  add_stream_delta(lora, 6, gate, inner, delta, b.hidden, parts);
  mirrorsd::add_into(hidden, delta, m * b.hidden);
}

void check_fp32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous(), "blocks_forward: ", what, " must be contiguous fp32");
}

// Block i's 7 stream adapters (q, k, v, o, gate, up, down) from the flat lists, checked against its linears.
StreamLora bind_lora(const QuantBlock& b, size_t i, const std::vector<torch::Tensor>& lora_a,
                     const std::vector<torch::Tensor>& lora_b, const std::vector<double>& lora_scale) {
  StreamLora lora;
  for (int64_t j = 0; j < kLinears; ++j) {
    const torch::Tensor &a = lora_a[i * kLinears + j], &bm = lora_b[i * kLinears + j];
    const mirrorsd::QuantWeight& w = b.linears[j].checked;
    TORCH_CHECK(a.scalar_type() == torch::kFloat && bm.scalar_type() == torch::kFloat && a.dim() == 2 && bm.dim() == 2 &&
                    a.is_contiguous() && bm.is_contiguous() && a.size(1) == w.K && bm.size(1) == w.N &&
                    bm.size(0) == a.size(0),
                "stream_blocks_forward: adapter ", j, " of block ", i, " must be contiguous fp32 A [rank, ", w.K,
                "] and B^T [rank, ", w.N, "]");
    lora.a[j] = &a;
    lora.b[j] = &bm;
    lora.scale[j] = lora_scale[i * kLinears + j];
  }
  return lora;
}

void check_lora(size_t blocks, const std::vector<torch::Tensor>& lora_a, const std::vector<torch::Tensor>& lora_b,
                const std::vector<double>& lora_scale) {
  const size_t adapters = blocks * kLinears;
  TORCH_CHECK(lora_a.size() == adapters && lora_b.size() == adapters && lora_scale.size() == adapters,
              "stream_blocks_forward: ", kLinears, " adapters (A, B, scale) per block");
}

// Block i's cache buffers [rows, kv_heads, capacity >= end, head_dim], checked against it.
LayerCache layer_cache(const QuantBlock& b, size_t i, const torch::Tensor& k, const torch::Tensor& v, int64_t rows,
                       int64_t start, int64_t t) {
  check_fp32(k, "keys");
  check_fp32(v, "values");
  const int64_t end = start + t;
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == rows && k.size(1) == b.kv_heads &&
                  k.size(3) == b.head_dim && start >= 0 && end <= k.size(2),
              "blocks_forward: block ", i, "'s cache buffers must be [", rows, ", kv_heads, capacity >= ", end,
              ", head_dim]");
  return LayerCache{k.data_ptr<float>(), v.data_ptr<float>(), k.size(2), start};
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
  if (stream_rows > 0) {
    check_lora(n, lora_a, lora_b, lora_scale);
    TORCH_CHECK(stream_rows <= t, "stream_blocks_forward: more stream rows than the window holds");
  }
  std::vector<Part> parts{Part{0, rows, t, stream_rows, c.data_ptr<float>(), s.data_ptr<float>(), c.size(0) == 1,
                               seen ? seen->data_ptr<bool>() : nullptr,
                               seen && seen->size(0) > 1 ? seen->size(1) * seen->size(2) : 0, LayerCache{}}};
  torch::Tensor out = x.clone(at::MemoryFormat::Contiguous);  // the residual stream
  for (size_t i = 0; i < n; ++i) {
    const QuantBlock& b = *blocks.get(i);
    TORCH_CHECK(x.size(2) == b.hidden && c.size(2) == b.head_dim, "blocks_forward: x or cos/sin do not fit block ", i);
    TORCH_CHECK(!seen || seen->size(2) == starts[i] + t, "blocks_forward: the mask must cover ", starts[i] + t,
                " keys at block ", i);
    parts[0].cache = layer_cache(b, i, keys[i], values[i], rows, starts[i], t);
    const StreamLora lora = stream_rows > 0 ? bind_lora(b, i, lora_a, lora_b, lora_scale) : StreamLora{};
    block_forward(b, out.data_ptr<float>(), rows * t, parts, split, stream_rows > 0 ? &lora : nullptr);
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

// Blocks in turn on the windows of several sequences at once (continuous batching): x [M, hidden] holds sequence j's
// lengths[j] positions after sequence j-1's, with its angles in cos/sin [M, head_dim]. Each sequence has a cache of
// its own: keys/values/starts are block-major (block i, sequence j at i * sequences + j; buffers [1, kv_heads,
// capacity, head_dim]), and masks[j] is None (causal) or bool [lengths[j], starts + lengths[j]] (every block of the
// call must then hold the same start). streams[j]: sequence j's trailing Speculative Streaming stream rows (the
// adapters as stream_blocks_forward takes them; empty lists when no sequence has any). A sequence's outputs have the
// bits blocks_forward gives it alone.
torch::Tensor ragged_blocks_forward(const c10::List<c10::intrusive_ptr<QuantBlock>>& blocks, const torch::Tensor& x,
                                    const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<int64_t>& lengths,
                                    const std::vector<int64_t>& streams, const std::vector<torch::Tensor>& keys,
                                    const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                                    const std::vector<OptTensor>& masks, bool split,
                                    const std::vector<torch::Tensor>& lora_a, const std::vector<torch::Tensor>& lora_b,
                                    const std::vector<double>& lora_scale) {
  const size_t n = blocks.size(), sequences = lengths.size();
  TORCH_CHECK(sequences > 0 && streams.size() == sequences && masks.size() == sequences,
              "ragged_blocks_forward: one length, stream count and mask per sequence");
  TORCH_CHECK(keys.size() == n * sequences && values.size() == n * sequences && starts.size() == n * sequences,
              "ragged_blocks_forward: one cache buffer pair and start per block and sequence");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "ragged_blocks_forward: x must be fp32 [M, hidden]");
  const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
  check_fp32(c, "cos");
  check_fp32(s, "sin");
  TORCH_CHECK(c.dim() == 2 && c.sizes() == s.sizes() && c.size(0) == x.size(0),
              "ragged_blocks_forward: cos/sin must be [M, head_dim]");
  const int64_t D = c.size(1);
  std::vector<torch::Tensor> seen(sequences);
  std::vector<Part> parts;
  int64_t offset = 0;
  bool any_streams = false;
  for (size_t j = 0; j < sequences; ++j) {
    const int64_t t = lengths[j];
    TORCH_CHECK(t > 0 && streams[j] >= 0 && streams[j] <= t, "ragged_blocks_forward: sequence ", j,
                " needs a positive length and at most that many stream rows");
    any_streams = any_streams || streams[j] > 0;
    const bool* mask = nullptr;
    if (masks[j]) {
      seen[j] = masks[j]->contiguous();
      TORCH_CHECK(seen[j].scalar_type() == torch::kBool && seen[j].dim() == 2 && seen[j].size(0) == t,
                  "ragged_blocks_forward: sequence ", j, "'s mask must be bool [", t, ", S]");
      mask = seen[j].data_ptr<bool>();
    }
    TORCH_CHECK(streams[j] == 0 || mask, "ragged_blocks_forward: stream rows need a mask");
    parts.push_back(Part{offset, 1, t, streams[j], c.data_ptr<float>() + offset * D, s.data_ptr<float>() + offset * D,
                         true, mask, 0, LayerCache{}});
    offset += t;
  }
  TORCH_CHECK(offset == x.size(0), "ragged_blocks_forward: the lengths sum to ", offset, ", x holds ", x.size(0));
  if (any_streams) check_lora(n, lora_a, lora_b, lora_scale);
  torch::Tensor out = x.clone(at::MemoryFormat::Contiguous);  // the residual stream
  for (size_t i = 0; i < n; ++i) {
    const QuantBlock& b = *blocks.get(i);
    TORCH_CHECK(x.size(1) == b.hidden && D == b.head_dim, "ragged_blocks_forward: x or cos/sin do not fit block ", i);
    for (size_t j = 0; j < sequences; ++j) {
      const int64_t start = starts[i * sequences + j];
      TORCH_CHECK(!parts[j].mask || seen[j].size(1) == start + parts[j].t, "ragged_blocks_forward: sequence ", j,
                  "'s mask must cover ", start + parts[j].t, " keys at block ", i);
      parts[j].cache = layer_cache(b, i, keys[i * sequences + j], values[i * sequences + j], 1, start, parts[j].t);
    }
    const StreamLora lora = any_streams ? bind_lora(b, i, lora_a, lora_b, lora_scale) : StreamLora{};
    block_forward(b, out.data_ptr<float>(), offset, parts, split, any_streams ? &lora : nullptr);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mirrorsd, m) {
  m.class_<QuantBlock>("QuantBlock").def(torch::init<std::vector<OptTensor>, std::vector<int64_t>, double>());
  m.def("blocks_forward(__torch__.torch.classes.mirrorsd.QuantBlock[] blocks, Tensor x, Tensor cos, Tensor sin, "
        "Tensor[] keys, Tensor[] values, int[] starts, Tensor? mask, bool split) -> Tensor");
  m.def("stream_blocks_forward(__torch__.torch.classes.mirrorsd.QuantBlock[] blocks, Tensor x, Tensor cos, Tensor sin, "
        "Tensor[] keys, Tensor[] values, int[] starts, Tensor mask, bool split, Tensor[] lora_a, Tensor[] lora_b, "
        "float[] lora_scale, int stream_rows) -> Tensor");
  m.def("ragged_blocks_forward(__torch__.torch.classes.mirrorsd.QuantBlock[] blocks, Tensor x, Tensor cos, Tensor sin, "
        "int[] lengths, int[] streams, Tensor[] keys, Tensor[] values, int[] starts, Tensor?[] masks, bool split, "
        "Tensor[] lora_a, Tensor[] lora_b, float[] lora_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mirrorsd, CPU, m) {
  m.impl("blocks_forward", blocks_forward);
  m.impl("stream_blocks_forward", stream_blocks_forward);
  m.impl("ragged_blocks_forward", ragged_blocks_forward);
}
