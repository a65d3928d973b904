// The peak rate of 512-bit VNNI dot products (vpdpbusd) on one core, and what an activation broadcast per dot product
// costs: the ceiling the quantized kernels' k-token curve is measured against (docs/benchmarks.md).
//
//     g++ -O3 -mavx512f -mavx512bw -mavx512vnni benchmarks/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak
//     (/tmp/vnni_peak & /tmp/vnni_peak; wait)   # both cores at once
//
// 16 independent accumulators, no memory traffic. "broadcast per N" broadcasts four int8 activations from memory
// (vpbroadcastd) once per N dot products, as the kernel's tile does once per row and step.

#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

alignas(64) int32_t acts[4096];

template <int ShareBroadcast>  // 0: operands in registers only
double dots_per_second(int64_t iters) {
  __m512i acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i w0 = _mm512_set1_epi8(3), w1 = _mm512_set1_epi8(5), b = w0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    const int32_t* p = acts + (it & 255) * 16;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if constexpr (ShareBroadcast == 0) {
        acc[i] = _mm512_dpbusd_epi32(acc[i], w0, w1);
      } else {
        if (i % ShareBroadcast == 0) {
          b = _mm512_set1_epi32(p[i]);
          __asm__ volatile("" : "+v"(b));  // keep the broadcast its own instruction
        }
        acc[i] = _mm512_dpbusd_epi32(acc[i], i % 2 ? w1 : w0, b);
      }
    }
    __asm__ volatile("" : "+v"(w0), "+v"(w1));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512i sum = acc[0];
  for (int i = 1; i < 16; ++i) sum = _mm512_add_epi32(sum, acc[i]);  // keeps every chain alive
  int32_t out[16];
  _mm512_storeu_si512(out, sum);
  if (out[0] == 42) std::printf(" ");
  return static_cast<double>(iters) * 16 / seconds;
}

int main() {
  for (int i = 0; i < 4096; ++i) acts[i] = static_cast<int32_t>(i * 2654435761u);
  const int64_t iters = 100000000;
  for (int round = 0; round < 2; ++round) {
    const double peak = dots_per_second<0>(iters);
    std::printf("registers only: %.2f G vpdpbusd/s (%.0f GMAC/s)  broadcast per 1: %.2f  per 2: %.2f  per 4: %.2f\n",
                peak / 1e9, peak * 64 / 1e9, dots_per_second<1>(iters) / 1e9, dots_per_second<2>(iters) / 1e9,
                dots_per_second<4>(iters) / 1e9);
  }
}
