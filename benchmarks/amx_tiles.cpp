// What AMX tile instructions cost on this CPU, alone (docs/benchmarks.md, "AMX tiles on a Sapphire Rapids Xeon"):
// the sequence the kernel issues per weight group (load A, load B, zero, tdpbsud, store) and its parts, then the
// float epilogue the kernel runs on each group's int32 sums for 16 rows (as amx_block: convert, scale, two FMAs), and
// both in turn, to see whether the tile unit's work overlaps the vector units'.
//   g++ -O2 -mavx512f -mamx-tile -mamx-int8 benchmarks/amx_tiles.cpp -o /tmp/amx_tiles && /tmp/amx_tiles
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <chrono>
#include <cstring>
// ldtilecfg through asm naming all 64 bytes: GCC 12's _tile_loadconfig declares 8, and may drop the shapes' stores.
static inline void load_config(const void* c) { asm volatile("ldtilecfg %0" : : "m"(*static_cast<const char(*)[64]>(c))); }
struct alignas(64) Cfg { uint8_t p = 1, s = 0, r[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
alignas(64) int8_t A[16 * 1536];
alignas(64) uint8_t B[16 * 64 * 8];
alignas(64) int32_t C[8][256];
alignas(64) float acc[16][16], xs[16][64], xsum[16][64];
// amx_block's epilogue for 4 groups of 16 rows x 16 outputs: each row's chain in group order.
static void epilogue(const int32_t* d, long g) {
  const __m512 sw = _mm512_set1_ps(1.001f), ow = _mm512_set1_ps(0.999f);
  for (int m = 0; m < 16; ++m) {
    __m512 a = _mm512_load_ps(acc[m]);
    for (int j = 0; j < 4; ++j) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(d + j * 256 + m * 16));
      a = _mm512_fmadd_ps(dot, _mm512_mul_ps(sw, _mm512_set1_ps(xs[m][(g + j) & 63])), a);
      a = _mm512_fmadd_ps(ow, _mm512_set1_ps(xsum[m][(g + j) & 63]), a);
    }
    _mm512_store_ps(acc[m], a);
  }
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("perm"); return 1; }
  // Nonzero inputs, so the checksum depends on every part (the instructions' cost does not depend on the values).
  for (int i = 0; i < 16 * 1536; ++i) A[i] = static_cast<int8_t>(i * 7 % 255 - 127);
  for (int i = 0; i < 16 * 64 * 8; ++i) B[i] = static_cast<uint8_t>(i * 13);
  for (int m = 0; m < 16; ++m)
    for (int g = 0; g < 64; ++g) { xs[m][g] = 1e-9f * (1 + (m + g) % 5); xsum[m][g] = 1e-6f * ((m * g) % 3 - 1); }
  Cfg c; for (int t = 0; t < 8; ++t) { c.rows[t] = t >= 6 ? 8 : 16; c.colsb[t] = (t == 4 || t == 5) ? 32 : 64; }
  load_config(&c);
  const long N = 2000000; double t0, t1;
  // 1: tdp only, 4 independent accumulators
  _tile_loadd(4, A, 1536); _tile_loadd(6, B, 64); _tile_loadd(5, A, 1536); _tile_loadd(7, B, 64);
  t0 = now(); for (long i = 0; i < N; ++i) { _tile_dpbsud(0, 4, 6); _tile_dpbsud(1, 5, 7); _tile_dpbsud(2, 4, 6); _tile_dpbsud(3, 5, 7); } t1 = now();
  printf("tdp only:            %.1f ns per tdp\n", (t1 - t0) / (4.0 * N) * 1e9);
  // 2: loads + tdp
  t0 = now(); for (long i = 0; i < N; ++i) { int o = (i & 15) * 32;
    _tile_loadd(4, A + o, 1536); _tile_loadd(6, B, 64); _tile_dpbsud(0, 4, 6);
    _tile_loadd(5, A + o + 32, 1536); _tile_loadd(7, B + 512, 64); _tile_dpbsud(1, 5, 7); } t1 = now();
  printf("load A,B + tdp:      %.1f ns per group\n", (t1 - t0) / (2.0 * N) * 1e9);
  // 3: full sequence: load A, B, zero, tdp, store (as the kernel)
  t0 = now(); for (long i = 0; i < N; ++i) { int o = (i & 15) * 32;
    _tile_loadd(4, A + o, 1536); _tile_loadd(6, B, 64); _tile_zero(0); _tile_dpbsud(0, 4, 6);
    _tile_loadd(5, A + o + 32, 1536); _tile_loadd(7, B + 512, 64); _tile_zero(1); _tile_dpbsud(1, 5, 7);
    _tile_loadd(4, A + o + 64, 1536); _tile_loadd(6, B + 1024, 64); _tile_zero(2); _tile_dpbsud(2, 4, 6);
    _tile_loadd(5, A + o + 96, 1536); _tile_loadd(7, B + 1536, 64); _tile_zero(3); _tile_dpbsud(3, 5, 7);
    _tile_stored(0, C[0], 64); _tile_stored(1, C[1], 64); _tile_stored(2, C[2], 64); _tile_stored(3, C[3], 64); } t1 = now();
  printf("full (4 groups):     %.1f ns per group\n", (t1 - t0) / (4.0 * N) * 1e9);
  // 4: stores only
  t0 = now(); for (long i = 0; i < N; ++i) { _tile_stored(0, C[0], 64); _tile_stored(1, C[1], 64); _tile_stored(2, C[2], 64); _tile_stored(3, C[3], 64);} t1 = now();
  printf("tilestored only:     %.1f ns per store\n", (t1 - t0) / (4.0 * N) * 1e9);
  // 5: loads only
  t0 = now(); for (long i = 0; i < N; ++i) { int o = (i & 15) * 32; _tile_loadd(4, A + o, 1536); _tile_loadd(5, A + o + 32, 1536);} t1 = now();
  printf("tileloadd A only:    %.1f ns per load\n", (t1 - t0) / (2.0 * N) * 1e9);
  t0 = now(); for (long i = 0; i < N; ++i) { _tile_loadd(6, B, 64); _tile_loadd(7, B + 512, 64);} t1 = now();
  printf("tileloadd B only:    %.1f ns per load\n", (t1 - t0) / (2.0 * N) * 1e9);
  // 6: the epilogue alone, then the tile sequence followed by the epilogue of its sums (the kernel's order), then
  // with the epilogue of the previous step's sums (software-pipelined): equal sums mean no overlap.
  t0 = now(); for (long i = 0; i < N; ++i) epilogue(C[4], i); t1 = now();
  printf("epilogue, 16 rows:   %.1f ns per group\n", (t1 - t0) / (4.0 * N) * 1e9);
  for (int pipelined = 0; pipelined < 2; ++pipelined) {
    t0 = now(); for (long i = 0; i < N; ++i) { int o = (i & 15) * 32; int32_t* d = C[4 * ((i & 1) & pipelined)];
      _tile_loadd(4, A + o, 1536); _tile_loadd(6, B, 64); _tile_zero(0); _tile_dpbsud(0, 4, 6);
      _tile_loadd(5, A + o + 32, 1536); _tile_loadd(7, B + 512, 64); _tile_zero(1); _tile_dpbsud(1, 5, 7);
      _tile_loadd(4, A + o + 64, 1536); _tile_loadd(6, B + 1024, 64); _tile_zero(2); _tile_dpbsud(2, 4, 6);
      _tile_loadd(5, A + o + 96, 1536); _tile_loadd(7, B + 1536, 64); _tile_zero(3); _tile_dpbsud(3, 5, 7);
      _tile_stored(0, d, 64); _tile_stored(1, d + 256, 64); _tile_stored(2, d + 512, 64); _tile_stored(3, d + 768, 64);
      epilogue(C[4 * (((i + 1) & 1) & pipelined)], i); } t1 = now();
    printf("full + epilogue%s %.1f ns per group\n", pipelined ? ", pipelined:" : ":         ", (t1 - t0) / (4.0 * N) * 1e9);
  }
  t0 = now(); for (long i = 0; i < N / 10; ++i) { load_config(&c); _tile_zero(0); _tile_stored(0, C[0], 64); } t1 = now();
  printf("ldtilecfg+zero+store: %.1f ns\n", (t1 - t0) / (N / 10) * 1e9);
  _tile_release();
  printf("(checksum %g)\n", acc[3][3]);
  return 0;
}
