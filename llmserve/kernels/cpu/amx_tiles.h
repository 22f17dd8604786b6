// AMX tile configuration shared by the kernels that use tiles (amx_gemm.cpp, prefill_attention.cpp).
#pragma once

#include <immintrin.h>

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
