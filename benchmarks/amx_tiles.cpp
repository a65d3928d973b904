// What AMX tile instructions cost on this CPU, alone (docs/benchmarks.md, "AMX tiles on a Sapphire Rapids Xeon"):
// the sequence the kernel issues per weight group (load A, load B, zero, tdpbsud, store) and its parts.
//   g++ -O2 -mamx-tile -mamx-int8 benchmarks/amx_tiles.cpp -o /tmp/amx_tiles && /tmp/amx_tiles
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
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("perm"); return 1; }
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
  t0 = now(); for (long i = 0; i < N / 10; ++i) { load_config(&c); _tile_zero(0); _tile_stored(0, C[0], 64); } t1 = now();
  printf("ldtilecfg+zero+store: %.1f ns\n", (t1 - t0) / (N / 10) * 1e9);
  _tile_release();
  return 0;
}
