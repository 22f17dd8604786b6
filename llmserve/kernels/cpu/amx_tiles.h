// AMX tile configuration shared by the kernels that use tiles (amx_gemm.cpp, prefill_attention.cpp, qblock_gemm.cpp),
// and how the GEMMs among them ask for the weights they read next.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

// The 64-byte operand of ldtilecfg, palette 1: bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Not _tile_loadconfig: GCC 12's names only 8 bytes of the config as read, and its stores were dropped as dead.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& c) {
  __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

// Step `step` of `steps` of a tile kernel's loop asks (into L2) for its share of the `lines` cache lines at `at` (null:
// none), so the next operand's prefetch spreads over the current one's work rather than going out in a burst.
inline void ask_ahead(const char* at, int64_t lines, int64_t step, int64_t steps) {
  if (at == nullptr) return;
  const int64_t per = (lines + steps - 1) / steps;
  for (int64_t j = step * per; j < std::min(lines, (step + 1) * per); ++j) _mm_prefetch(at + 64 * j, _MM_HINT_T1);
}
