// CPUs without AVX-512 (AMD Zen 2/3, most Intel client cores): the AVX-512 intrinsics the kernels are written in,
// each on a pair of 256-bit AVX2 registers, so one source serves both. Integer results are exact whatever the
// width, and every float operation is the same IEEE operation per lane (FMA stays one rounding; the reductions
// follow GCC's own _mm512_reduce_* trees), so a model computes the same bits here as on an AVX-512 machine.
// SIMDe offers most of these, but not the reductions, kortestz or cvt_roundps, and its masked loads and stores read
// and write the whole vector; the tails here use AVX's fault-free maskload/maskstore instead.
// Only the names the kernels use are defined, as macros over mirrorsd::avx2 (SIMDe's "native aliases" pattern).

#pragma once

#if defined(__AVX512F__)
#error "cpu_avx2.h is for builds without AVX-512"
#endif

#include <immintrin.h>

#include <cstdint>

namespace mirrorsd::avx2 {

struct f32x16 {
  __m256 lo, hi;
};
struct i32x16 {
  __m256i lo, hi;
};
struct f64x8 {
  __m256d lo, hi;
};

#define MIRRORSD_INLINE inline __attribute__((always_inline))

MIRRORSD_INLINE f32x16 set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
MIRRORSD_INLINE f32x16 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
MIRRORSD_INLINE f32x16 loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
MIRRORSD_INLINE void storeu_ps(float* p, f32x16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

#define MIRRORSD_F32_BINARY(name, op) \
  MIRRORSD_INLINE f32x16 name(f32x16 a, f32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
MIRRORSD_F32_BINARY(add_ps, _mm256_add_ps)
MIRRORSD_F32_BINARY(sub_ps, _mm256_sub_ps)
MIRRORSD_F32_BINARY(mul_ps, _mm256_mul_ps)
MIRRORSD_F32_BINARY(div_ps, _mm256_div_ps)
MIRRORSD_F32_BINARY(max_ps, _mm256_max_ps)
#undef MIRRORSD_F32_BINARY

MIRRORSD_INLINE f32x16 fmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
MIRRORSD_INLINE f32x16 fnmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
MIRRORSD_INLINE f32x16 abs_ps(f32x16 a) {
  const __m256 bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, bits), _mm256_and_ps(a.hi, bits)};
}

// Masks: bit i of a 16-bit mask is lane i (lanes 0-7 in lo, 8-15 in hi); as a vector, all ones where set.
MIRRORSD_INLINE __m256i lanes_of(uint32_t bits8) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits8)), lane_bit), lane_bit);
}
MIRRORSD_INLINE f32x16 maskz_loadu_ps(uint16_t k, const float* p) {  // masked-off lanes are never read
  return {_mm256_maskload_ps(p, lanes_of(k & 0xFFu)), _mm256_maskload_ps(p + 8, lanes_of(k >> 8))};
}
MIRRORSD_INLINE void mask_storeu_ps(float* p, uint16_t k, f32x16 v) {  // masked-off lanes are never written
  _mm256_maskstore_ps(p, lanes_of(k & 0xFFu), v.lo);
  _mm256_maskstore_ps(p + 8, lanes_of(k >> 8), v.hi);
}
MIRRORSD_INLINE f32x16 mask_blend_ps(uint16_t k, f32x16 a, f32x16 b) {  // b where k is set, else a
  return {_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(lanes_of(k & 0xFFu))),
          _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(lanes_of(k >> 8)))};
}
MIRRORSD_INLINE f32x16 mask_add_ps(f32x16 src, uint16_t k, f32x16 a, f32x16 b) {  // a + b where k is set, else src
  return mask_blend_ps(k, src, add_ps(a, b));
}
template <int kPredicate>
MIRRORSD_INLINE uint16_t cmp_ps_mask(f32x16 a, f32x16 b) {
  return static_cast<uint16_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kPredicate)) |
                               (_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kPredicate)) << 8));
}
MIRRORSD_INLINE int kortestz(uint16_t a, uint16_t b) { return (a | b) == 0; }

// x * 2^n with one rounding, as vscalefps gives it, for exp16's domain only: finite integral |n| <= 252 (not NaN,
// infinities or fractions, which vscalefps also handles). 2^n in two factors, each a normal float, exact products
// until the last, as ggml's AVX2 expf does; exp16 blends |n| > 192 away. The empty asm keeps the compiler from
// contracting the product into a neighbouring add (vscalefps is never fused).
MIRRORSD_INLINE __m256 scalef8(__m256 x, __m256 n) {
  const __m256i k = _mm256_cvttps_epi32(n);
  const __m256i k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  __m256 r = _mm256_mul_ps(_mm256_mul_ps(x, pow2(k1)), pow2(k2));
  __asm__("" : "+x"(r));
  return r;
}
MIRRORSD_INLINE f32x16 scalef_ps(f32x16 x, f32x16 n) { return {scalef8(x.lo, n.lo), scalef8(x.hi, n.hi)}; }

// 128-bit lane i & 3 of v.
MIRRORSD_INLINE __m128 lane128(f32x16 v, int i) {
  switch (i & 3) {
    case 0: return _mm256_castps256_ps128(v.lo);
    case 1: return _mm256_extractf128_ps(v.lo, 1);
    case 2: return _mm256_castps256_ps128(v.hi);
    default: return _mm256_extractf128_ps(v.hi, 1);
  }
}
// 128-bit lane i of the result is lane (kImm >> 2i) & 3 of a (i < 2) or of b (i >= 2).
template <int kImm>
MIRRORSD_INLINE f32x16 shuffle_f32x4(f32x16 a, f32x16 b) {
  return {_mm256_set_m128(lane128(a, kImm >> 2), lane128(a, kImm)),
          _mm256_set_m128(lane128(b, kImm >> 6), lane128(b, kImm >> 4))};
}
template <int kImm>
MIRRORSD_INLINE f32x16 shuffle_ps(f32x16 a, f32x16 b) {
  return {_mm256_shuffle_ps(a.lo, b.lo, kImm), _mm256_shuffle_ps(a.hi, b.hi, kImm)};
}

// GCC's __MM512_REDUCE_OP tree: 256-bit halves, then 128-bit halves, then pairs (2,3,0,1), then lanes 0 and 1.
MIRRORSD_INLINE __m128 reduce_to_128(__m256 v) { return _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v)); }
MIRRORSD_INLINE float reduce_add_ps(f32x16 v) {
  const __m128 t6 = reduce_to_128(_mm256_add_ps(v.hi, v.lo));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
}
MIRRORSD_INLINE float reduce_max_ps(f32x16 v) {  // the same tree (and operand order, for NaNs)
  const __m256 m8 = _mm256_max_ps(v.hi, v.lo);
  const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
  const __m128 m2 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(m2, _mm_shuffle_ps(m2, m2, _MM_SHUFFLE(0, 1, 0, 1))));
}

MIRRORSD_INLINE __m256 castps512_ps256(f32x16 v) { return v.lo; }
MIRRORSD_INLINE f64x8 castps_pd(f32x16 v) { return {_mm256_castps_pd(v.lo), _mm256_castps_pd(v.hi)}; }
MIRRORSD_INLINE __m256d extractf64x4_pd(f64x8 v, int i) { return i ? v.hi : v.lo; }

// Integers.
MIRRORSD_INLINE i32x16 set1_epi32(int v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
MIRRORSD_INLINE i32x16 set1_epi8(char v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
MIRRORSD_INLINE i32x16 setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
MIRRORSD_INLINE i32x16 loadu_si512(const void* p) {
  const auto* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
MIRRORSD_INLINE i32x16 and_si512(i32x16 a, i32x16 b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
MIRRORSD_INLINE i32x16 add_epi32(i32x16 a, i32x16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
MIRRORSD_INLINE i32x16 srli_epi16(i32x16 a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
MIRRORSD_INLINE int reduce_add_epi32(i32x16 v) {  // exact in any order
  const __m256i s8 = _mm256_add_epi32(v.lo, v.hi);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(0, 1, 0, 1))));
}

// Byte i of the result is 0xFF where bit i of `bits` is set (32 bits to 32 bytes).
MIRRORSD_INLINE __m256i bytes_of(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
// src with a + b in the bytes whose bit of k is set.
MIRRORSD_INLINE i32x16 mask_add_epi8(i32x16 src, uint64_t k, i32x16 a, i32x16 b) {
  const __m256i lo = _mm256_blendv_epi8(src.lo, _mm256_add_epi8(a.lo, b.lo), bytes_of(static_cast<uint32_t>(k)));
  const __m256i hi = _mm256_blendv_epi8(src.hi, _mm256_add_epi8(a.hi, b.hi), bytes_of(static_cast<uint32_t>(k >> 32)));
  return {lo, hi};
}

// vpdpbusd for any codes (u8 x s8 activations, four per int32 lane), exact: vpmaddubsw's int16 pair sums could
// saturate for codes of 128 and up, so the codes' top bit goes through a second pass (weight 128).
MIRRORSD_INLINE __m256i dpbusd8(__m256i acc, __m256i codes, __m256i acts) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low7 = _mm256_and_si256(codes, _mm256_set1_epi8(0x7F));
  const __m256i top = _mm256_and_si256(_mm256_srli_epi16(codes, 7), _mm256_set1_epi8(1));
  const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(low7, acts), ones),
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(top, acts), _mm256_set1_epi16(128)));
  return _mm256_add_epi32(acc, sum);
}
MIRRORSD_INLINE i32x16 dpbusd(i32x16 acc, i32x16 codes, i32x16 acts) {
  return {dpbusd8(acc.lo, codes.lo, acts.lo), dpbusd8(acc.hi, codes.hi, acts.hi)};
}

// pairs + vpmaddubsw(codes, acts) (int16, saturating: callers keep the sums in range, see CodeDots).
MIRRORSD_INLINE i32x16 add_pair_sums(i32x16 pairs, i32x16 codes, i32x16 acts) {
  return {_mm256_add_epi16(pairs.lo, _mm256_maddubs_epi16(codes.lo, acts.lo)),
          _mm256_add_epi16(pairs.hi, _mm256_maddubs_epi16(codes.hi, acts.hi))};
}
// acc + each int32 lane's two int16 pair sums.
MIRRORSD_INLINE i32x16 widen_pair_sums(i32x16 acc, i32x16 pairs) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, ones)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, ones))};
}

// Conversions.
MIRRORSD_INLINE f32x16 cvtepi32_ps(i32x16 v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
MIRRORSD_INLINE i32x16 cvtepi8_epi32(__m128i v) {
  return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
}
MIRRORSD_INLINE f32x16 cvtph_ps(__m256i v) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(v)), _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1))};
}
// Round to nearest even whatever MXCSR says, the only rounding the kernels ask for ({rn-sae}).
template <int kRounding>
MIRRORSD_INLINE i32x16 cvt_roundps_epi32(f32x16 v) {
  static_assert(kRounding == (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), "only round-to-nearest is emulated");
  return {_mm256_cvtps_epi32(_mm256_round_ps(v.lo, kRounding)), _mm256_cvtps_epi32(_mm256_round_ps(v.hi, kRounding))};
}
// vpmovdb: the low byte of each int32 lane.
MIRRORSD_INLINE __m128i cvtepi32_epi8(i32x16 v) {
  const __m256i low = _mm256_set1_epi32(0xFF);
  const __m256i lo = _mm256_and_si256(v.lo, low), hi = _mm256_and_si256(v.hi, low);
  const __m128i words_lo = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  const __m128i words_hi = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  return _mm_packus_epi16(words_lo, words_hi);
}

#undef MIRRORSD_INLINE

}  // namespace mirrorsd::avx2

#define __m512 ::mirrorsd::avx2::f32x16
#define __m512i ::mirrorsd::avx2::i32x16
#define _mm512_set1_ps ::mirrorsd::avx2::set1_ps
#define _mm512_setzero_ps ::mirrorsd::avx2::setzero_ps
#define _mm512_loadu_ps ::mirrorsd::avx2::loadu_ps
#define _mm512_storeu_ps ::mirrorsd::avx2::storeu_ps
#define _mm512_add_ps ::mirrorsd::avx2::add_ps
#define _mm512_sub_ps ::mirrorsd::avx2::sub_ps
#define _mm512_mul_ps ::mirrorsd::avx2::mul_ps
#define _mm512_div_ps ::mirrorsd::avx2::div_ps
#define _mm512_max_ps ::mirrorsd::avx2::max_ps
#define _mm512_fmadd_ps ::mirrorsd::avx2::fmadd_ps
#define _mm512_fnmadd_ps ::mirrorsd::avx2::fnmadd_ps
#define _mm512_abs_ps ::mirrorsd::avx2::abs_ps
#define _mm512_maskz_loadu_ps ::mirrorsd::avx2::maskz_loadu_ps
#define _mm512_mask_storeu_ps ::mirrorsd::avx2::mask_storeu_ps
#define _mm512_mask_blend_ps ::mirrorsd::avx2::mask_blend_ps
#define _mm512_mask_add_ps ::mirrorsd::avx2::mask_add_ps
#define _mm512_cmp_ps_mask(a, b, predicate) ::mirrorsd::avx2::cmp_ps_mask<(predicate)>((a), (b))
#define _mm512_kortestz ::mirrorsd::avx2::kortestz
#define _mm512_scalef_ps ::mirrorsd::avx2::scalef_ps
#define _mm512_shuffle_f32x4(a, b, imm) ::mirrorsd::avx2::shuffle_f32x4<(imm)>((a), (b))
#define _mm512_shuffle_ps(a, b, imm) ::mirrorsd::avx2::shuffle_ps<(imm)>((a), (b))
#define _mm512_reduce_add_ps ::mirrorsd::avx2::reduce_add_ps
#define _mm512_reduce_max_ps ::mirrorsd::avx2::reduce_max_ps
#define _mm512_castps512_ps256 ::mirrorsd::avx2::castps512_ps256
#define _mm512_castps_pd ::mirrorsd::avx2::castps_pd
#define _mm512_extractf64x4_pd ::mirrorsd::avx2::extractf64x4_pd
#define _mm512_set1_epi32 ::mirrorsd::avx2::set1_epi32
#define _mm512_set1_epi8 ::mirrorsd::avx2::set1_epi8
#define _mm512_setzero_si512 ::mirrorsd::avx2::setzero_si512
#define _mm512_loadu_si512 ::mirrorsd::avx2::loadu_si512
#define _mm512_and_si512 ::mirrorsd::avx2::and_si512
#define _mm512_add_epi32 ::mirrorsd::avx2::add_epi32
#define _mm512_srli_epi16 ::mirrorsd::avx2::srli_epi16
#define _mm512_reduce_add_epi32 ::mirrorsd::avx2::reduce_add_epi32
#define _mm512_mask_add_epi8 ::mirrorsd::avx2::mask_add_epi8
#define _mm512_cvtepi32_ps ::mirrorsd::avx2::cvtepi32_ps
#define _mm512_cvtepi8_epi32 ::mirrorsd::avx2::cvtepi8_epi32
#define _mm512_cvtph_ps ::mirrorsd::avx2::cvtph_ps
#define _mm512_cvt_roundps_epi32(v, rounding) ::mirrorsd::avx2::cvt_roundps_epi32<(rounding)>(v)
#define _mm512_cvtepi32_epi8 ::mirrorsd::avx2::cvtepi32_epi8
