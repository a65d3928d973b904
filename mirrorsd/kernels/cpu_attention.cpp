// Batch-invariant attention for CPU decoding (AVX-512), built with cpu_linear.cpp by mirrorsd.kernels.
//
// Quantized models turn last-bit differences into different tokens (their int8 activations round them into
// different steps), so a k-token verification forward must compute every query exactly as one-token decoding
// does. A masked multi-query SDPA does not (its blocking and reductions depend on the query count), which is
// why mirrorsd used to call SDPA once per query from Python: 8 x 28 calls for an 8-token window.
//
// Here a work item is a tile of up to kTile queries of one (row, kv head): a GQA group's heads times window
// rows, sharing each key and value load. Tiling only shares loads: every query's arithmetic depends only on
// its own query vector and the keys/values it sees, in position order (the dot products, the softmax sums and
// the value accumulation run in a fixed order whatever the number of queries, tiles, rows or threads). So any
// grouping of tokens into forwards, and any thread count, gives bit-identical outputs, and all queries run in
// one call.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;    // fp32 lanes in a zmm register
constexpr int64_t kMaxDim = 256;  // head_dim limit: the output accumulators live in registers (16 zmm)
constexpr int kTile = 6;          // queries of one kv head sharing each key load (a GQA group, window rows)
constexpr int kValueRegisters = 24;  // zmm registers for a value tile's accumulators (the rest: loads)

using mirrorsd::exp16;
using mirrorsd::kSlot;
using mirrorsd::sum16;

// Scores of NQ queries (1 or 2) against 16 / NQ keys: each (query, key) pair accumulates over head_dim in order
// in its own accumulator, then sum16. Two queries share each key load, one query shares its loads over 16 keys.
template <int NQ>
inline void dots(const float* const* q, const float* const* keys, int64_t dim, float scale, float* const* out) {
  constexpr int kKeys = 16 / NQ;
  __m512 acc[16];
  for (int s = 0; s < 16; ++s) acc[s] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += kLanes) {
    __m512 qv[NQ];
    for (int t = 0; t < NQ; ++t) qv[t] = _mm512_loadu_ps(q[t] + d);
    for (int j = 0; j < kKeys; ++j) {
      const __m512 kv = _mm512_loadu_ps(keys[j] + d);
      for (int t = 0; t < NQ; ++t) acc[kSlot[t * kKeys + j]] = _mm512_fmadd_ps(qv[t], kv, acc[kSlot[t * kKeys + j]]);
    }
  }
  const __m512 sums = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
  if constexpr (NQ == 1) {
    _mm512_storeu_ps(out[0], sums);
  } else {
    _mm256_storeu_ps(out[0], _mm512_castps512_ps256(sums));
    _mm256_storeu_ps(out[1], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)));
  }
}

// Weighted values for NQ queries: each query adds its seen keys' p * v in position order. VECS = head_dim / 16
// when known at compile time (the accumulators then stay in registers), 0 for any other head_dim.
template <int NQ, int VECS>
void weigh_values(const float* vbase, int64_t vstride, int64_t span, int64_t dim, const uint8_t* const* seen,
                  const float* const* probs, float* const* out) {
  constexpr int64_t kVecs = VECS ? VECS : kMaxDim / kLanes;
  const int64_t vecs = VECS ? VECS : dim / kLanes;
  __m512 acc[NQ][kVecs];
  int64_t next[NQ];
  for (int t = 0; t < NQ; ++t) {
    next[t] = 0;
    for (int64_t d = 0; d < vecs; ++d) acc[t][d] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < span; ++j) {
    const float* v = vbase + j * vstride;
    bool all = true;
    for (int t = 0; t < NQ; ++t) all = all && seen[t][j];
    if (all) {  // the usual case (causal rows): one load of each value chunk for every query
      __m512 p[NQ];
      for (int t = 0; t < NQ; ++t) p[t] = _mm512_set1_ps(probs[t][next[t]++]);
      for (int64_t d = 0; d < vecs; ++d) {
        const __m512 vv = _mm512_loadu_ps(v + d * kLanes);
        for (int t = 0; t < NQ; ++t) acc[t][d] = _mm512_fmadd_ps(p[t], vv, acc[t][d]);
      }
      continue;
    }
    for (int t = 0; t < NQ; ++t) {
      if (!seen[t][j]) continue;
      const __m512 p = _mm512_set1_ps(probs[t][next[t]++]);
      for (int64_t d = 0; d < vecs; ++d) acc[t][d] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + d * kLanes), acc[t][d]);
    }
  }
  for (int t = 0; t < NQ; ++t)
    for (int64_t d = 0; d < vecs; ++d) _mm512_storeu_ps(out[t] + d * kLanes, acc[t][d]);
}

// The values of a tile's queries, as many at a time as keep their accumulators in registers.
template <int VECS>
void weigh_tile(const float* vbase, int64_t vstride, int64_t span, int64_t dim, int nq, const uint8_t* const* seen,
                const float* const* probs, float* const* out) {
  constexpr int kMany = VECS ? kValueRegisters / VECS : 1;  // 3 queries at head_dim 128, 6 at 64
  int t = 0;
  for (; t + kMany <= nq; t += kMany)
    weigh_values<kMany, VECS>(vbase, vstride, span, dim, seen + t, probs + t, out + t);
  for (; t < nq; ++t) weigh_values<1, VECS>(vbase, vstride, span, dim, seen + t, probs + t, out + t);
}

// softmax over one query's seen scores, compacted in position order into probs; returns 1 / their sum.
float softmax_seen(const float* scores, const uint8_t* seen, int64_t span, float* probs, int64_t* count) {
  float top = -INFINITY;
  int64_t n = 0;
  for (int64_t j = 0; j < span; ++j)
    if (seen[j]) {
      probs[n++] = scores[j];
      top = std::max(top, scores[j]);
    }
  const __m512 topv = _mm512_set1_ps(top);
  __m512 sumv = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 m = static_cast<__mmask16>(n - j >= kLanes ? 0xFFFF : (1u << (n - j)) - 1u);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, probs + j), topv));
    _mm512_mask_storeu_ps(probs + j, m, p);
    sumv = _mm512_mask_add_ps(sumv, m, sumv, p);
  }
  *count = n;
  return 1.0f / _mm512_reduce_add_ps(sumv);
}

}  // namespace

// Called from Python through the op below, and by the fused decoder block (cpu_block.cpp) directly.
namespace mirrorsd {

void attend_into(Heads q, Heads k, Heads v, int64_t R, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 const bool* mask, int64_t mask_row_stride, Heads out) {
  const int64_t group = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Work items: (row, kv head, tile of up to kTile of the group * T queries that read that head's keys).
  const int64_t per_head = group * T, tiles = (per_head + kTile - 1) / kTile;
  const int64_t padded = (S + kLanes - 1) / kLanes * kLanes;  // score rows in whole blocks of 16 keys
  at::parallel_for(0, R * Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kTile * padded), probs(kTile * padded);
    std::vector<uint8_t> seen(kTile * padded);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item % tiles, kvh = (item / tiles) % Hkv, r = item / (tiles * Hkv);
      const int64_t first = tile * kTile;
      const int nq = static_cast<int>(std::min<int64_t>(kTile, per_head - first));
      const float* qrow[kTile];
      float* orow[kTile];
      float* srow[kTile];
      float* prow[kTile];
      const uint8_t* vis[kTile];
      int64_t span = 0;
      for (int t = 0; t < nq; ++t) {
        const int64_t h = kvh * group + (first + t) / T, i = (first + t) % T;
        qrow[t] = q.data + r * q.row + h * q.head + i * q.pos;
        orow[t] = out.data + r * out.row + h * out.head + i * out.pos;
        srow[t] = scores.data() + t * padded;
        prow[t] = probs.data() + t * padded;
        uint8_t* flags = seen.data() + t * padded;
        vis[t] = flags;
        int64_t last = 0;  // one past the last key this query sees
        if (mask) {
          const bool* row = mask + r * mask_row_stride + i * S;
          for (int64_t j = 0; j < S; ++j)
            if ((flags[j] = row[j])) last = j + 1;
        } else {
          last = S - T + i + 1;
          std::fill(flags, flags + last, uint8_t{1});
        }
        std::fill(flags + last, flags + padded, uint8_t{0});
        span = std::max(span, last);
      }
      const float* kb = k.data + r * k.row + kvh * k.head;
      const float* vb = v.data + r * v.row + kvh * v.head;
      // Scores in blocks of 16 keys; keys of the last block past the cache repeat its last key, and scores of
      // keys a query does not see are computed, never read.
      for (int64_t j = 0; j < span; j += kLanes) {
        const float* keys[kLanes];
        for (int64_t u = 0; u < kLanes; ++u) keys[u] = kb + std::min(j + u, S - 1) * k.pos;
        int t = 0;
        for (; t + 2 <= nq; t += 2) {
          float* half[2] = {srow[t] + j, srow[t + 1] + j};
          dots<2>(qrow + t, keys, D, scale, half);
          half[0] += kLanes / 2;
          half[1] += kLanes / 2;
          dots<2>(qrow + t, keys + kLanes / 2, D, scale, half);
        }
        if (t < nq) {
          float* whole[1] = {srow[t] + j};
          dots<1>(qrow + t, keys, D, scale, whole);
        }
      }
      float inv[kTile];
      for (int t = 0; t < nq; ++t) {
        int64_t n = 0;
        inv[t] = softmax_seen(srow[t], vis[t], span, prow[t], &n);
        if (n == 0) inv[t] = 0.0f;  // no key to attend to: zeros (SDPA would give NaN; callers never ask)
      }
      switch (D / kLanes) {
        case 4: weigh_tile<4>(vb, v.pos, span, D, nq, vis, prow, orow); break;
        case 8: weigh_tile<8>(vb, v.pos, span, D, nq, vis, prow, orow); break;
        default: weigh_tile<0>(vb, v.pos, span, D, nq, vis, prow, orow); break;
      }
      for (int t = 0; t < nq; ++t) {
        const __m512 iv = _mm512_set1_ps(inv[t]);
        for (int64_t d = 0; d < D; d += kLanes) _mm512_storeu_ps(orow[t] + d, _mm512_mul_ps(_mm512_loadu_ps(orow[t] + d), iv));
      }
    }
  });
}

}  // namespace mirrorsd

namespace {

mirrorsd::Heads heads(const torch::Tensor& x) {
  return mirrorsd::Heads{x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)};
}

// q [R, H, T, D]; k, v [R, Hkv, S, D] (strided views of the cache are fine: D must be contiguous);
// mask: bool [R or 1, T, S] (True = attend) or none, meaning causal over a cache whose last T keys are the
// queries' own (query i sees keys 0 .. S - T + i).
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const std::optional<torch::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: q, k, v must be 4-d [rows, heads, T, dim]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "attend: fp32 only");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attend: head_dim must be contiguous");
  const int64_t R = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(D % kLanes == 0 && D <= kMaxDim, "attend: head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(k.size(0) == R && v.size(0) == R && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D &&
              v.size(3) == D && Hkv > 0 && H % Hkv == 0, "attend: q, k, v shapes disagree");
  TORCH_CHECK(S > 0, "attend: no keys to attend to");  // (an empty mask's data is null: read as causal)
  TORCH_CHECK(mask || S >= T, "attend: a causal call needs the queries' own keys in the cache");
  const bool* mp = nullptr;
  int64_t mask_row_stride = 0;
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 3 && mask->is_contiguous() &&
                (mask->size(0) == 1 || mask->size(0) == R) && mask->size(1) == T && mask->size(2) == S,
                "attend: mask must be contiguous bool [rows or 1, T, S]");
    mp = mask->data_ptr<bool>();
    mask_row_stride = mask->size(0) == 1 ? 0 : T * S;
  }
  auto out = torch::empty({R, H, T, D}, q.options());
  mirrorsd::attend_into(heads(q), heads(k), heads(v), R, H, Hkv, T, S, D, mp, mask_row_stride, heads(out));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mirrorsd, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(mirrorsd, CPU, m) { m.impl("attend", attend); }
