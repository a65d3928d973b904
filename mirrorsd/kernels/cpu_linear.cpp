// Small-M linear layers for CPU decoding (AVX-512 + VNNI), built on first use by mirrorsd.kernels.
//
// Decoding multiplies a handful of activation rows (M = 1..16: one token, a verification window, tree or
// stream rows) by a large weight. Stock GEMMs either stream the weight once per row block or pay packing
// costs, so an 8-row product costs 2-3x a 1-row one. These kernels read every weight byte once for all M
// rows: weights are pre-interleaved in blocks of 16 output features, so one vector load feeds 16 outputs
// and every activation row reuses it from registers.
//
// Both kernels are batch-invariant: row m's result is summed in the same order whatever M is, so a k-token
// verification forward gives bit-identical logits to k one-token forwards.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlockN = 16;    // output features per interleaved block (one zmm of fp32)
constexpr int64_t kActGroup = 32;  // activation quantization group
// Activation rows kept in registers at once (even: see split). AVX2 has 16 registers of half the width, so its
// tiles take 4 rows; a row's result does not depend on its tile, so the bits are the same.
#if defined(__AVX512F__)
constexpr int64_t kMaxTile = 8;
#else
constexpr int64_t kMaxTile = 4;
#endif
constexpr int64_t kTileTable = 8 + 1;  // the tile tables below, indexed by rows (up to AVX-512's 8)

// ---------------------------------------------------------------- fp32 weights
// w: [N/16, K, 16] fp32 (N padded with zeros). y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
template <int MT>
void f32_tile(const float* x, int64_t ldx, const float* w, int64_t K, float* acc_out) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wv = _mm512_loadu_ps(w + k * kBlockN);
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * ldx + k]), acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(acc_out + m * kBlockN, acc[m]);
}

using F32Tile = void (*)(const float*, int64_t, const float*, int64_t, float*);
constexpr F32Tile kF32Tiles[kTileTable] = {nullptr,         f32_tile<1>, f32_tile<2>, f32_tile<3>, f32_tile<4>,
                                             f32_tile<5>,     f32_tile<6>, f32_tile<7>, f32_tile<8>};

void store_block(const float* acc, int64_t rows, float* y, int64_t N, int64_t n0, const float* bias) {
  const int64_t valid = std::min<int64_t>(kBlockN, N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m)
    _mm512_mask_storeu_ps(y + m * N + n0, mask, _mm512_add_ps(_mm512_loadu_ps(acc + m * kBlockN), b));
}

void check_bias(const std::optional<torch::Tensor>& bias, int64_t N) {
  if (bias)
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [N]");
}

// y [M, N] for fp32 weights, row by row: the tile a row falls in never changes its bits (each accumulator is its
// own row's), so a row's output does not depend on how many rows the call carries.
void f32_linears_into(const float* x, int64_t M, int64_t K, const mirrorsd::QuantWeight* weights, int64_t count,
                      float* const* outs) {
  int64_t first[mirrorsd::kMaxSharedWeights + 1] = {0};
  for (int64_t i = 0; i < count; ++i) first[i + 1] = first[i] + weights[i].blocks;
  at::parallel_for(0, first[count], 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxTile * kBlockN];
    int64_t wi = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (b >= first[wi + 1]) ++wi;
      const mirrorsd::QuantWeight& w = weights[wi];
      const int64_t nb = b - first[wi];
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int64_t rows = std::min<int64_t>(kMaxTile, M - m0);
        kF32Tiles[rows](x + m0 * K, K, w.f32 + nb * K * kBlockN, K, acc);
        store_block(acc, rows, outs[wi] + m0 * w.N, w.N, nb * kBlockN, w.bias);
      }
    }
  });
}

// ---------------------------------------------------------------- group-quantized weights
// Codes are unsigned (4, 5, 6 or 8 bit); W[n, k] = scale[n, g] * code[n, k] + offset[n, g] with g = k / G.
// 8-bit codes: [N/16, K/4, 16, 4] bytes — one 64-byte vector holds 4 consecutive k for 16 outputs.
// 4-bit codes: [N/16, K/8, 64] bytes — low nibbles hold k-step 2p, high nibbles k-step 2p+1.
// 5- and 6-bit codes (Q5_0, Q5_K, Q6_K): the 4-bit nibble layout for the low bits, plus 1 or 2 bit planes
// [N/16, K/4, P] uint64 — bit j of plane b is bit 4+b of byte j of that k-step's 64-byte code vector; a
// masked byte add puts it back in registers. 5/6 bits cost 0.625/0.75 bytes per weight instead of 1.
// scales/offsets: [N/16, K/G, 16] fp16. Symmetric formats (Q8_0, Q6_K, Q5_0, Q4_0 and our q8: offset = -Z * scale
// with Z a power of two) ship no offsets: the kernel takes the zero point in the integer dot, sum((code - Z) * a),
// which is exact, saves the offset term's float work per row and group (see quant_tile), and makes the weight
// stream 0.125 (group 32) or 0.25 (group 16) bytes per weight lighter.
// Two-level scales (the K-quants Q4_K, Q5_K, Q6_K): GGUF stores each group's scale as an integer sub-scale times
// one fp16 scale per 256 weights, and so do we: scales/offsets [N/16, K/G, 16] int8 plus super_scales/super_offsets
// [N/16, K/S, 16] fp16, 0.06 (group 32) or 0.05 (group 16) bytes per weight lighter than fp16 per group. The
// kernel forms d * sub in fp32, which is exact (11 x 8 bits) and is GGUF's own value, not an fp16 rounding of it.
// Activations are quantized to int8 per row and per 32 features (absmax / 127, round half to even), so the
// inner product is an exact integer dot product (VNNI vpdpbusd: u8 codes x s8 activations).
// split: each row becomes two int8 rows, its quantization and the quantization of what that left over (x - q*s),
// and their products are added: ~15-bit activations at the cost of doubling M, which leaves M = 1 decoding
// bandwidth-bound (the weights are still read once). Small models answering chat prompts need it (quality.py).

// One group of 32 activations to int8 codes (and the sums of its two halves); returns the scale (absmax / 127).
// Vectorised, and exact: max, the product by 127 / absmax and round-half-to-even are the scalar operations.
float quantize_group(const float* src, int8_t* q, int32_t* sums) {
  const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 inv = _mm512_set1_ps(amax >= FLT_MIN ? 127.f / amax : 0.f);  // 127 / subnormal would be inf
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, inv), kRound);
  const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, inv), kRound);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  sums[0] = _mm512_reduce_add_epi32(qlo);
  sums[1] = _mm512_reduce_add_epi32(qhi);
  return amax / 127.f;
}

// Rows x [M, K] to int8: codes q [M', K], scales [M', K/32] and the sums of each 16 codes [M', K/16] (for the offset
// terms), with M' = M, or 2M with split, where rows 2m and 2m+1 hold row m's codes and its remainder's.
void quantize_acts(const float* x, int64_t M, int64_t K, bool split, int8_t* qp, float* sp, int32_t* sums) {
  const int64_t groups = K / kActGroup, per_row = split ? 2 : 1;
  mirrorsd::parallel_rows(M, std::max<int64_t>(1, mirrorsd::kParallelGrain / K), [&](int64_t begin, int64_t end) {
    float rest[kActGroup];
    for (int64_t m = begin; m < end; ++m) {
      const int64_t row = m * per_row;
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + m * K + g * kActGroup;
        int8_t* q = qp + row * K + g * kActGroup;
        int32_t* sum = sums + row * (K / 16) + 2 * g;
        const float scale = sp[row * groups + g] = quantize_group(src, q, sum);
        if (!split) continue;
        for (int64_t i = 0; i < kActGroup; ++i) rest[i] = src[i] - static_cast<float>(q[i]) * scale;
        sp[(row + 1) * groups + g] = quantize_group(rest, q + K, sum + K / 16);
      }
    }
  });
}

// Split rows: fold each pair of accumulator rows (a row's codes and its remainder's) into one.
void fold_pairs(float* acc, int64_t pairs) {
  for (int64_t j = 0; j < pairs; ++j)
    _mm512_storeu_ps(acc + j * kBlockN, _mm512_add_ps(_mm512_loadu_ps(acc + 2 * j * kBlockN),
                                                      _mm512_loadu_ps(acc + (2 * j + 1) * kBlockN)));
}

// Integer accumulators per activation row: vpdpbusd has a ~5-cycle latency, so a tile needs several independent
// chains. From 4 rows the rows themselves are enough, and each extra chain per row would cost one more add per row
// and group (1 chain instead of 2 at 8 rows: +7% at M = 8 and 16, measured). Integer sums are exact, so splitting
// them changes no result bit.
// On AVX2 a chain's only dependent instruction is a 1-cycle add (the multiplies feed it), so one chain is enough.
constexpr int chains_for(int mt, int steps) {
#if defined(__AVX512F__)
  const int want = mt >= 4 ? 1 : mt >= 2 ? 4 : 8;
#else
  const int want = 1;
#endif
  return want < steps ? want : steps;
}

// How many 16-output blocks ahead the kernel prefetches weights. Without it an 8-row product runs at half
// speed (the hardware prefetcher alone does not hide DRAM latency behind the block's compute); 1, 2 and 4
// blocks ahead measured alike within noise.
constexpr int64_t kPrefetchBlocks = 1;
// And the codes kL2PrefetchBlocks ahead into L2 only (a block is 3-12 KB: the L2 streamer stops at every 4 KB page,
// and one block of lead time into L1 is too little for a 1-row product). On a 2-core Xeon VM the 1.5B's q4 body
// went from ~42 to ~40 ms (with huge pages ~38) at one token; 2 and 3 blocks measured alike, 6 and 12 worse.
// A prefetch past a weight's last block is dropped by the CPU, never a fault.
constexpr int64_t kL2PrefetchBlocks = 2;

constexpr int planes_for(int bits) { return bits == 5 ? 1 : bits == 6 ? 2 : 0; }
constexpr int code_bits(int bits) { return bits == 8 ? 8 : 4; }  // bits per weight in the codes array

// One block of 16 outputs for MT activation rows. BITS = 4, 5, 6 or 8; G = 16 or 32 (weight group).
// Where a block's group scales live: one fp16 per group, or (TWO, two-level) an int8 sub-scale per group and an
// fp16 scale per `per_super` groups.
struct GroupScales {
  const void* scales;
  const void* offsets;  // nullptr: symmetric format (zero point folded into the integer dot, see quant_tile)
  const uint16_t* super_scales;
  const uint16_t* super_offsets;
  int64_t per_super;
};

template <bool TWO>
__m512 load_scales(const void* base, const uint16_t* super, int64_t g, int64_t sup) {
  if constexpr (TWO) {
    const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + g * kBlockN))));
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + sup * kBlockN)));
    return _mm512_mul_ps(d, sub);
  } else {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + g * kBlockN)));
  }
}

// Step s (4 k for 16 outputs: one 64-byte vector of u8 codes) of a weight group's codes, unpacked for the integer dot.
// 8-bit codes are stored that way; 4-bit codes hold step 2p in the low nibbles of vector p and step 2p+1 in the high
// nibbles, and 5/6-bit codes add their high bits from the planes.
template <int BITS>
inline __m512i code_step(const uint8_t* c, const uint64_t* pl, int s) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(c + s * 64);
  } else {
    constexpr int P = planes_for(BITS);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i packed = _mm512_loadu_si512(c + (s / 2) * 64);
    __m512i wv = s % 2 ? _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4) : _mm512_and_si512(packed, low4);
    for (int b = 0; b < P; ++b)  // bit 4+b of each code, from its plane
      wv = _mm512_mask_add_epi8(wv, static_cast<__mmask64>(pl[s * P + b]), wv, _mm512_set1_epi8(0x10 << b));
    return wv;
  }
}

// One weight group's exact integer dot (`total`, 16 outputs of one activation row) into that row's float
// accumulator: the one epilogue both the VNNI tiles and the AMX tiles run, in the same order, so a row's bits never
// depend on which path computed its integer sums. xscale: the row's activation scale for the group; xsum: its
// dequantized activation sum (offset term, asymmetric formats only); half: kPairs' even group, until the odd one.
template <bool SYM, bool kPairs>
inline void group_epilogue(__m512& accf, __m512& half, __m512i total, __m512 sw, __m512 ow, float xscale, float xsum,
                           int64_t g) {
  const __m512 dot = _mm512_cvtepi32_ps(total);
  if constexpr (kPairs) {
    if (g % 2 == 0) {
      half = _mm512_mul_ps(dot, sw);
    } else {
      accf = _mm512_fmadd_ps(_mm512_fmadd_ps(dot, sw, half), _mm512_set1_ps(xscale), accf);
    }
  } else {
    const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(xscale));
    accf = _mm512_fmadd_ps(dot, scale, accf);
    if constexpr (!SYM) accf = _mm512_fmadd_ps(ow, _mm512_set1_ps(xsum), accf);
  }
}

// Symmetric formats (SYM: no offsets, W = scale * (code - Z)) take the zero point in integers: each row's chain
// starts at -Z * (the group's activation code sum), so the dot product is sum((code - Z) * a), exact, and the
// offset term needs no float work. With 16-weight groups (Q6_K) the two groups of one 32-wide activation group are
// combined with their weight scales first and multiply the activation scale once. Per row and 32 weights that is
// 5 float ops instead of 8 (Q6_K) or 3 instead of 4 (G = 32): the epilogue is what bounds an 8-row tile.
template <int MT, int BITS, int G, bool TWO, bool SYM>
void quant_tile(const int8_t* xq, const float* xs, const float* xsum, const int32_t* zsum, int64_t K,
                const uint8_t* codes, const uint64_t* planes, const GroupScales& gs, float* acc_out, bool prefetch) {
  static_assert(!SYM || G == kActGroup || 2 * G == kActGroup, "a symmetric group is 16 or 32 wide");
  constexpr int64_t kScaleBytes = TWO ? 1 : 2;  // per group and output
  constexpr int P = planes_for(BITS);
  constexpr int CB = code_bits(BITS);
  constexpr int kSteps = G / 4;  // vpdpbusd steps (4 k each) per weight group
  constexpr int A = chains_for(MT, kSteps);
  constexpr bool kPairs = SYM && 2 * G == kActGroup;  // two weight groups per activation scale
  // The largest code: two-level scales are the K-quants', whose codes have at most 6 bits (pack_quant checks).
  constexpr int kMaxCode = BITS != 8 ? (1 << BITS) - 1 : TWO ? 63 : 255;
  const int64_t groups = K / G;
  const int64_t act_groups = K / kActGroup;
  __m512 accf[MT];
  __m512 half[kPairs ? MT : 1];  // kPairs: the even group's scaled dot, until the odd group completes it
  for (int m = 0; m < MT; ++m) accf[m] = _mm512_setzero_ps();
  // Two-level scales: group g's super-group and its place in it, counted instead of divided out per group (a
  // 64-bit division per group; counting made 1- and 8-row products 3-10% faster hot in L2).
  const int64_t supers = TWO ? (groups + gs.per_super - 1) / gs.per_super : 0;
  int64_t sup = 0, in_sup = 0;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acci[MT][A];
    mirrorsd::CodeDots<kMaxCode, kSteps> dots[MT];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a)
        acci[m][a] = SYM && a == 0 ? _mm512_set1_epi32(zsum[m * groups + g]) : _mm512_setzero_si512();
    const int64_t k0 = g * G;
    const uint8_t* c = codes + g * G * kBlockN * CB / 8;
    const uint64_t* pl = planes + g * kSteps * P;
    if (prefetch) {  // pull a later block's matching lines while this one computes (DRAM latency hiding)
      const char* ahead = reinterpret_cast<const char*>(c) + kPrefetchBlocks * kBlockN * K * CB / 8;
      for (int line = 0; line < G * kBlockN * CB / 8; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      const char* far = reinterpret_cast<const char*>(c) + kL2PrefetchBlocks * kBlockN * K * CB / 8;
      for (int line = 0; line < G * kBlockN * CB / 8; line += 64) _mm_prefetch(far + line, _MM_HINT_T1);
      if constexpr (P > 0)  // kSteps * P * 8 bytes per group: at most one line
        _mm_prefetch(reinterpret_cast<const char*>(pl + kPrefetchBlocks * (K / 4) * P), _MM_HINT_T0);
      if ((g * kBlockN * kScaleBytes) % 64 == 0) {  // 16 scales per group: a line covers 2 (fp16) or 4 (int8)
        const int64_t ahead_bytes = (kPrefetchBlocks * groups + g) * kBlockN * kScaleBytes;
        _mm_prefetch(static_cast<const char*>(gs.scales) + ahead_bytes, _MM_HINT_T0);
        if (gs.offsets) _mm_prefetch(static_cast<const char*>(gs.offsets) + ahead_bytes, _MM_HINT_T0);
      }
      if constexpr (TWO) {
        if (in_sup == 0 && sup % 2 == 0) {  // 32 bytes of fp16 per super-group
          const int64_t ahead = (kPrefetchBlocks * supers + sup) * kBlockN;
          _mm_prefetch(reinterpret_cast<const char*>(gs.super_scales + ahead), _MM_HINT_T0);
          if (gs.offsets) _mm_prefetch(reinterpret_cast<const char*>(gs.super_offsets + ahead), _MM_HINT_T0);
        }
      }
    }
#pragma GCC unroll 8
    for (int s = 0; s < kSteps; ++s) {
      const __m512i wv = code_step<BITS>(c, pl, s);
      for (int m = 0; m < MT; ++m) {
        int32_t xv;  // four int8 activations, broadcast to every lane
        std::memcpy(&xv, xq + m * K + k0 + 4 * s, sizeof(xv));
        acci[m][s % A] = dots[m].add(acci[m][s % A], s, wv, _mm512_set1_epi32(xv));
      }
    }
    const __m512 sw = load_scales<TWO>(gs.scales, gs.super_scales, g, sup);
    const __m512 ow = SYM ? sw : load_scales<TWO>(gs.offsets, gs.super_offsets, g, sup);
    const int64_t ag = k0 / kActGroup;
    for (int m = 0; m < MT; ++m) {
      __m512i total = acci[m][0];
      for (int a = 1; a < A; ++a) total = _mm512_add_epi32(total, acci[m][a]);
      group_epilogue<SYM, kPairs>(accf[m], half[kPairs ? m : 0], total, sw, ow, xs[m * act_groups + ag],
                                  SYM ? 0.f : xsum[m * groups + g], g);
    }
    if (TWO && ++in_sup == gs.per_super) {
      in_sup = 0;
      ++sup;
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(acc_out + m * kBlockN, accf[m]);
}

using QuantTile = void (*)(const int8_t*, const float*, const float*, const int32_t*, int64_t, const uint8_t*,
                           const uint64_t*, const GroupScales&, float*, bool);

template <int BITS, int G, bool TWO, bool SYM>
constexpr QuantTile kQuantTiles[kTileTable] = {
    nullptr,
    quant_tile<1, BITS, G, TWO, SYM>, quant_tile<2, BITS, G, TWO, SYM>, quant_tile<3, BITS, G, TWO, SYM>,
    quant_tile<4, BITS, G, TWO, SYM>, quant_tile<5, BITS, G, TWO, SYM>, quant_tile<6, BITS, G, TWO, SYM>,
    quant_tile<7, BITS, G, TWO, SYM>, quant_tile<8, BITS, G, TWO, SYM>};

template <bool SYM>
QuantTile pick_layout(int64_t bits, int64_t group, bool two_level, int64_t rows) {
  if (two_level) {
    if (bits == 4 && group == 32) return kQuantTiles<4, 32, true, SYM>[rows];
    if (bits == 5 && group == 32) return kQuantTiles<5, 32, true, SYM>[rows];
    if (bits == 6 && group == 16) return kQuantTiles<6, 16, true, SYM>[rows];
    if (bits == 8 && group == 32) return kQuantTiles<8, 32, true, SYM>[rows];
    if (bits == 8 && group == 16) return kQuantTiles<8, 16, true, SYM>[rows];
    TORCH_CHECK(false, "two-level scales need a K-quant layout (bits/group 4/32, 5/32, 6/16, 8/32, 8/16), got ", bits,
                "/", group);
  }
  if (bits == 4 && group == 32) return kQuantTiles<4, 32, false, SYM>[rows];
  if (bits == 5 && group == 32) return kQuantTiles<5, 32, false, SYM>[rows];
  if (bits == 6 && group == 16) return kQuantTiles<6, 16, false, SYM>[rows];
  if (bits == 6 && group == 32) return kQuantTiles<6, 32, false, SYM>[rows];
  if (bits == 8 && group == 32) return kQuantTiles<8, 32, false, SYM>[rows];
  if (bits == 8 && group == 16) return kQuantTiles<8, 16, false, SYM>[rows];
  TORCH_CHECK(false, "unsupported quantized layout: bits=", bits, " group=", group);
}

// Two-level scales exist for the K-quant layouts only: Q4_K (4/32), Q5_K (5/32), Q6_K (6/16), and Q5_K/Q6_K codes kept
// in whole bytes (8/32, 8/16; kernels.code_widths).
QuantTile pick_tile(int64_t bits, int64_t group, bool two_level, bool symmetric, int64_t rows) {
  return symmetric ? pick_layout<true>(bits, group, two_level, rows) : pick_layout<false>(bits, group, two_level, rows);
}

// One 16-output block of weight w for every quantized row, VNNI tiles of up to kMaxTile rows, into out [M, w.N].
// term: the weight's per-row, per-group table (offset sums or zero-point sums, see linear_into); next: whether the
// thread computes w's next block after this one (worth prefetching).
void vnni_block(const mirrorsd::QuantWeight& w, int64_t nb, const int8_t* qp, const float* sp, const void* term,
                int64_t rows_q, bool split, bool next, float* out) {
  alignas(64) float acc[kMaxTile * kBlockN];
  const int64_t K = w.K, groups = K / w.group, act_groups = K / kActGroup;
  const bool symmetric = w.offsets == nullptr;
  const float* xsp = symmetric ? nullptr : static_cast<const float*>(term);
  const int32_t* zsp = symmetric ? static_cast<const int32_t*>(term) : nullptr;
  const GroupScales gs{w.scales + nb * w.scale_block, w.offsets ? w.offsets + nb * w.scale_block : nullptr,
                       w.super_scales ? w.super_scales + nb * w.super_block : nullptr,
                       w.super_offsets ? w.super_offsets + nb * w.super_block : nullptr, w.per_super};
  for (int64_t m0 = 0; m0 < rows_q; m0 += kMaxTile) {  // kMaxTile is even: split pairs share a tile
    const int64_t rows = std::min<int64_t>(kMaxTile, rows_q - m0);
    const bool prefetch = kPrefetchBlocks > 0 && m0 == 0 && next;
    pick_tile(w.bits, w.group, w.two_level, symmetric, rows)(
        qp + m0 * K, sp + m0 * act_groups, symmetric ? nullptr : xsp + m0 * groups,
        symmetric ? zsp + m0 * groups : nullptr, K, w.codes + nb * w.code_block,
        w.planes ? w.planes + nb * w.plane_block : nullptr, gs, acc, prefetch);
    if (split) fold_pairs(acc, rows / 2);
    const int64_t out_rows = split ? rows / 2 : rows, out_m0 = split ? m0 / 2 : m0;
    store_block(acc, out_rows, out + out_m0 * w.N, w.N, nb * kBlockN, w.bias);
  }
}

#if defined(__AMX_INT8__)
// ---------------------------------------------------------------- AMX tiles (Intel Sapphire Rapids and later)
// Multi-row calls on CPUs with AMX-INT8. One tile multiply (tdpbsud: s8 activations x u8 codes into int32) gives a
// weight group's exact integer dots for 16 activation rows and 16 outputs, where VNNI spends G/4 instructions per row.
// The codes' 64-byte steps (4 k of 16 outputs) are already a B tile's rows: 8-bit codes load straight from the weight;
// 4/5/6-bit codes are unpacked once per 16-output block into a per-thread buffer (code_step, as VNNI unpacks them),
// so the weights keep their packed size in memory and a one-token step reads no more bytes. Each group's int32 sums
// then go through VNNI's own group_epilogue, group after group in the same order: a row's bits do not depend on the
// path or on how many rows came with it (the cross-build bit test checks every layout for 1-64 rows).

constexpr int64_t kAmxRows = 16;  // rows of an A (activations) and a C (int32 sums) tile
// From how many quantized rows (2 per row with split) linear_into takes the AMX path. Measured on a 2-core Sapphire
// Rapids VM (benchmarks/amx_crossover.py, docs/benchmarks.md): whole 1.5B q4 forwards through the tiles cost 1.81x
// VNNI's at 1-4 rows, 1.43x at 8, 1.29x at 16, 0.65x at 32, and a 512-token prompt 0.85x. Each group of 32 weights
// still needs its own tile store and float epilogue (activation scales are per 32), which bounds the tiles at few
// rows. set_amx_min_rows moves it (the bit tests force 1).
int64_t amx_min_rows = 32;

// ldtilecfg's 64-byte operand: tiles 0-3 hold C (four groups in flight), 4-5 A and 6-7 B (alternating).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Load this thread's tile shapes (groups of 32 weights). Done per call (not cached per thread): other libraries on
// the same threads (oneDNN's AMX GEMMs) configure the tiles their own way in between.
// Not through _tile_loadconfig: GCC 12's intrinsic declares that ldtilecfg reads 8 of its 64 bytes, so the compiler
// may drop the stores of the shapes and the next tile instruction faults (SIGILL). That is what kills llama.cpp's AMX
// path built with GCC 12 here (its config is all zeros but the palette in the disassembly); the asm below names
// all 64 bytes as read.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 6 ? kAmxRows : kActGroup / 4;
    cfg.colsb[t] = t >= 4 && t < 6 ? kActGroup : 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// Tile numbers are immediates in the instructions, so the two group shapes are spelt out: `n` = 4 groups in flight
// (C 0-3), or one (C 0). a: the rows' codes at the first group, lda = K; b: the first group's B tile (8 x 64 bytes).
inline void amx_dots(const int8_t* a, int64_t lda, const uint8_t* b, int n, int32_t* dots) {
  constexpr int64_t G = kActGroup;
  constexpr int64_t kB = G * kBlockN;  // bytes of one group's B tile
  if (n == 4) {
    _tile_loadd(4, a, lda);
    _tile_loadd(6, b, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 4, 6);
    _tile_loadd(5, a + G, lda);
    _tile_loadd(7, b + kB, 64);
    _tile_zero(1);
    _tile_dpbsud(1, 5, 7);
    _tile_loadd(4, a + 2 * G, lda);
    _tile_loadd(6, b + 2 * kB, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 4, 6);
    _tile_loadd(5, a + 3 * G, lda);
    _tile_loadd(7, b + 3 * kB, 64);
    _tile_zero(3);
    _tile_dpbsud(3, 5, 7);
    _tile_stored(0, dots, 64);
    _tile_stored(1, dots + kAmxRows * kBlockN, 64);
    _tile_stored(2, dots + 2 * kAmxRows * kBlockN, 64);
    _tile_stored(3, dots + 3 * kAmxRows * kBlockN, 64);
  } else {
    _tile_loadd(4, a, lda);
    _tile_loadd(6, b, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 4, 6);
    _tile_stored(0, dots, 64);
  }
}

// One 16-output block of a weight in groups of 32 for `rows` quantized rows into acc [rows, 16], each row exactly as
// quant_tile computes it. xq holds at least ceil(rows / 16) * 16 rows (A tiles always load 16; the rows past `rows`
// are never read back).
template <int BITS, bool TWO, bool SYM>
void amx_block(const int8_t* xq, int64_t rows, const float* xs, const float* xsum, const int32_t* zsum, int64_t K,
               const uint8_t* codes, const uint64_t* planes, const GroupScales& gs, float* acc, uint8_t* unpacked,
               int32_t* dots, int64_t next_block_bytes) {
  constexpr int G = kActGroup;
  constexpr int P = planes_for(BITS);
  constexpr int CB = code_bits(BITS);
  constexpr int kSteps = G / 4;
  constexpr int64_t kGroupCodes = G * kBlockN * CB / 8;  // bytes of one group's packed codes
  const int64_t groups = K / G, act_groups = K / kActGroup;
  const uint8_t* b = codes;
  if constexpr (BITS != 8) {  // unpack the block's codes once for all its rows, prefetching the next block's
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = codes + g * kGroupCodes;
      if (next_block_bytes)
        for (int line = 0; line < kGroupCodes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(c) + next_block_bytes + line, _MM_HINT_T0);
      for (int s = 0; s < kSteps; ++s)
        _mm512_store_si512(unpacked + (g * kSteps + s) * 64, code_step<BITS>(c, planes + g * kSteps * P, s));
    }
    b = unpacked;
  }
  for (int64_t m0 = 0; m0 < rows; m0 += kAmxRows) {
    const int64_t valid = std::min<int64_t>(kAmxRows, rows - m0);
    for (int64_t g0 = 0; g0 < groups;) {
      const int n = groups - g0 >= 4 ? 4 : 1;
      if (BITS == 8 && m0 == 0 && next_block_bytes)
        for (int line = 0; line < n * kGroupCodes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(codes + g0 * kGroupCodes) + next_block_bytes + line, _MM_HINT_T0);
      amx_dots(xq + m0 * K + g0 * G, K, b + g0 * G * kBlockN, n, dots);
      __m512 sw[4], ow[4];
      for (int j = 0; j < n; ++j) {
        const int64_t g = g0 + j, sup = TWO ? g / gs.per_super : 0;
        sw[j] = load_scales<TWO>(gs.scales, gs.super_scales, g, sup);
        ow[j] = SYM ? sw[j] : load_scales<TWO>(gs.offsets, gs.super_offsets, g, sup);
      }
      for (int64_t m = 0; m < valid; ++m) {
        const int64_t row = m0 + m;
        __m512 accf = g0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(acc + row * kBlockN);
        __m512 no_pairs = _mm512_setzero_ps();  // group pairing is for 16-wide groups, which never come here
        for (int j = 0; j < n; ++j) {
          const int64_t g = g0 + j;
          __m512i total = _mm512_load_si512(dots + (j * kAmxRows + m) * kBlockN);
          if constexpr (SYM) total = _mm512_add_epi32(_mm512_set1_epi32(zsum[row * groups + g]), total);
          group_epilogue<SYM, false>(accf, no_pairs, total, sw[j], ow[j], xs[row * act_groups + g],
                                     SYM ? 0.f : xsum[row * groups + g], g);
        }
        _mm512_store_ps(acc + row * kBlockN, accf);
      }
      g0 += n;
    }
  }
}

using AmxBlock = void (*)(const int8_t*, int64_t, const float*, const float*, const int32_t*, int64_t, const uint8_t*,
                          const uint64_t*, const GroupScales&, float*, uint8_t*, int32_t*, int64_t);

template <bool TWO, bool SYM>
AmxBlock pick_amx_scales(int64_t bits) {
  if (bits == 4) return amx_block<4, TWO, SYM>;
  if (bits == 5) return amx_block<5, TWO, SYM>;
  if (bits == 8) return amx_block<8, TWO, SYM>;
  if (!TWO && bits == 6) return amx_block<6, TWO, SYM>;
  TORCH_CHECK(false, "unsupported quantized layout for AMX: bits=", bits, " group=32 two-level=", TWO);
}

// Weights in groups of 32 (the callers send groups of 16 to VNNI).
AmxBlock pick_amx(int64_t bits, bool two_level, bool symmetric) {
  if (two_level) return symmetric ? pick_amx_scales<true, true>(bits) : pick_amx_scales<true, false>(bits);
  return symmetric ? pick_amx_scales<false, true>(bits) : pick_amx_scales<false, false>(bits);
}

// Rows per panel of an AMX call: a thread runs its blocks over one panel of rows at a time, so the panel's activation
// codes (about kAmxPanelBytes) stay in L2 across blocks instead of every block streaming all rows' (a 512-token
// prompt's 4.5 MB for the MLP's down projection), while a block's codes are unpacked once per panel. A multiple of 16
// (whole A tiles), so even: split pairs stay together.
constexpr int64_t kAmxPanelBytes = 512 * 1024;
int64_t amx_panel(int64_t K) { return std::max<int64_t>(kAmxRows, kAmxPanelBytes / K / kAmxRows * kAmxRows); }

// linear_into's multi-row path: every weight's blocks split over the threads as VNNI's are, each block computing a
// panel of rows (int32 sums by tiles, VNNI's epilogue), then VNNI's split fold and store. Weights in groups of 16
// (Q6_K) stay on VNNI tiles: a 16-deep tile multiply does half the work per tile store, and measured no faster.
void amx_linears(const int8_t* qp, const float* sp, const void* const* term, int64_t rows_q, int64_t K, bool split,
                 const mirrorsd::QuantWeight* weights, const int64_t* first, int64_t count, float* const* outs) {
  at::parallel_for(0, first[count], 1, [&](int64_t begin, int64_t end) {
    static thread_local mirrorsd::Scratch scratch;
    scratch.rewind();
    uint8_t* unpacked = scratch.take<uint8_t>(K * kBlockN);
    int32_t* dots = scratch.take<int32_t>(4 * kAmxRows * kBlockN);
    const int64_t panel = amx_panel(K);
    float* acc = scratch.take<float>(panel * kBlockN);
    const int64_t act_groups = K / kActGroup;
    bool configured = false;
    for (int64_t p0 = 0; p0 < rows_q; p0 += panel) {
      const int64_t rows = std::min<int64_t>(panel, rows_q - p0);
      int64_t wi = 0;
      for (int64_t b = begin; b < end; ++b) {
        while (b >= first[wi + 1]) ++wi;
        const mirrorsd::QuantWeight& w = weights[wi];
        const int64_t nb = b - first[wi], groups = K / w.group;
        const bool next = b + kPrefetchBlocks < std::min(end, first[wi + 1]);
        if (w.group != kActGroup) {  // VNNI, all rows at once
          if (p0 == 0) vnni_block(w, nb, qp, sp, term[wi], rows_q, split, next, outs[wi]);
          continue;
        }
        if (!configured) {
          configure_tiles();
          configured = true;
        }
        const bool symmetric = w.offsets == nullptr;
        const GroupScales gs{w.scales + nb * w.scale_block, w.offsets ? w.offsets + nb * w.scale_block : nullptr,
                             w.super_scales ? w.super_scales + nb * w.super_block : nullptr,
                             w.super_offsets ? w.super_offsets + nb * w.super_block : nullptr, w.per_super};
        pick_amx(w.bits, w.two_level, symmetric)(
            qp + p0 * K, rows, sp + p0 * act_groups,
            symmetric ? nullptr : static_cast<const float*>(term[wi]) + p0 * groups,
            symmetric ? static_cast<const int32_t*>(term[wi]) + p0 * groups : nullptr, K,
            w.codes + nb * w.code_block, w.planes ? w.planes + nb * w.plane_block : nullptr, gs, acc, unpacked, dots,
            next ? kPrefetchBlocks * w.code_block : 0);
        if (split) fold_pairs(acc, rows / 2);
        store_block(acc, split ? rows / 2 : rows, outs[wi] + (split ? p0 / 2 : p0) * w.N, w.N, nb * kBlockN,
                    w.bias);
      }
    }
    if (configured) _tile_release();
  });
}
#endif  // __AMX_INT8__

bool supported_layout(int64_t bits, int64_t group) {
  return (group == 32 && (bits == 4 || bits == 5 || bits == 6 || bits == 8)) || (group == 16 && (bits == 6 || bits == 8));
}

}  // namespace

// Called from Python through the ops below, and by the fused decoder block (cpu_block.cpp) directly.
namespace mirrorsd {

QuantWeight check_weight(int64_t K, const torch::Tensor& codes, const std::optional<torch::Tensor>& planes,
                         const torch::Tensor& scales, const std::optional<torch::Tensor>& offsets,
                         const std::optional<torch::Tensor>& super_scales,
                         const std::optional<torch::Tensor>& super_offsets, const std::optional<torch::Tensor>& bias,
                         int64_t N, int64_t bits, int64_t group, int64_t zero) {
  check_bias(bias, N);
  TORCH_CHECK(supported_layout(bits, group), "unsupported quantized layout: bits=", bits, " group=", group);
  const int64_t n_planes = bits == 5 ? 1 : bits == 6 ? 2 : 0;
  const int64_t cbits = bits == 8 ? 8 : 4;
  TORCH_CHECK(offsets ? zero == 0 : zero > 0, "give offsets, or zero > 0 for a symmetric format (offset = -zero * scale)");
  TORCH_CHECK(scales.is_contiguous() && (!offsets || offsets->is_contiguous()), "scales/offsets must be contiguous");
  TORCH_CHECK(K > 0 && K % kActGroup == 0 && K % group == 0,
              "K must be a positive multiple of 32 and of the group size");
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  const int64_t blocks = codes.size(0);
  TORCH_CHECK(codes.numel() == blocks * kBlockN * K * cbits / 8, "codes do not match [N/16, K] at ", bits, " bits");
  TORCH_CHECK(n_planes == 0 || (planes && planes->scalar_type() == torch::kLong && planes->is_contiguous() &&
                                planes->numel() == blocks * (K / 4) * n_planes),
              bits, "-bit codes need contiguous int64 bit planes [N/16, K/4, ", n_planes, "]");
  const bool two_level = super_scales.has_value();
  const auto sub_type = two_level ? torch::kChar : torch::kHalf;
  TORCH_CHECK(scales.scalar_type() == sub_type && (!offsets || offsets->scalar_type() == sub_type),
              "scales/offsets must be fp16, or int8 sub-scales with super_scales");
  TORCH_CHECK(scales.numel() == blocks * (K / group) * kBlockN && (!offsets || offsets->numel() == scales.numel()),
              "scales/offsets must be [N/16, K/G, 16]");
  TORCH_CHECK(!super_offsets || two_level, "super_offsets need super_scales");
  TORCH_CHECK(!two_level || (offsets.has_value() == super_offsets.has_value()),
              "two-level offsets need super_offsets (and super_offsets need offsets)");
  int64_t per_super = 1;
  if (two_level) {
    TORCH_CHECK(super_scales->scalar_type() == torch::kHalf && super_scales->is_contiguous() &&
                    super_scales->dim() == 3 && super_scales->size(0) == blocks && super_scales->size(2) == kBlockN &&
                    super_scales->size(1) > 0 && (K / group) % super_scales->size(1) == 0,
                "super_scales must be contiguous fp16 [N/16, K/S, 16] with S a multiple of the group size");
    TORCH_CHECK(!super_offsets || (super_offsets->scalar_type() == torch::kHalf && super_offsets->is_contiguous() &&
                                   super_offsets->sizes() == super_scales->sizes()),
                "super_offsets must be contiguous fp16 shaped like super_scales");
    per_super = (K / group) / super_scales->size(1);
    const bool k_quant = (bits == 4 || bits == 5) ? group == 32 : bits == 6 ? group == 16 : group == 16 || group == 32;
    TORCH_CHECK(k_quant, "two-level scales need a K-quant layout (bits/group 4/32, 5/32, 6/16, 8/32, 8/16), got ", bits,
                "/", group);
  }
  TORCH_CHECK(blocks * kBlockN >= N && blocks * kBlockN < N + kBlockN, "packed weight does not hold N rows");
  const auto half_ptr = [](const std::optional<torch::Tensor>& t) {
    return t ? reinterpret_cast<const uint16_t*>(t->data_ptr<at::Half>()) : nullptr;
  };
  QuantWeight w;
  w.K = K;
  w.N = N;
  w.bits = bits;
  w.group = group;
  w.blocks = blocks;
  w.two_level = two_level;
  w.codes = codes.data_ptr<uint8_t>();
  w.planes = n_planes ? reinterpret_cast<const uint64_t*>(planes->data_ptr<int64_t>()) : nullptr;
  w.scales = static_cast<const char*>(scales.data_ptr());
  w.offsets = offsets ? static_cast<const char*>(offsets->data_ptr()) : nullptr;
  w.super_scales = half_ptr(super_scales);
  w.super_offsets = half_ptr(super_offsets);
  w.bias = bias ? bias->data_ptr<float>() : nullptr;
  w.per_super = per_super;
  w.zero = zero;
  w.code_block = kBlockN * K * cbits / 8;
  w.plane_block = (K / 4) * n_planes;
  w.scale_block = (K / group) * kBlockN * (two_level ? 1 : 2);
  w.super_block = two_level ? super_scales->size(1) * kBlockN : 0;
  return w;
}

QuantWeight check_f32_weight(int64_t K, const torch::Tensor& packed, const std::optional<torch::Tensor>& bias,
                             int64_t N) {
  check_bias(bias, N);
  TORCH_CHECK(packed.scalar_type() == torch::kFloat, "w must be fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.size(1) == K && packed.is_contiguous(),
              "w must be packed fp32 [N/16, K, 16]");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(blocks * kBlockN >= N && blocks * kBlockN < N + kBlockN, "packed weight does not hold N rows");
  QuantWeight w;
  w.K = K;
  w.N = N;
  w.bits = 32;
  w.blocks = blocks;
  w.f32 = packed.data_ptr<float>();
  w.bias = bias ? bias->data_ptr<float>() : nullptr;
  return w;
}

void linear_into(const float* x, int64_t M, int64_t K, const QuantWeight* weights, int64_t count, float* const* outs,
                 bool split) {
  TORCH_CHECK(count >= 1 && count <= kMaxSharedWeights, "linear_into: 1 to ", kMaxSharedWeights, " weights");
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(weights[i].K == K, "every weight must take x's ", K, " inputs");
  const bool f32 = weights[0].f32 != nullptr;
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK((weights[i].f32 != nullptr) == f32, "linear_into: the weights must be all quantized or all fp32");
  if (f32) {
    f32_linears_into(x, M, K, weights, count, outs);
    return;
  }
  // The activations' codes and the tables below live in memory this thread reuses: a call allocates nothing.
  static thread_local Scratch scratch;
  scratch.rewind();
  const int64_t rows_q = split ? 2 * M : M;  // quantized rows
#if defined(__AMX_INT8__)
  const bool amx = rows_q >= amx_min_rows;
#else
  constexpr bool amx = false;
#endif
  // AMX tiles load 16 rows at a time: room for the last tile's rows past rows_q (never read back)
  int8_t* qp = scratch.take<int8_t>((amx ? (rows_q + 15) / 16 * 16 : rows_q) * K);
  float* sp = scratch.take<float>(rows_q * (K / kActGroup));
  int32_t* sums = scratch.take<int32_t>(rows_q * (K / 16));
  quantize_acts(x, M, K, split, qp, sp, sums);
  // Per row and weight group, from the 16-code sums: for asymmetric weights the dequantized activations' sum (their
  // offset term; fp32, made once per group size), for symmetric ones -zero times the code sum, where their integer
  // dots start (int32, once per group size and zero point). Then each weight's pointer to its table.
  int64_t keys[kMaxSharedWeights][2];  // (group, zero or 0) of each table made
  const void* tables[kMaxSharedWeights];
  const void* term[kMaxSharedWeights];  // per weight
  int64_t made = 0;
  for (int64_t i = 0; i < count; ++i) {
    const QuantWeight& w = weights[i];
    const bool symmetric = w.offsets == nullptr;
    const int64_t zero = symmetric ? w.zero : 0;
    int64_t found = 0;
    while (found < made && !(keys[found][0] == w.group && keys[found][1] == zero)) ++found;
    if (found == made) {
      const int64_t groups = K / w.group, halves = w.group / 16;  // 16-code sums per weight group
      int32_t* zp = symmetric ? scratch.take<int32_t>(rows_q * groups) : nullptr;
      float* fp = symmetric ? nullptr : scratch.take<float>(rows_q * groups);
      for (int64_t m = 0; m < rows_q; ++m)
        for (int64_t g = 0; g < groups; ++g) {
          int32_t total = 0;
          for (int64_t h = 0; h < halves; ++h) total += sums[m * (K / 16) + g * halves + h];
          if (symmetric)
            zp[m * groups + g] = static_cast<int32_t>(-w.zero * total);
          else
            fp[m * groups + g] = sp[m * (K / kActGroup) + g * w.group / kActGroup] * static_cast<float>(total);
        }
      keys[made][0] = w.group;
      keys[made][1] = zero;
      tables[made++] = symmetric ? static_cast<const void*>(zp) : static_cast<const void*>(fp);
    }
    term[i] = tables[found];
  }
  int64_t first[kMaxSharedWeights + 1] = {0};  // the weights' blocks end to end: one parallel region covers them all
  for (int64_t i = 0; i < count; ++i) first[i + 1] = first[i] + weights[i].blocks;
#if defined(__AMX_INT8__)
  if (amx) {
    amx_linears(qp, sp, term, rows_q, K, split, weights, first, count, outs);
    return;
  }
#endif
  at::parallel_for(0, first[count], 1, [&](int64_t begin, int64_t end) {
    int64_t wi = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (b >= first[wi + 1]) ++wi;
      vnni_block(weights[wi], b - first[wi], qp, sp, term[wi], rows_q, split,
                 b + kPrefetchBlocks < std::min(end, first[wi + 1]), outs[wi]);
    }
  });
}

}  // namespace mirrorsd

namespace {

torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                         int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  const mirrorsd::QuantWeight weight = mirrorsd::check_f32_weight(x.size(1), w, bias, N);
  auto y = torch::empty({x.size(0), N}, x.options());
  float* out = y.data_ptr<float>();
  mirrorsd::linear_into(x.data_ptr<float>(), x.size(0), x.size(1), &weight, 1, &out, false);
  return y;
}

torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& codes, const std::optional<torch::Tensor>& planes,
                           const torch::Tensor& scales, const std::optional<torch::Tensor>& offsets,
                           const std::optional<torch::Tensor>& super_scales,
                           const std::optional<torch::Tensor>& super_offsets, const std::optional<torch::Tensor>& bias,
                           int64_t N, int64_t bits, int64_t group, bool split, int64_t zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  const mirrorsd::QuantWeight w = mirrorsd::check_weight(x.size(1), codes, planes, scales, offsets, super_scales,
                                                         super_offsets, bias, N, bits, group, zero);
  auto y = torch::empty({x.size(0), N}, x.options());
  float* out = y.data_ptr<float>();
  mirrorsd::linear_into(x.data_ptr<float>(), x.size(0), x.size(1), &w, 1, &out, split);
  return y;
}

// The row count from which multi-row calls take AMX tiles (measurements, tests); returns the previous one, or -1 in
// a build without AMX (where nothing changes).
int64_t set_amx_min_rows(int64_t rows) {
#if defined(__AMX_INT8__)
  TORCH_CHECK(rows >= 1, "set_amx_min_rows: at least 1 row");
  const int64_t previous = amx_min_rows;
  amx_min_rows = rows;
  return previous;
#else
  return -1;
#endif
}

}  // namespace

// Registered for the CPU dispatch key only: a CUDA (or meta) tensor gets the dispatcher's clear error instead
// of a device pointer dereferenced on the host.
TORCH_LIBRARY(mirrorsd, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("linear_quant(Tensor x, Tensor codes, Tensor? planes, Tensor scales, Tensor? offsets, Tensor? super_scales, "
        "Tensor? super_offsets, Tensor? bias, int n, int bits, int group, bool split=False, int zero=0) -> Tensor");
  m.def("set_amx_min_rows(int rows) -> int", set_amx_min_rows);
}

TORCH_LIBRARY_IMPL(mirrorsd, CPU, m) {
  m.impl("linear_f32", linear_f32);
  m.impl("linear_quant", linear_quant);
}
