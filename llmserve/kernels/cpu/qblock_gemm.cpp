// Linear layers over block-quantized weights (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K, AWQ, GPTQ) kept at their
// bit width:
//
//   w[n, k] = d[n, g] * q[n, k] + m[n, g]       q: unsigned 4-, 5-, 6- or 8-bit codes, g = k / group (group 16 or a
//                                               multiple of 32)
//   m = mins[n, g], or -zero * d[n, g] where the format has one integer zero point for every group (Q4_0: 8, Q8_0:
//   128, Q6_K: 32; the products are exact in fp32, so the values are the format's own)
//
// The layout (llmserve/layers/quant_blocks.py packs it at load): per tile of 16 output rows and block of 32 columns,
// bits * 64 bytes in the order vpdpbusd reads. 8-bit: 64-byte vector v (v < 8) holds, in lane r's 4 bytes, row r's
// columns 4v .. 4v + 3. 4-, 5- and 6-bit: the codes' low nibbles first (256 bytes: vector h's low nibbles are vector
// 2h, its high nibbles vector 2h + 1), then their high bits (5-bit: 64 bytes, byte 4r + i's bit v is bit 4 of vector
// v's byte 4r + i; 6-bit: 128 bytes, vector j's byte 4r + i holds in bits 2u, 2u + 1 the bits 4-5 of vector 4j + u's
// byte 4r + i), so each vector gets its high bits with one shift and one masked or. Tiles are consecutive in k, so
// one tile is one stream. scales / mins: [tiles, K / group, 16], fp16 or fp32 (group 16: fp32).
//
// The product: each row of x is quantized per block of 32 to int8 with its own scale (max |x| / 127, as llama.cpp
// quantizes activations for its Q8 dot products) and the block's sums are exact int32 (vpdpbusd: the codes are the
// unsigned operand, x the signed one):
//
//   y[i, n] = sum_b dx[i, b] * (d[n, g] * sum_k q[n, k] xq[i, k] + m[n, g] * sum_k xq[i, k])
//
// (group 16: the block's two halves, each with its own d, m and sums), summed over blocks b in order with fused
// multiply-adds, the same operations whatever the tile: a row's result does not depend on the rows batched with it.
// Why int8 activations: measured against fp32 FMAs on the unpacked codes (the same layout, x in fp32:
// qblock_linear(..., vnni=0)) over SmolLM2-135M's Q4_1-shaped decoder linears (30 layers, bf16 x, 2-core AMD EPYC
// Zen 5, best of 20, a busy machine): M = 1: 1.66 ms vs 2.18 ms; M = 64: 15.4 ms vs 54.2 ms (w8a8_linear over int8
// weights: 2.31 and 9.9 ms). The FMA path stays for AVX-512 CPUs without VNNI.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "aligned.h"       // AlignedVector
#include "amx_tiles.h"     // TileConfig, load_tile_config
#include "avx2_math.h"    // LLMSERVE_AVX2 where the build has AVX2 and FMA
#include "avx512_math.h"  // LLMSERVE_AVX512, masked loads and stores, for_each_tile
#include "kernels.h"
#include "work_queue.h"   // parallel_units

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#define LLMSERVE_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define LLMSERVE_BF16_VBMI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")))
#define LLMSERVE_AMX8 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))

namespace {

constexpr int64_t kTileRows = 16;     // outputs per tile: one zmm of sums
constexpr int64_t kBlock = 32;        // columns per activation block
constexpr int kMaxRows = 4;           // rows of x per register tile
constexpr int kMaxTiles = 3;          // weight tiles per register tile (4 x 3 accumulators, 8 codes, d, m)
constexpr int64_t kChunkRows = 240;   // rows of x per work unit at most (for_each_tile_group)
constexpr int64_t kPrefetchBytes = 1024;  // one- and two-row tiles stream the codes: prefetch this far ahead
constexpr int64_t kSerialElems = 32768;   // below this many elements quantizing x runs on one thread
constexpr int64_t kAmx8Chunk = 256;       // rows of x per AMX work item
constexpr int64_t kAmx8Group = 8;         // weight tiles per AMX work item, at most

struct Weight {
  const uint8_t* codes;
  const void* scales;  // float or c10::Half [NT, KG, 16]
  const void* mins;    // the same, or null: m = -zero * d
  int64_t KB, KG, blocks_per_group, bytes, zero;  // blocks_per_group: 1 for group 16 (two groups a block)
};

// Quantized activations: xq [M, K] int8, per block of 32: dx (scale) [M, KB] and sx (sum of xq, as float) [M, KB],
// or with group 16 the sums of the block's two halves [M, KB, 2].
struct Act {
  const int8_t* q;
  const float* dx;
  const float* sx;
  int64_t K, KB;
};

LLMSERVE_AVX512 inline __m512 load_scale(const float* p) { return _mm512_loadu_ps(p); }
LLMSERVE_AVX512 inline __m512 load_scale(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// d and m of tile t, group g.
template <typename S>
LLMSERVE_AVX512 inline void group_scales(const Weight& w, int64_t t, int64_t g, __m512& d, __m512& m) {
  const int64_t at = (t * w.KG + g) * kTileRows;
  d = load_scale(static_cast<const S*>(w.scales) + at);
  m = w.mins != nullptr ? load_scale(static_cast<const S*>(w.mins) + at)
                        : _mm512_mul_ps(d, _mm512_set1_ps(-static_cast<float>(w.zero)));
}

// x's 16-bit words shifted left by S (right by -S). Moving a high-bit field to bits 4-5 takes a shift of at most 4
// towards it, so no bit from the neighbouring byte lands in the field.
template <int S>
LLMSERVE_AVX512 inline __m512i shift16(__m512i x) {
  if constexpr (S > 0) return _mm512_slli_epi16(x, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(x, -S);
  else return x;
}

// 5- and 6-bit codes: vector u gets its high bits from the high plane after the nibbles (see the header):
// v[u] |= (plane shifted so that u's field is at bit 4) & field, one vpternlogd (0xF8: a | (b & c)) a vector.
template <int BITS, int... U>
LLMSERVE_AVX512 inline void add_high_bits(const uint8_t* c, __m512i* v, std::integer_sequence<int, U...>) {
  constexpr int HB = BITS - 4, PER = 8 / HB;  // high bits a code; vectors served by one vector of the plane
  const __m512i field = _mm512_set1_epi8(static_cast<char>(((1 << HB) - 1) << 4));
  __m512i hi[2];
  hi[0] = _mm512_loadu_si512(c + 256);
  if constexpr (HB == 2) hi[1] = _mm512_loadu_si512(c + 320);
  ((v[U] = _mm512_ternarylogic_epi32(v[U], shift16<4 - HB * (U % PER)>(hi[U / PER]), field, 0xF8)), ...);
}

// The 8 vectors of one (tile, block): vector v = lane r's columns 4v .. 4v + 3 as unsigned bytes.
template <int BITS>
LLMSERVE_AVX512 inline void unpack_codes(const uint8_t* c, __m512i* v) {
  if constexpr (BITS == 8) {
    _Pragma("GCC unroll 8") for (int h = 0; h < 8; ++h) v[h] = _mm512_loadu_si512(c + 64 * h);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    _Pragma("GCC unroll 4") for (int h = 0; h < 4; ++h) {
      const __m512i raw = _mm512_loadu_si512(c + 64 * h);
      v[2 * h] = _mm512_and_si512(raw, low);
      v[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    if constexpr (BITS > 4) add_high_bits<BITS>(c, v, std::make_integer_sequence<int, 8>{});
  }
}

template <typename T>
LLMSERVE_AVX512 void store_rows(T* y, int64_t N, int64_t row, int64_t n, __m512 v, const float* bias) {
  const __mmask16 mask = tail_mask16(N - n);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n));
  storeu16(y + row * N + n, v, mask);
}

// s += v (unsigned bytes) . x[K] (4 signed bytes of the row's block x, broadcast), read from memory by the instruction.
// Why asm: with the intrinsic, GCC loads the 8 broadcasts of a row once for all the NR tiles of the register tile and
// spills them (and then the accumulators) to the stack, a load and a store per product. x[8] is declared as read.
template <int K>
LLMSERVE_VNNI inline void dpbusd_bcast(__m512i& s, __m512i v, const int32_t* x) {
  asm("vpdpbusd %c3(%2)%{1to16%}, %1, %0" : "+v"(s) : "v"(v), "r"(x), "i"(4 * K), "m"(*reinterpret_cast<const int32_t(*)[8]>(x)));
}

// y[i0 : i0 + MR, tiles t0 .. t0 + NR) by int8 dot products. no-tree-pre as in w8a8_linear.cpp (GCC otherwise spills
// the accumulators on every iteration). A block's 8 dot products run as two chains of 4 (exact int32, so the sum is
// the same): one chain of 8 waits on vpdpbusd's latency; four chains spill. Each product reads its 4 bytes of x from
// memory (dpbusd_bcast). Over SmolLM2's 30 decoder layers of Q4_1 linears against bf16's dot tile on the same shapes
// (2-core Zen 5, quiet, best of 9 interleaved): 13.7 vs 17.4 ms at 64 rows, 91 vs 114 ms at 512; before, with the
// intrinsic's spills and one chain, 15.1-17.4 and 105-124 ms, as slow as bf16 or slower. G16 (group 16): the chains
// are the block's two halves (vectors 0-3: columns 0-15, 4-7: 16-31), each with its own d and m.
// WIDE: the codes come widened from `wide` ([NR][KB][8] vectors, widen_codes), shared by every register tile of a
// work unit's rows: per block one load a vector instead of unpacking (4-bit: 4 loads and 12 operations for 8
// vectors, on the ports the products use), the same vectors, so the same bits.
template <int MR, int NR, int BITS, bool G16, typename S, typename T, bool WIDE = false>
LLMSERVE_VNNI __attribute__((optimize("no-tree-pre"))) void tile_vnni(const Act& a, const Weight& w, int64_t i0,
                                                                      int64_t t0, int64_t N, const float* bias, T* y,
                                                                      const __m512i* wide = nullptr) {
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = G16 ? 2 * b : b / w.blocks_per_group;
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
      __m512i v[8];
      if constexpr (WIDE) {
        _Pragma("GCC unroll 8") for (int h = 0; h < 8; ++h) v[h] = _mm512_load_si512(wide + (j * a.KB + b) * 8 + h);
      } else {
        const uint8_t* c = w.codes + ((t0 + j) * a.KB + b) * w.bytes;
        if (MR <= 2)
          for (int64_t off = 0; off < w.bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(c + off + kPrefetchBytes), _MM_HINT_T0);
        unpack_codes<BITS>(c, v);
      }
      __m512 d, m, d1, m1;
      group_scales<S>(w, t0 + j, g, d, m);
      if constexpr (G16) group_scales<S>(w, t0 + j, g + 1, d1, m1);
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
        const int64_t row = i0 + i;
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + row * a.K + b * kBlock);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        __m512 t;
        if constexpr (G16) {  // the block's halves: vectors 0-3 and 4-7
          dpbusd_bcast<0>(s0, v[0], xq), dpbusd_bcast<4>(s1, v[4], xq), dpbusd_bcast<1>(s0, v[1], xq);
          dpbusd_bcast<5>(s1, v[5], xq), dpbusd_bcast<2>(s0, v[2], xq), dpbusd_bcast<6>(s1, v[6], xq);
          dpbusd_bcast<3>(s0, v[3], xq), dpbusd_bcast<7>(s1, v[7], xq);
          const float* sx = a.sx + (row * a.KB + b) * 2;
          t = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[0]), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s0)));
          t = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(s1), _mm512_fmadd_ps(m1, _mm512_set1_ps(sx[1]), t));
        } else {
          dpbusd_bcast<0>(s0, v[0], xq), dpbusd_bcast<1>(s1, v[1], xq), dpbusd_bcast<2>(s0, v[2], xq);
          dpbusd_bcast<3>(s1, v[3], xq), dpbusd_bcast<4>(s0, v[4], xq), dpbusd_bcast<5>(s1, v[5], xq);
          dpbusd_bcast<6>(s0, v[6], xq), dpbusd_bcast<7>(s1, v[7], xq);
          const __m512i s = _mm512_add_epi32(s0, s1);
          t = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx[row * a.KB + b]), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
        }
        acc[i][j] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.dx[row * a.KB + b]), acc[i][j]);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
      store_rows(y, N, i0 + i, (t0 + j) * kTileRows, acc[i][j], bias);
}

// Tiles t0 .. t0 + nr's codes as bytes, for tile_vnni<..., WIDE>: out[(j * KB + b) * 8 + h] is unpack_codes' vector h
// of tile t0 + j, block b.
template <int BITS>
LLMSERVE_AVX512 void widen_codes(const Weight& w, int64_t t0, int nr, __m512i* out) {
  for (int j = 0; j < nr; ++j)
    for (int64_t b = 0; b < w.KB; ++b) {
      __m512i v[8];
      unpack_codes<BITS>(w.codes + ((t0 + j) * w.KB + b) * w.bytes, v);
      _Pragma("GCC unroll 8") for (int h = 0; h < 8; ++h) _mm512_store_si512(out + (j * w.KB + b) * 8 + h, v[h]);
    }
}

// The same product with x in fp32 and fp32 FMAs on the widened codes (AVX-512 without VNNI). xf: [M, K] fp32; a.sx:
// the blocks' sums of x (G16: of their halves).
template <int MR, int NR, int BITS, bool G16, typename S, typename T>
LLMSERVE_AVX512 __attribute__((optimize("no-tree-pre"))) void tile_fma(const float* xf, const Act& a, const Weight& w,
                                                                      int64_t i0, int64_t t0, int64_t N,
                                                                      const float* bias, T* y) {
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = G16 ? 2 * b : b / w.blocks_per_group;
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
      __m512i v[8];
      unpack_codes<BITS>(w.codes + ((t0 + j) * a.KB + b) * w.bytes, v);
      __m512 d, m, d1, m1;
      group_scales<S>(w, t0 + j, g, d, m);
      if constexpr (G16) group_scales<S>(w, t0 + j, g + 1, d1, m1);
      __m512 s[MR], s1[MR];  // s1: G16's columns 16-31
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) s[i] = s1[i] = _mm512_setzero_ps();
      _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[k], 8 * c), byte));
          _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
            const __m512 xv = _mm512_set1_ps(xf[(i0 + i) * a.K + b * kBlock + 4 * k + c]);
            if (G16 && k >= 4) s1[i] = _mm512_fmadd_ps(q, xv, s1[i]);
            else s[i] = _mm512_fmadd_ps(q, xv, s[i]);
          }
        }
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
        const int64_t at = ((i0 + i) * a.KB + b) * (G16 ? 2 : 1);
        __m512 t = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx[at]), _mm512_mul_ps(d, s[i]));
        if constexpr (G16) t = _mm512_fmadd_ps(d1, s1[i], _mm512_fmadd_ps(m1, _mm512_set1_ps(a.sx[at + 1]), t));
        acc[i][j] = _mm512_add_ps(acc[i][j], t);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
      store_rows(y, N, i0 + i, (t0 + j) * kTileRows, acc[i][j], bias);
}

// One row of x, per block of 32: int8 codes round(x / dx) with dx = max |x| / 127 (0 for an all-zero block), their
// sum (G16: the sums of the block's two halves), and dx.
template <bool G16, typename T>
LLMSERVE_AVX512 void quantize_row(const T* x, int64_t KB, int8_t* q, float* dx, float* sx) {
  for (int64_t b = 0; b < KB; ++b) {
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    dx[b] = d;
    if constexpr (G16) {
      sx[2 * b] = static_cast<float>(_mm512_reduce_add_epi32(q0));
      sx[2 * b + 1] = static_cast<float>(_mm512_reduce_add_epi32(q1));
    } else {
      sx[b] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
  }
}

// One row of x in fp32 and its blocks' sums (G16: their halves' sums; the FMA path).
template <bool G16, typename T>
LLMSERVE_AVX512 void widen_row(const T* x, int64_t KB, float* xf, float* sx) {
  for (int64_t b = 0; b < KB; ++b) {
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    _mm512_storeu_ps(xf + b * kBlock, v0);
    _mm512_storeu_ps(xf + b * kBlock + 16, v1);
    if constexpr (G16) {
      sx[2 * b] = _mm512_reduce_add_ps(v0);
      sx[2 * b + 1] = _mm512_reduce_add_ps(v1);
    } else {
      sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
  }
}

// tile_vnni's product on AMX-INT8 tiles (CPUs with AMX: Sapphire Rapids and later). Per block of 32 columns, one
// tdpbsud gives a 16-row x 16-output tile of the block's sums: x's int8 codes as the signed A operand (16 rows x 32
// bytes, read in place), the weight's codes as the unsigned B operand (8 rows x 64 bytes: row v is unpack_codes'
// vector v, which is B's layout, 4 columns of each output a row). The sums are exact int32 (at most 32 x 127 x 255),
// as vpdpbusd's, and each row then takes tile_vnni's very fp32 operations in its order (scale, min, then the block's
// FMA into the row's accumulator), so a row's result is the VNNI kernel's bit for bit: batches of any size may mix the
// two, and a request's logits still do not depend on its batch. Group 16 (two scales a block) stays on VNNI.
//
// Why: the VNNI kernel spends ~13 vector instructions a row per block and 16 outputs; here the products are one tile
// instruction per 16 rows, and the per-row work is the epilogue's 5. Measured on a 2-core Xeon with AMX (model 207,
// 2026-11-27): 1.1-1.3x the VNNI kernel from 64 rows (at 16 rows about even), but the epilogue keeps it at ~0.6x the
// bf16 tiles over the dequantized weight for prefill, so calibration still prefers those there. From how many rows
// this path runs (QBlockWeight::amx8_rows) is measured per op on the running machine (both paths give the same bits).

// Tile t's codes as B operands: [KB][8][64] bytes, unpack_codes' vectors block by block.
template <int BITS>
LLMSERVE_AVX512 void unpack_tile_codes(const Weight& w, int64_t t, uint8_t* out) {
  for (int64_t b = 0; b < w.KB; ++b) {
    __m512i v[8];
    unpack_codes<BITS>(w.codes + (t * w.KB + b) * w.bytes, v);
    _Pragma("GCC unroll 8") for (int h = 0; h < 8; ++h) _mm512_storeu_si512(out + b * 512 + 64 * h, v[h]);
  }
}

// tmm0, tmm1: C (rows x 16 int32); tmm2, tmm4: A (rows x 32 int8); tmm3, tmm5: B (8 x 64). Configured for `rows`,
// released at the end of the thread's work.
class Int8Tiles {
 public:
  LLMSERVE_AMX8 void configure(int rows) {
    if (rows == rows_) return;
    TileConfig c;
    for (int k : {0, 1}) {  // C
      c.rows[k] = static_cast<uint8_t>(rows);
      c.colsb[k] = 64;
    }
    for (int k : {2, 4}) {  // A
      c.rows[k] = static_cast<uint8_t>(rows);
      c.colsb[k] = 32;
    }
    for (int k : {3, 5}) {  // B
      c.rows[k] = 8;
      c.colsb[k] = 64;
    }
    load_tile_config(c);
    rows_ = rows;
  }
  LLMSERVE_AMX8 ~Int8Tiles() {
    if (rows_ >= 0) _tile_release();
  }

 private:
  int rows_ = -1;
};

// One block's epilogue for rows i0 .. i0 + 15 (rows past M read row M - 1's scales: computed, never stored): as
// tile_vnni, t = m * sx + d * s, acc += t * dx.
template <typename S>
LLMSERVE_AVX512 inline void amx8_block_rows(const Act& a, const Weight& w, int64_t t, int64_t b, int64_t g,
                                            int64_t i0, int64_t last, const int32_t* cbuf, __m512* acc) {
  __m512 d, m;
  group_scales<S>(w, t, g, d, m);
  _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) {
    const int64_t row = std::min(i0 + i, last);
    const __m512i s = _mm512_loadu_si512(cbuf + i * 16);
    const __m512 tv = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx[row * a.KB + b]), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
    acc[i] = _mm512_fmadd_ps(tv, _mm512_set1_ps(a.dx[row * a.KB + b]), acc[i]);
  }
}

// rows [i0, i0 + r) of x (r <= 16, tiles configured for r) by weight tile t, whose B operands are `codes`. Software
// pipelined over two sets of tiles (even blocks: C tmm0, A tmm2, B tmm3; odd: tmm1, tmm4, tmm5), so one block's
// load, product and store run while the other's epilogue does: on one set, each block's tiles waited on the last
// block's store (perf: the tile instructions took ~45% of the samples, the epilogue's FMAs little). ahead: ahead_lines
// cache lines of codes to ask for (into L2), spread over the blocks (null: none).
template <typename S, typename T>
LLMSERVE_AMX8 __attribute__((optimize("no-tree-pre"))) void unit_amx8(const Act& a, const Weight& w,
                                                                      const uint8_t* codes, int64_t i0, int r,
                                                                      int64_t M, int64_t t, int64_t N,
                                                                      const float* bias, int32_t* cbuf, T* y,
                                                                      const char* ahead = nullptr,
                                                                      int64_t ahead_lines = 0) {
  __m512 acc[16];
  _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* xq = a.q + i0 * a.K;
  int32_t* c0 = cbuf;
  int32_t* c1 = cbuf + 256;
// Block b's product into tile C from A and B, stored at out. A macro: GCC's _tile_* macros paste their tile numbers
// into the instruction's text, so no template parameter or variable can stand for them.
#define LLMSERVE_AMX8_BLOCK(C, A, B, b, out)       \
  do {                                             \
    _tile_loadd(A, xq + (b) * kBlock, a.K);        \
    _tile_loadd(B, codes + (b) * 512, 64);         \
    _tile_zero(C);                                 \
    _tile_dpbsud(C, A, B);                         \
    _tile_stored(C, out, 64);                      \
  } while (0)
  auto even = [&](int64_t b) { LLMSERVE_AMX8_BLOCK(0, 2, 3, b, c0); };
  auto odd = [&](int64_t b) { LLMSERVE_AMX8_BLOCK(1, 4, 5, b, c1); };
#undef LLMSERVE_AMX8_BLOCK
  const int64_t KB = a.KB, per = w.blocks_per_group;
  even(0);
  for (int64_t b = 0; b < KB; b += 2) {
    ask_ahead(ahead, ahead_lines, b / 2, (KB + 1) / 2);
    if (b + 1 < KB) odd(b + 1);
    amx8_block_rows<S>(a, w, t, b, per == 1 ? b : b / per, i0, M - 1, c0, acc);
    if (b + 2 < KB) even(b + 2);
    if (b + 1 < KB) amx8_block_rows<S>(a, w, t, b + 1, per == 1 ? b + 1 : (b + 1) / per, i0, M - 1, c1, acc);
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
    if (i < r) store_rows(y, N, i0 + i, t * kTileRows, acc[i], bias);
}

// tile_vnni's product over every row on AMX tiles. Work items: (group of up to 8 weight tiles, chunk of up to 256
// rows), ordered as amx_gemm_blocks orders its own (a group's chunks together up to two chunks, else a chunk's groups
// together); within one, each group's codes are unpacked once, then 16 rows at a time across the group.
template <typename T, typename S, int BITS>
void run_amx8(const Act& a, const Weight& w, int64_t M, int64_t NT, int64_t N, const float* bias, T* yp) {
  const int64_t chunks = (M + kAmx8Chunk - 1) / kAmx8Chunk, threads = at::get_num_threads();
  const int64_t group = std::clamp<int64_t>(NT * chunks / (4 * threads), 1, kAmx8Group);
  const int64_t groups = (NT + group - 1) / group;
  const bool group_major = chunks <= 2;
  // runs of the work queue as amx_gemm_blocks' items: a group's chunks (group-major), else item by item
  parallel_units(groups * chunks, group_major ? chunks : 1, [&](WorkCursor& cursor) {
    Int8Tiles tiles;
    std::vector<uint8_t> codes(group * a.KB * 512);
    alignas(64) int32_t cbuf[2 * 256];
    int64_t unpacked = -1;  // the group whose codes are in `codes`
    for (; cursor.valid(); cursor.advance()) {
      const int64_t u = cursor.unit(), up = cursor.upcoming();
      const int64_t g = group_major ? u / chunks : u % groups, chunk = group_major ? u % chunks : u / groups;
      const int64_t t0 = g * group, t1 = std::min(NT, t0 + group);
      if (g != unpacked) {
        for (int64_t t = t0; t < t1; ++t) unpack_tile_codes<BITS>(w, t, codes.data() + (t - t0) * a.KB * 512);
        unpacked = g;
      }
      const int64_t m0 = chunk * kAmx8Chunk, m1 = std::min(M, m0 + kAmx8Chunk);
      // the codes this thread unpacks next (the next item's group, where it differs): tile t's units of the first
      // rows ask for that group's tile t - t0 (tiles are consecutive in the codes, KB * bytes each), as amx_gemm.cpp
      // asks for its next pair. Over SmolLM2-135M's 30 Q4_1 gate/up projections, cold, in-process alternated (2-core
      // Xeon with AMX, model 207, 2026-11-27), median of 15, ms: 16 rows 6.0 / 6.4 without, 32 rows 9.1 / 9.8, 64 rows
      // 15.8 / 16.4.
      int64_t next_t0 = -1;
      if (up >= 0) {
        const int64_t g2 = group_major ? up / chunks : up % groups;
        if (g2 != g) next_t0 = g2 * group;
      }
      const int64_t tile_bytes = a.KB * w.bytes;
      const char* codes_at = reinterpret_cast<const char*>(w.codes);
      for (int64_t i = m0; i < m1; i += 16) {
        const int r = static_cast<int>(std::min<int64_t>(16, m1 - i));
        tiles.configure(r);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t nt = next_t0 + (t - t0);
          const bool ask = i == m0 && next_t0 >= 0 && nt < NT;
          unit_amx8<S, T>(a, w, codes.data() + (t - t0) * a.KB * 512, i, r, M, t, N, bias, cbuf, yp,
                          ask ? codes_at + nt * tile_bytes : nullptr, ask ? tile_bytes / 64 : 0);
        }
      }
    }
  });
}

bool vnni_supported() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

template <typename T, typename S, int BITS, bool G16>
void run(const at::Tensor& x, const QBlockWeight& qw, const Weight& w, const float* bias, bool vnni, bool tiles,
         T* yp) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock, N = qw.n, NT = qw.codes.size(0);
  constexpr int64_t kSums = G16 ? 2 : 1;  // activation sums a block
  const T* xp = x.data_ptr<T>();
  auto dx = at::empty({M, KB}, x.options().dtype(at::kFloat));
  auto sx = at::empty({M, KB * kSums}, x.options().dtype(at::kFloat));
  at::Tensor xq = at::empty({M, K}, x.options().dtype(vnni ? at::kChar : at::kFloat));
  float* dxp = dx.data_ptr<float>();
  float* sxp = sx.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (vnni) quantize_row<G16>(xp + i * K, KB, xq.data_ptr<int8_t>() + i * K, dxp + i * KB, sxp + i * KB * kSums);
      else widen_row<G16>(xp + i * K, KB, xq.data_ptr<float>() + i * K, sxp + i * KB * kSums);
    }
  });
  const Act a{vnni ? xq.data_ptr<int8_t>() : nullptr, dxp, sxp, K, KB};
  if constexpr (!G16) {
    if (vnni && tiles && M >= qw.amx8_rows && amx_int8_supported())
      return run_amx8<T, S, BITS>(a, w, M, NT, N, bias, yp);
  }
  if constexpr (BITS < 8) {
    if (vnni && M >= qw.wide_rows) {  // each work unit's codes widened once, then its rows go past them
      for_each_tile_group(M, NT, kChunkRows, kMaxRows, kMaxTiles, [&](int64_t) {
        return [&, wide = AlignedVector<__m512i>(kMaxTiles * KB * 8)](int64_t m0, int64_t m1, int64_t t,
                                                                      int nr) mutable {
          widen_codes<BITS>(w, t, nr, wide.data());
          for (int64_t i = m0; i < m1; i += kMaxRows)
            dispatch_tile<kMaxRows, kMaxTiles>(static_cast<int>(std::min<int64_t>(kMaxRows, m1 - i)), nr,
                                               [&](auto mr, auto nt) {
              tile_vnni<decltype(mr)::value, decltype(nt)::value, BITS, G16, S, T, true>(a, w, i, t, N, bias, yp,
                                                                                         wide.data());
            });
        };
      });
      return;
    }
  }
  const float* xf = vnni ? nullptr : xq.data_ptr<float>();
  auto tile = [&](auto mr, auto nt, int64_t i, int64_t t) {
    constexpr int MR = decltype(mr)::value, NR = decltype(nt)::value;
    if (vnni) tile_vnni<MR, NR, BITS, G16, S, T>(a, w, i, t, N, bias, yp);
    else tile_fma<MR, NR, BITS, G16, S, T>(xf, a, w, i, t, N, bias, yp);
  };
  // A row or two read each tile's codes as one stream (tiles one after the other); more rows share each tile's
  // unpacked codes across up to 3 tiles.
  if (M <= 2) for_each_tile<2, 1>(M, NT, kChunkRows, tile);
  else for_each_tile<kMaxRows, kMaxTiles>(M, NT, kChunkRows, tile);
}

// Tile t, block b's codes (unpack_codes) and its group's d and m (G16: the block's two groups, d1 and m1 the second's).
template <int BITS, bool G16, typename S>
LLMSERVE_AVX512 inline void block_codes(const Weight& w, int64_t t, int64_t b, __m512i* v, __m512& d, __m512& m,
                                        __m512& d1, __m512& m1) {
  unpack_codes<BITS>(w.codes + (t * w.KB + b) * w.bytes, v);
  group_scales<S>(w, t, G16 ? 2 * b : b / w.blocks_per_group, d, m);
  if constexpr (G16) group_scales<S>(w, t, 2 * b + 1, d1, m1);
}

// Tile t's weights dequantized to bf16 in bf16_pack's layout (out: [K / 2][16][2]) for the AMX tiles: per column,
// d * q then + m in fp32 (two roundings, as BlockTensor.dequantize computes them) rounded to bf16 to nearest even, as
// torch's .to(bfloat16): exactly the dequantized weight a bf16 kernel would read.
template <int BITS, bool G16, typename S>
LLMSERVE_AVX512BF16 void dequantize_tile(const Weight& w, int64_t t, uint16_t* out) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // word 2r of a pair row: output r's lower column (lo, words 0-15 of vcvtne2ps2bf16's result), word 2r + 1 its upper
  // (hi, words 16-31)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t b = 0; b < w.KB; ++b) {
    __m512i v[8];
    __m512 d, m, d1, m1;
    block_codes<BITS, G16, S>(w, t, b, v, d, m, d1, m1);
    uint16_t* o = out + b * kBlock * kTileRows;
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
      const __m512 dk = G16 && k >= 4 ? d1 : d, mk = G16 && k >= 4 ? m1 : m;
      _Pragma("GCC unroll 2") for (int c = 0; c < 4; c += 2) {  // columns 4k + c and 4k + c + 1: pair 2k + c / 2
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[k], 8 * c), byte));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[k], 8 * (c + 1)), byte));
        lo = _mm512_add_ps(_mm512_mul_ps(dk, lo), mk);
        hi = _mm512_add_ps(_mm512_mul_ps(dk, hi), mk);
        // both rounded by one vcvtne2ps2bf16 (the same rounding, element by element, as vcvtneps2bf16 each), then
        // interleaved into the pair row by one vpermw: three instructions where widening each half took eight. SmolLM2's
        // 120 decoder linears on blocks_amx against amx over the dequantized weight, one process each, alternated
        // (2-core Xeon with AMX, model 167, 2026-12-06), weights read from memory: 16 rows 1.01-1.05x amx's time
        // before, 0.94-0.96x after; 64 rows 1.06-1.12x, 1.02x; in cache, 1 row 1.63-1.80x, 1.49-1.60x.
        _mm512_storeu_si512(o + (2 * k + c / 2) * 2 * kTileRows,
                            _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
      }
    }
  }
}

// Rows of the weight in fp32 (an embedding lookup): out [R, K] = d * q + m per column, in fp32 (two roundings, as
// BlockTensor.rows computes them), for row ids[i] (lane r = id % 16 of tile id / 16). Each block's 16 lanes are
// computed and lane r kept: the codes of one row are spread over the tile's vectors.
template <int BITS, bool G16, typename S>
LLMSERVE_AVX512 void dequantize_row(const Weight& w, int64_t id, float* out) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const int64_t t = id / kTileRows, r = id % kTileRows;
  alignas(64) float lanes[4][kTileRows];
  for (int64_t b = 0; b < w.KB; ++b) {
    __m512i v[8];
    __m512 d, m, d1, m1;
    block_codes<BITS, G16, S>(w, t, b, v, d, m, d1, m1);
    float* o = out + b * kBlock;
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
      const __m512 dk = G16 && k >= 4 ? d1 : d, mk = G16 && k >= 4 ? m1 : m;
      _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[k], 8 * c), byte));
        _mm512_store_ps(lanes[c], _mm512_add_ps(_mm512_mul_ps(dk, q), mk));
      }
      for (int c = 0; c < 4; ++c) o[4 * k + c] = lanes[c][r];
    }
  }
}

// f(std::integral_constant<int, bits>, S{}, std::bool_constant<G16>) for qw's form: the scale type and group-16 layout
// (group 16 has fp32 scales, the constructor checks) and the bit width, as the kernels' templates take them
template <typename F>
void with_form(const QBlockWeight& qw, const F& f) {
  auto bits = [&](auto s, auto g16) {
    switch (qw.bits) {
      case 4: return f(std::integral_constant<int, 4>{}, s, g16);
      case 5: return f(std::integral_constant<int, 5>{}, s, g16);
      case 6: return f(std::integral_constant<int, 6>{}, s, g16);
      default: return f(std::integral_constant<int, 8>{}, s, g16);
    }
  };
  if (qw.group == 16) bits(float{}, std::true_type{});
  else if (qw.scales.scalar_type() == at::kHalf) bits(c10::Half{}, std::false_type{});
  else bits(float{}, std::false_type{});
}

// ---- The amx path's bits at a few rows, from the blocks (qblock_linear_amx_dot) ----
// tdpbf16ps sums, for each output and tile of 32 columns, the even columns' products and the odd columns' in two fp32
// sums that start from zero, each in column order with one rounding a product (DAZ and FTZ, round to nearest even),
// then adds the two, and that to the output. This is the order Intel's SDM gives in the instruction's operation;
// summing the 32 products in one chain, as the intrinsics guide has it, differed from the tiles in ~0.02% of outputs,
// this in none (tests/models/test_gguf_native.py). The products of two bf16 values are exact in fp32, so dot products
// over dequantize_tile's values in that order (vdpbf16ps, dot_tile), the two chains' sums added with MXCSR's DAZ and
// FTZ set, give the tiles' sums bit for bit, and amx_store_pair (the tiles' own epilogue) rounds them.
//
// Why: at one row the tiles use 1 of their 16 rows, and the bf16 weight is 2-4x the blocks' bytes, read from memory
// at every decode step (SmolLM2-135M: 270 MB a token against ~75 MB of its Q4_1/Q8_0 blocks). Here a weight costs ~5
// vector instructions per 16 outputs (pick its codes, widen, dequantize, round to bf16) plus a dot product per two
// columns and row. Over SmolLM2's 30 decoder layers' shapes at one row, weights read from memory (2-core Xeon with
// AMX, model 207): 8.3-8.5 ms against the tiles' 13-14 (the weights hot, 7.7 against 7.6: this is the blocks' bytes,
// not faster arithmetic); at 4 rows the two were even. Summing in fp32 FMAs over widened values instead of vdpbf16ps
// took 14 ms: the widening back to fp32 cost as much as the dequantizing. Calibration measures up to how many rows
// this runs (OpChoice.few_rows, llmserve/kernels/calibrate.py's add_few_rows).
constexpr int kDotRows = 4;        // rows of x per pass over a tile's blocks
constexpr unsigned kDazFtz = 0x8040;  // MXCSR: flush-to-zero (bit 15), denormals-are-zero (bit 6)

// acc[i] (i < MR) of tile t: the tiles' fp32 sums for rows i of x, given as column pairs (xp: [MR][K / 2] dwords,
// pair 16 b + 2 k + par of block b = x[32 b + 4 k + par] in the high word, x[32 b + 4 k + par + 2] in the low one),
// stored at c + i * ldc.
// vdpbf16ps adds a dword's high-word product, then its low-word product, to its lane with one rounding each (DAZ,
// FTZ): two steps of one chain. So a weight vector's lane r holds output r's columns 4k + par (high) and
// 4k + par + 2 (low), one vector the even chain's, one the odd's. The dequantized values reach that layout by
// vpermb: the codes of outputs 0-7 interleaved (column 4k + par + 2 then 4k + par, each in a dword's low byte), and
// of outputs 8-15, dequantized in fp32 with the scales in the same order, and both rounded by one vcvtne2ps2bf16.
template <int MR, int BITS, bool G16, typename S>
LLMSERVE_BF16_VBMI __attribute__((optimize("no-tree-pre"))) void dot_tile(const uint32_t* xp, int64_t KP,
                                                                         const Weight& w, int64_t t, float* c,
                                                                         int64_t ldc) {
  constexpr __mmask64 kLowBytes = 0x1111111111111111ull;
  // byte 4 l of a code vector: output r = (l / 2) (+ 8 for the A half), column 4k + par + (l even ? 2 : 0)
  alignas(64) static const auto idx = [] {
    std::array<std::array<uint8_t, 64>, 4> v{};  // [half * 2 + par]
    for (int half = 0; half < 2; ++half)
      for (int par = 0; par < 2; ++par)
        for (int l = 0; l < 16; ++l)
          v[half * 2 + par][4 * l] = static_cast<uint8_t>(4 * (8 * half + l / 2) + par + (l % 2 == 0 ? 2 : 0));
    return v;
  }();
  __m512i code_idx[4];
  _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) code_idx[j] = _mm512_loadu_si512(idx[j].data());
  const __m512i lo_half = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_half = _mm512_add_epi32(lo_half, _mm512_set1_epi32(8));
  __m512 acc[MR];
  _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.KB; ++b) {
    const int64_t g = G16 ? 2 * b : b / w.blocks_per_group;
    __m512i v[8];
    unpack_codes<BITS>(w.codes + (t * w.KB + b) * w.bytes, v);
    __m512 d[2], m[2];
    group_scales<S>(w, t, g, d[0], m[0]);
    if constexpr (G16) group_scales<S>(w, t, g + 1, d[1], m[1]);
    __m512 dl[2], dh[2], ml[2], mh[2];  // the scales of outputs 0-7 and 8-15, each twice
    _Pragma("GCC unroll 2") for (int h = 0; h < (G16 ? 2 : 1); ++h) {
      dl[h] = _mm512_permutexvar_ps(lo_half, d[h]);
      dh[h] = _mm512_permutexvar_ps(hi_half, d[h]);
      ml[h] = _mm512_permutexvar_ps(lo_half, m[h]);
      mh[h] = _mm512_permutexvar_ps(hi_half, m[h]);
    }
    const uint32_t* xb = xp + b * (kBlock / 2);
    __m512 sums[2][MR];  // the even chain's, the odd chain's
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) sums[0][i] = sums[1][i] = _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
      const int h = G16 && k >= 4 ? 1 : 0;
      _Pragma("GCC unroll 2") for (int par = 0; par < 2; ++par) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(kLowBytes, code_idx[par], v[k]));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(kLowBytes, code_idx[2 + par], v[k]));
        // dequantize_tile's values: d * q, + m, rounded to bf16 (nearest even). With fp16 scales d * q is exact in
        // fp32 (11 + 8 significant bits), so one FMA rounds as the product then the sum do.
        const __m512bh wv = std::is_same_v<S, c10::Half>
                                ? _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(dh[h], hi, mh[h]), _mm512_fmadd_ps(dl[h], lo, ml[h]))
                                : _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_mul_ps(dh[h], hi), mh[h]),
                                                      _mm512_add_ps(_mm512_mul_ps(dl[h], lo), ml[h]));
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
          sums[par][i] = _mm512_dpbf16_ps(sums[par][i], wv, (__m512bh)_mm512_set1_epi32(xb[i * KP + 2 * k + par]));
      }
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_add_ps(acc[i], _mm512_add_ps(sums[0][i], sums[1][i]));
  }
  _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) _mm512_storeu_ps(c + i * ldc, acc[i]);
}

using DotTile = void (*)(const uint32_t*, int64_t, const Weight&, int64_t, float*, int64_t);

// dot_tile for qw's form and 1, 2 or 4 rows: [0] 1 row, [1] 2, [2] 4
std::array<DotTile, 3> dot_tiles(const QBlockWeight& qw) {
  std::array<DotTile, 3> f{};
  with_form(qw, [&](auto bits, auto s, auto g16) {
    constexpr int B = decltype(bits)::value;
    constexpr bool G16 = decltype(g16)::value;
    using S = decltype(s);
    f = {dot_tile<1, B, G16, S>, dot_tile<2, B, G16, S>, dot_tile<4, B, G16, S>};
  });
  return f;
}

// bias [n] (any float dtype) as contiguous fp32 in holder, or nullptr without one
const float* bias_fp32(const c10::optional<at::Tensor>& bias, int64_t n, const char* what, at::Tensor& holder) {
  if (!bias.has_value()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(holder.numel() == n, what, ": bias [n]");
  return holder.data_ptr<float>();
}

Weight weight_of(const QBlockWeight& qw) {
  return Weight{qw.codes.data_ptr<uint8_t>(), qw.scales.data_ptr(), qw.mins.has_value() ? qw.mins->data_ptr() : nullptr,
                qw.k / kBlock, qw.scales.size(1), std::max<int64_t>(1, qw.group / kBlock), qw.bits * 64, qw.zero};
}

// dequantize_tile for qw's form
std::function<void(const Weight&, int64_t, uint16_t*)> tile_dequantizer(const QBlockWeight& qw) {
  std::function<void(const Weight&, int64_t, uint16_t*)> f;
  with_form(qw, [&](auto bits, auto s, auto g16) {
    f = dequantize_tile<decltype(bits)::value, decltype(g16)::value, decltype(s)>;
  });
  return f;
}

// ---- The int8-activation product on CPUs with AVX2 and FMA (no AVX-512: qblock_linear's path there) ----
// Without vpdpbusd, vpmaddubsw multiplies a vector's unsigned code bytes by the row's 4 signed bytes (broadcast) and
// adds each pair into an int16; vpmaddwd by ones then adds the pairs into the lane's int32: per lane, what vpdpbusd
// gives. The int16 steps cannot saturate with codes under 8 bits: a pair is at most 2 * 63 * 127 = 16002, so up to
// two (6-bit), four (5-bit: 7874 each) or eight (4-bit: 3810 each) of them are summed in int16 before widening.
// 8-bit codes are split into their nibbles (q = 16 hi + lo, each product a 4-bit one) and put together in int32. So
// each block's sums are tile_vnni's exact int32 sums, and with its very fp32 operations after them, in its order,
// every output is the VNNI kernel's bit for bit (x quantized as quantize_row does), at any batch. A tile's 16 outputs
// are two halves of 8 lanes: bytes 0-31 and 32-63 of each of its 64-byte vectors.
// Why: without it a CPU with AVX2 only dequantized a GGUF's blocks to fp32 at load, and a decode step read 538 MB of
// SmolLM2-135M's weights from memory against its Q4_1 blocks' ~75 MB.
#if defined(LLMSERVE_AVX2)
constexpr int kAvx2Rows = 4;  // rows of x per register tile (8 accumulators: 4 rows x 2 halves)

bool avx2_supported() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load_scale8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_scale8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// d and m of tile t, group g, outputs 8 h .. 8 h + 7 (group_scales' half)
template <typename S>
inline void group_scales8(const Weight& w, int64_t t, int64_t g, int h, __m256& d, __m256& m) {
  const int64_t at = (t * w.KG + g) * kTileRows + 8 * h;
  d = load_scale8(static_cast<const S*>(w.scales) + at);
  m = w.mins != nullptr ? load_scale8(static_cast<const S*>(w.mins) + at)
                        : _mm256_mul_ps(d, _mm256_set1_ps(-static_cast<float>(w.zero)));
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// quantize_row in 8 lanes: the same max, scale, division-free rounding (vcvtps2dq, nearest even), saturation and sums.
template <bool G16, typename T>
void quantize_row_avx2(const T* x, int64_t KB, int8_t* q, float* dx, float* sx) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < KB; ++b) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = load8(x + b * kBlock + 8 * j);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                    _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float amax = lanes[0];
    for (int j = 1; j < 8; ++j) amax = std::max(amax, lanes[j]);
    const float d = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i n[4];
    for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    // packs interleave 128-bit lanes: dword l of the result is columns 4 order[l] .. + 3
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), _mm256_permutevar8x32_epi32(p, order));
    dx[b] = d;
    // the sums of the saturated values, as quantize_row's (|n| <= 127 here, so n's own)
    const int32_t lo = hsum8(_mm256_add_epi32(n[0], n[1])), hi = hsum8(_mm256_add_epi32(n[2], n[3]));
    if constexpr (G16) {
      sx[2 * b] = static_cast<float>(lo);
      sx[2 * b + 1] = static_cast<float>(hi);
    } else {
      sx[b] = static_cast<float>(lo + hi);
    }
  }
}

template <int S>
inline __m256i shift16_avx2(__m256i x) {
  if constexpr (S > 0) return _mm256_slli_epi16(x, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(x, -S);
  else return x;
}

// add_high_bits in 8 lanes (or and and for vpternlogd)
template <int HB, int PER, int... U>
inline void add_high_bits_avx2(const __m256i* hi, __m256i field, __m256i* v, std::integer_sequence<int, U...>) {
  ((v[U] = _mm256_or_si256(v[U], _mm256_and_si256(shift16_avx2<4 - HB * (U % PER)>(hi[U / PER]), field))), ...);
}

// unpack_codes' 8 vectors, half h (lanes 8 h .. 8 h + 7). 8-bit codes come as they are.
template <int BITS>
inline void unpack_half(const uint8_t* c, int h, __m256i* v) {
  auto load = [&](int64_t off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + off + 32 * h)); };
  if constexpr (BITS == 8) {
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) v[k] = load(64 * k);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
      const __m256i raw = load(64 * j);
      v[2 * j] = _mm256_and_si256(raw, low);
      v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    if constexpr (BITS > 4) {
      constexpr int HB = BITS - 4, PER = 8 / HB;
      const __m256i field = _mm256_set1_epi8(static_cast<char>(((1 << HB) - 1) << 4));
      const __m256i hi[2] = {load(256), HB == 2 ? load(320) : _mm256_setzero_si256()};
      add_high_bits_avx2<HB, PER>(hi, field, v, std::make_integer_sequence<int, 8>{});
    }
  }
}

// the int32 sums of one row's block against one half's code vectors: s0 over columns 0-31 (G16: 0-15, s1 16-31)
template <int BITS, bool G16>
inline void block_sums(const __m256i* v, const int32_t* xq, __m256i& s0, __m256i& s1) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto dot = [&](__m256i codes, int k) { return _mm256_maddubs_epi16(codes, _mm256_set1_epi32(xq[k])); };
  auto widen = [&](__m256i s16) { return _mm256_madd_epi16(s16, ones); };
  auto add = [](__m256i a, __m256i b) { return _mm256_add_epi16(a, b); };
  if constexpr (BITS == 8) {  // q = 16 hi + lo
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i lo[2], hi[2];
    _Pragma("GCC unroll 2") for (int half = 0; half < 2; ++half) {
      __m256i l = _mm256_setzero_si256(), u = _mm256_setzero_si256();
      _Pragma("GCC unroll 4") for (int k = 4 * half; k < 4 * half + 4; ++k) {
        l = add(l, dot(_mm256_and_si256(v[k], low), k));
        u = add(u, dot(_mm256_and_si256(_mm256_srli_epi16(v[k], 4), low), k));
      }
      lo[half] = l, hi[half] = u;
    }
    if constexpr (G16) {
      s0 = _mm256_add_epi32(_mm256_slli_epi32(widen(hi[0]), 4), widen(lo[0]));
      s1 = _mm256_add_epi32(_mm256_slli_epi32(widen(hi[1]), 4), widen(lo[1]));
    } else {
      s0 = _mm256_add_epi32(_mm256_slli_epi32(widen(add(hi[0], hi[1])), 4), widen(add(lo[0], lo[1])));
    }
  } else if constexpr (BITS == 6) {  // two products a widening
    const __m256i a = _mm256_add_epi32(widen(add(dot(v[0], 0), dot(v[1], 1))), widen(add(dot(v[2], 2), dot(v[3], 3))));
    const __m256i b = _mm256_add_epi32(widen(add(dot(v[4], 4), dot(v[5], 5))), widen(add(dot(v[6], 6), dot(v[7], 7))));
    if constexpr (G16) s0 = a, s1 = b;
    else s0 = _mm256_add_epi32(a, b);
  } else {  // 4 and 5 bits: four products a widening (4 bits without group 16: all eight)
    const __m256i a = add(add(dot(v[0], 0), dot(v[1], 1)), add(dot(v[2], 2), dot(v[3], 3)));
    const __m256i b = add(add(dot(v[4], 4), dot(v[5], 5)), add(dot(v[6], 6), dot(v[7], 7)));
    if constexpr (G16) s0 = widen(a), s1 = widen(b);
    else if constexpr (BITS == 4) s0 = widen(add(a, b));
    else s0 = _mm256_add_epi32(widen(a), widen(b));
  }
}

// Tile t's codes of block b; stream: a row or two read the codes as one stream, so ask for those kPrefetchBytes on.
inline const uint8_t* block_codes(const Weight& w, int64_t t, int64_t b, int64_t KB, bool stream) {
  const uint8_t* c = w.codes + (t * KB + b) * w.bytes;
  if (stream)
    for (int64_t off = 0; off < w.bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(c + off + kPrefetchBytes), _MM_HINT_T0);
  return c;
}

// A register tile's sums (acc[i][h]: row i0 + i, outputs 16 t + 8 h ..) into y [M, N] (+ bias as store_rows adds
// it; c10::BFloat16: nearest even, NaN 0x7FC0); lanes past N are not written.
template <int MR, typename T>
inline void store_tile8(const float (&acc)[MR][2][8], int64_t i0, int64_t t, int64_t N, const float* bias, T* y) {
  for (int h = 0; h < 2; ++h) {
    const int64_t n = t * kTileRows + 8 * h, lanes = std::min<int64_t>(8, N - n);  // (none past n)
    for (int i = 0; i < MR && lanes > 0; ++i) {
      T* out = y + (i0 + i) * N + n;
      for (int64_t l = 0; l < lanes; ++l)
        out[l] = static_cast<T>(bias != nullptr ? acc[i][h][l] + bias[n + l] : acc[i][h][l]);
    }
  }
}

// y[i0 : i0 + MR, tile t's 16 outputs) as tile_vnni<MR, 1, ...> computes them, in two halves of 8 lanes.
template <int MR, int BITS, bool G16, typename S, typename T>
__attribute__((optimize("no-tree-pre", "no-tree-reassoc"))) void tile_avx2(const Act& a, const Weight& w, int64_t i0, int64_t t,
                                                        int64_t N, const float* bias, T* y) {
  __m256 acc[MR][2];
  _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = G16 ? 2 * b : b / w.blocks_per_group;
    const uint8_t* c = block_codes(w, t, b, a.KB, MR <= 2);
    __m256i v[2][8];
    __m256 d[2], m[2], d1[2], m1[2];
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      unpack_half<BITS>(c, h, v[h]);
      group_scales8<S>(w, t, g, h, d[h], m[h]);
      if constexpr (G16) group_scales8<S>(w, t, g + 1, h, d1[h], m1[h]);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
      const int64_t row = i0 + i;
      const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + row * a.K + b * kBlock);
      const int64_t at = row * a.KB + b;
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
        __m256i s0, s1;
        block_sums<BITS, G16>(v[h], xq, s0, s1);
        __m256 u;
        if constexpr (G16) {
          u = _mm256_fmadd_ps(m[h], _mm256_set1_ps(a.sx[2 * at]), _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(s0)));
          u = _mm256_fmadd_ps(d1[h], _mm256_cvtepi32_ps(s1), _mm256_fmadd_ps(m1[h], _mm256_set1_ps(a.sx[2 * at + 1]), u));
        } else {
          u = _mm256_fmadd_ps(m[h], _mm256_set1_ps(a.sx[at]), _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(s0)));
        }
        acc[i][h] = _mm256_fmadd_ps(u, _mm256_set1_ps(a.dx[at]), acc[i][h]);
      }
    }
  }
  alignas(32) float r[MR][2][8];
  for (int i = 0; i < MR; ++i)
    for (int h = 0; h < 2; ++h) _mm256_store_ps(r[i][h], acc[i][h]);
  store_tile8<MR>(r, i0, t, N, bias, y);
}

// *p in every lane, loaded where it is used: volatile, so that GCC neither shares one broadcast between the
// halves' products nor hoists them, which held more vectors than there are registers (spilled and reloaded).
inline __m256i bcast_at(const int32_t* p) {
  __m256i r;
  asm volatile("vpbroadcastd %1, %0" : "=x"(r) : "m"(*p));
  return r;
}

// tile_avx2 for 4- and 8-bit codes in groups of 32 or more (Q4_0, Q4_1, Q4_K, Q8_0, AWQ, GPTQ), the same bits, one
// half of the tile at a time: the codes unpacked a 32-byte vector at a time (4-bit: its low and high nibbles, two
// products; 8-bit: its nibbles against the same 4 bytes of x) and every row's products taken from them while they are
// in registers, each row's sums in int16 (8-bit: one vector a nibble), the fp32 accumulators in memory (a load and a
// store a block and half). Why: tile_avx2 holds a block's 16 code vectors at once, more than AVX2's 16 registers with
// the rows' sums, and its spills reloaded a vector for every product. no-tree-reassoc: GCC otherwise rebalanced each
// sum's chain of adds into a tree, which needs every product live at once (spilled: 88 -> 48 vector moves in a 4-row
// tile). Measured on a 2-core Zen 3 (SmolLM2's 30 Q4_1 decoder layers; a noisy VM, variants alternated in one process,
// best of 3 x 3): 1 row 5.5 ms against tile_avx2's 5.0, 64 rows 95 against 104, 256 rows 423 against 419, so even
// within the noise; the fp32 kernel over the dequantized weights took 18-21, 92-145 and 350-440 in the same hour. A
// Q8_0 49152 x 576 LM head: 44 against 46 ms at 64 rows, where fp32 FMAs over its dequantized weight took 32: AVX2 has
// no int8 product that fits 8-bit codes in one instruction (vpmaddubsw's int16 pairs saturate), so the nibbles take two.
template <int MR, int BITS, typename S, typename T>
__attribute__((optimize("no-tree-pre", "no-tree-reassoc"))) void tile_avx2_stream(const Act& a, const Weight& w,
                                                                                   int64_t i0, int64_t t, int64_t N,
                                                                                   const float* bias, T* y) {
  static_assert(BITS == 4 || BITS == 8, "4- or 8-bit codes");
  alignas(32) float acc[MR][2][8] = {};
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b / w.blocks_per_group;
    const uint8_t* c = w.codes + (t * a.KB + b) * w.bytes;
    if (MR <= 2)
      _Pragma("GCC unroll 8") for (int64_t off = 0; off < BITS * 64; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c + off + kPrefetchBytes), _MM_HINT_T0);
    const int32_t* xq[MR];
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
      xq[i] = reinterpret_cast<const int32_t*>(a.q + (i0 + i) * a.K + b * kBlock);
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      __m256i s16[MR], t16[MR];  // 8-bit: the low nibbles' sums, the high nibbles'
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) s16[i] = t16[i] = _mm256_setzero_si256();
      _Pragma("GCC unroll 8") for (int j = 0; j < BITS; ++j) {  // 4-bit: 4 vectors (8 nibble planes); 8-bit: 8
        __m256i raw;  // loaded here (volatile), or GCC hoists the loads and spills what they unpack
        asm volatile("vmovdqu %1, %0" : "=x"(raw) : "m"(*reinterpret_cast<const __m256i*>(c + 64 * j + 32 * h)));
        const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
          if constexpr (BITS == 4) {  // vector j's low nibbles are columns 8j .. 8j + 3's, its high ones 8j + 4 ..
            s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, bcast_at(xq[i] + 2 * j)));
            s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, bcast_at(xq[i] + 2 * j + 1)));
          } else {
            const __m256i xb = bcast_at(xq[i] + j);
            s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, xb));
            t16[i] = _mm256_add_epi16(t16[i], _mm256_maddubs_epi16(hi, xb));
          }
        }
      }
      __m256 d, m;
      group_scales8<S>(w, t, g, h, d, m);
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
        const int64_t at = (i0 + i) * a.KB + b;
        __m256i si = _mm256_madd_epi16(s16[i], ones);
        if constexpr (BITS == 8) si = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(t16[i], ones), 4), si);
        const __m256 u = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sx[at]), _mm256_mul_ps(d, _mm256_cvtepi32_ps(si)));
        _mm256_store_ps(acc[i][h], _mm256_fmadd_ps(u, _mm256_set1_ps(a.dx[at]), _mm256_load_ps(acc[i][h])));
      }
    }
  }
  store_tile8<MR>(acc, i0, t, N, bias, y);
}

// ---- qblock_linear's fp32-FMA product (vnni=0) on CPUs with AVX2 and FMA: tile_fma's bits ----
// x stays fp32 (bf16 widened) and each block's products are fp32 FMAs on the widened codes, in tile_fma's order:
// per block, s = the FMAs over its 32 columns in order (G16: s over 0-15, s1 over 16-31), then t = m * sx + d * s
// (G16: + m1 * sx1 + d1 * s1, as tile_fma chains them) added to the output's sum; sx the block's fp32 sum of x, added
// in _mm512_reduce_add_ps's order. So every output is the AVX-512 FMA kernel's bit for bit, at any batch. A tile's 16
// outputs are two halves of 8 lanes, one at a time.
// Why: on AVX2 the int8 product of 8-bit codes takes two vpmaddubsw (their nibbles) and its int16 sums, no faster
// than fp32 FMAs from 64 rows: a Q8_0 49152 x 576 LM head at 64 rows took 44-52 ms on the int8 kernel against 32 for
// fp32 FMAs over its dequantized weight (a 2-core Zen 3), which the blocks cannot keep beside them (113 MB). Which of
// the two a block op runs is measured per op at calibration (kernels/calibrate.py: blocks, blocks_fma) and kept in
// QBlockWeight::fma; both paths give each row the same result whatever its batch.

// _mm512_reduce_add_ps(v) of v = (a, b) (a lanes 0-7, b lanes 8-15) in GCC's order: the halves added, then the
// 128-bit halves, then lanes 2 apart, then the last two.
inline float reduce_add16(__m256 a, __m256 b) {
  const __m256 t3 = _mm256_add_ps(b, a);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// widen_row in 8 lanes: x's row in fp32 (where T is bf16) and its blocks' sums (G16: their halves'), widen_row's bits.
template <bool G16, typename T>
void widen_row_avx2(const T* x, int64_t KB, float* xf, float* sx) {
  for (int64_t b = 0; b < KB; ++b) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = load8(x + b * kBlock + 8 * j);
    if constexpr (!std::is_same_v<T, float>)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(xf + b * kBlock + 8 * j, v[j]);
    if constexpr (G16) {
      sx[2 * b] = reduce_add16(v[0], v[1]);
      sx[2 * b + 1] = reduce_add16(v[2], v[3]);
    } else {
      sx[b] = reduce_add16(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
    }
  }
}

// Code vector k (columns 4k .. 4k + 3 of each output) of half h of a block's codes at c: unpack_half's v[k] alone.
template <int BITS>
inline __m256i code_vector(const uint8_t* c, int h, int k) {
  auto load = [&](int64_t off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + off + 32 * h)); };
  if constexpr (BITS == 8) {
    return load(64 * k);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F), raw = load(64 * (k / 2));
    __m256i v = k % 2 == 0 ? _mm256_and_si256(raw, low) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    if constexpr (BITS > 4) {
      constexpr int HB = BITS - 4, PER = 8 / HB;
      const __m256i field = _mm256_set1_epi8(static_cast<char>(((1 << HB) - 1) << 4));
      const __m256i hi = load(256 + 64 * (k / PER));
      const int shift = 4 - HB * (k % PER);  // as add_high_bits_avx2 places them (a constant once k is unrolled)
      const __m256i shifted = shift >= 0 ? _mm256_slli_epi16(hi, shift) : _mm256_srli_epi16(hi, -shift);
      v = _mm256_or_si256(v, _mm256_and_si256(shifted, field));
    }
    return v;
  }
}

// Byte j of each 32-bit lane, zero-extended (vpshufb's control: byte 4l + j into lane l's low byte, zeros elsewhere).
alignas(32) constexpr uint8_t kByteOfLane[4][32] = {
#define LLMSERVE_LANE_BYTE(j) \
  {j, 128, 128, 128, 4 + j, 128, 128, 128, 8 + j, 128, 128, 128, 12 + j, 128, 128, 128, \
   j, 128, 128, 128, 4 + j, 128, 128, 128, 8 + j, 128, 128, 128, 12 + j, 128, 128, 128}
    LLMSERVE_LANE_BYTE(0), LLMSERVE_LANE_BYTE(1), LLMSERVE_LANE_BYTE(2), LLMSERVE_LANE_BYTE(3)
#undef LLMSERVE_LANE_BYTE
};

// y[i0 : i0 + MR, tile t's 16 outputs) as tile_fma computes them. Both halves of the tile's lanes at once, so that
// each row keeps two independent chains of FMAs (2 MR in flight: the FMA's latency is hidden from 4 rows); a code
// vector's 4 columns are picked by vpshufb (2 instructions a column with the conversion, shared by the MR rows), and
// the outputs' sums stay in memory (a load and a store a block). Group 16 parks each row's first half-block term in
// memory while the same registers sum the second half. Why two halves, vpshufb: the first version, one half at a
// time with shift-and-mask unpacking (4 chains at 4 rows, 3 instructions a column), took 52.7 ms for a Q8_0 49152 x
// 576 LM head at 64 rows, against 31.0 for fp32_gemm over its dequantized weight (a 2-core Zen 3).
template <int MR, int BITS, bool G16, typename S, typename T>
__attribute__((optimize("no-tree-pre", "no-tree-reassoc"))) void tile_fma_avx2(const float* xf, const Act& a,
                                                                                const Weight& w, int64_t i0, int64_t t,
                                                                                int64_t N, const float* bias, T* y) {
  alignas(32) float acc[MR][2][8] = {};
  alignas(32) float first[G16 ? MR : 1][2][8];  // G16: the block's columns 0-15 term, m sx + d s
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = G16 ? 2 * b : b / w.blocks_per_group;
    const uint8_t* c = block_codes(w, t, b, a.KB, MR <= 2);
    const float* xr[MR];
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) xr[i] = xf + (i0 + i) * a.K + b * kBlock;
    __m256 s[MR][2];
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
    // the block's term for its group g2 (G16: its half from column 16 j) added to `base` per row and half
    auto term = [&](int64_t g2, int j, auto&& use) {
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
        __m256 d, m;
        group_scales8<S>(w, t, g2, h, d, m);
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
          const int64_t at = ((i0 + i) * a.KB + b) * (G16 ? 2 : 1) + j;
          use(i, h, d, m, _mm256_set1_ps(a.sx[at]));
        }
      }
    };
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k) {
      const __m256i v0 = code_vector<BITS>(c, 0, k), v1 = code_vector<BITS>(c, 1, k);
      _Pragma("GCC unroll 4") for (int cc = 0; cc < 4; ++cc) {
        const __m256i sel = _mm256_load_si256(reinterpret_cast<const __m256i*>(kByteOfLane[cc]));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v0, sel));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v1, sel));
        _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
          const __m256 xv = _mm256_broadcast_ss(xr[i] + 4 * k + cc);
          s[i][0] = _mm256_fmadd_ps(q0, xv, s[i][0]);
          s[i][1] = _mm256_fmadd_ps(q1, xv, s[i][1]);
        }
      }
      if constexpr (G16) {
        if (k == 3) {  // columns 0-15 done: m sx + d s parked, the registers sum columns 16-31
          term(g, 0, [&](int i, int h, __m256 d, __m256 m, __m256 sx) {
            _mm256_store_ps(first[i][h], _mm256_fmadd_ps(m, sx, _mm256_mul_ps(d, s[i][h])));
            s[i][h] = _mm256_setzero_ps();
          });
        }
      }
    }
    if constexpr (G16) {
      term(g + 1, 1, [&](int i, int h, __m256 d1, __m256 m1, __m256 sx1) {
        const __m256 u = _mm256_fmadd_ps(d1, s[i][h], _mm256_fmadd_ps(m1, sx1, _mm256_load_ps(first[i][h])));
        _mm256_store_ps(acc[i][h], _mm256_add_ps(_mm256_load_ps(acc[i][h]), u));
      });
    } else {
      term(g, 0, [&](int i, int h, __m256 d, __m256 m, __m256 sx) {
        const __m256 u = _mm256_fmadd_ps(m, sx, _mm256_mul_ps(d, s[i][h]));
        _mm256_store_ps(acc[i][h], _mm256_add_ps(_mm256_load_ps(acc[i][h]), u));
      });
    }
  }
  store_tile8<MR>(acc, i0, t, N, bias, y);
}

// qblock_linear without AVX-512 (and with vnni 3 or 4): int8 activations (FMA false: x quantized per block of 32) or
// fp32 FMAs on the codes (FMA true: bf16 x widened, fp32 x read in place), row tiles of 4 (1 and 2 for a row or two).
template <typename T, typename S, int BITS, bool G16, bool FMA>
void run_avx2(const at::Tensor& x, const Weight& w, int64_t N, int64_t NT, const float* bias, T* yp) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock;
  constexpr int64_t kSums = G16 ? 2 : 1;
  constexpr bool kOwnX = !FMA || !std::is_same_v<T, float>;  // x's int8 codes, or bf16 x widened
  const T* xp = x.data_ptr<T>();
  const at::Tensor sx = at::empty({M, KB * kSums}, x.options().dtype(at::kFloat));
  const at::Tensor dx = FMA ? at::Tensor() : at::empty({M, KB}, x.options().dtype(at::kFloat));
  const at::Tensor xw = kOwnX ? at::empty({M, K}, x.options().dtype(FMA ? at::kFloat : at::kChar)) : at::Tensor();
  float* sxp = sx.data_ptr<float>();
  float* dxp = FMA ? nullptr : dx.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if constexpr (FMA)
        widen_row_avx2<G16>(xp + i * K, KB, kOwnX ? xw.data_ptr<float>() + i * K : nullptr, sxp + i * KB * kSums);
      else
        quantize_row_avx2<G16>(xp + i * K, KB, xw.data_ptr<int8_t>() + i * K, dxp + i * KB, sxp + i * KB * kSums);
    }
  });
  const Act a{FMA ? nullptr : xw.data_ptr<int8_t>(), dxp, sxp, K, KB};
  const float* xf = nullptr;
  if constexpr (FMA) xf = kOwnX ? xw.data_ptr<float>() : reinterpret_cast<const float*>(xp);
  auto tile = [&](auto mr, auto, int64_t i, int64_t t) {
    constexpr int MR = decltype(mr)::value;
    if constexpr (FMA) tile_fma_avx2<MR, BITS, G16, S, T>(xf, a, w, i, t, N, bias, yp);
    else if constexpr ((BITS == 4 || BITS == 8) && !G16) tile_avx2_stream<MR, BITS, S, T>(a, w, i, t, N, bias, yp);
    else tile_avx2<MR, BITS, G16, S, T>(a, w, i, t, N, bias, yp);
  };
  if (M <= 2) for_each_tile<2, 1>(M, NT, kChunkRows, tile);
  else for_each_tile<kAvx2Rows, 1>(M, NT, kChunkRows, tile);
}
#else
bool avx2_supported() { return false; }
#endif

// dequantize_row without vectors (CPUs without AVX-512): the same values, d * q then + m in fp32
template <int BITS, bool G16, typename S>
void dequantize_row_scalar(const Weight& w, int64_t id, float* out) {
  const int64_t t = id / kTileRows, r = id % kTileRows;
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  for (int64_t b = 0; b < w.KB; ++b) {
    const uint8_t* c = w.codes + (t * w.KB + b) * w.bytes;
    const int64_t g = G16 ? 2 * b : b / w.blocks_per_group;
    for (int j = 0; j < kBlock; ++j) {
      const int v = j / 4, i = j % 4;
      int q;
      if constexpr (BITS == 8) {
        q = c[64 * v + 4 * r + i];
      } else {
        q = (c[64 * (v / 2) + 4 * r + i] >> (4 * (v % 2))) & 15;
        if constexpr (BITS == 5) q |= ((c[256 + 4 * r + i] >> v) & 1) << 4;
        if constexpr (BITS == 6) q |= ((c[256 + 64 * (v / 4) + 4 * r + i] >> (2 * (v % 4))) & 3) << 4;
      }
      const int64_t at = (t * w.KG + (G16 && v >= 4 ? g + 1 : g)) * kTileRows + r;
      const float d = static_cast<float>(scales[at]);
      const float m = mins != nullptr ? static_cast<float>(mins[at]) : d * -static_cast<float>(w.zero);
      out[b * kBlock + j] = d * static_cast<float>(q) + m;
    }
  }
}

}  // namespace

bool qblock_linear_supported() { return cpu_has_avx512() || avx2_supported(); }
bool qblock_fma_supported() { return cpu_has_avx512() || avx2_supported(); }
bool qblock_avx2_supported() { return avx2_supported(); }

// x [M, K] bf16 @ the block-quantized weight ^T (+ bias) -> [M, n] bf16 on AMX tiles (amx_gemm.cpp's driver), each
// tile's weights dequantized (dequantize_tile) once per work item of up to 256 rows: the result is bf16_gemm's amx path
// over the dequantized weight, bit for bit, while a step reads the blocks' bytes rather than bf16's.
// glu: gate then up (n = 2 I): silu(gate) * up [M, I], as bf16_gemm's glu.
at::Tensor qblock_linear_amx(at::Tensor x, const QBlockWeight& qw, c10::optional<at::Tensor> bias, bool glu) {
  TORCH_CHECK(cpu_has_avx512_bf16() && amx_bf16_supported(), "qblock_linear_amx needs AMX-BF16 and AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.size(1) == qw.k,
              "qblock_linear_amx: x must be bf16 [M, ", qw.k, "] on the CPU");
  at::Tensor b;
  const float* bp = bias_fp32(bias, qw.n, "qblock_linear_amx", b);
  const Weight w = weight_of(qw);
  const auto dequantize = tile_dequantizer(qw);
  return amx_gemm_blocks(x.contiguous(), qw.codes.size(0), qw.n, bp, [&](int64_t t, uint16_t* out) {
                           dequantize(w, t, out);
                           return static_cast<const uint16_t*>(out);
                         }, glu);
}

// qblock_linear_amx's result, bit for bit, by dot products over the blocks (dot_tile): for a few rows, where the tiles
// idle and the weight's bytes bound the step. Work items are the tiles' pairs (amx_gemm_blocks'), each pass of up to
// kDotRows rows reading the pair's blocks once; MXCSR's DAZ and FTZ are set for the sums only, as the tiles' epilogue
// (amx_store_pair) runs without them.
bool qblock_amx_dot_supported() {
  static const bool ok = cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512vbmi");
  return ok;
}

at::Tensor qblock_linear_amx_dot(at::Tensor x, const QBlockWeight& qw, c10::optional<at::Tensor> bias,
                                 bool glu) {
  TORCH_CHECK(qblock_amx_dot_supported(), "qblock_linear_amx_dot needs AVX512-BF16 and AVX512-VBMI");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.size(1) == qw.k,
              "qblock_linear_amx_dot: x must be bf16 [M, ", qw.k, "] on the CPU");
  const int64_t NT = qw.codes.size(0), N = qw.n, M = x.size(0), K = qw.k;
  TORCH_CHECK(!glu || (N % (2 * kTileRows) == 0 && NT == N / kTileRows),
              "the fused gate/up needs 2 I outputs, I a multiple of 16");
  at::Tensor b;
  const float* bp = bias_fp32(bias, N, "qblock_linear_amx_dot", b);
  auto y = at::empty({M, glu ? N / 2 : N}, x.options());
  if (M == 0) return y;
  // x's column pairs as dot_tile reads them: dword 16 b + 2 k + par = x[32 b + 4 k + par] << 16 | x[... + 2]
  const at::Tensor xc = x.contiguous();
  auto pairs_t = at::empty({M, K / 2}, x.options().dtype(at::kInt));
  {
    const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    auto* pp = reinterpret_cast<uint32_t*>(pairs_t.data_ptr<int32_t>());
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < K / 4; ++j)
        for (int par = 0; par < 2; ++par)
          pp[i * (K / 2) + 2 * j + par] = static_cast<uint32_t>(xs[i * K + 4 * j + par]) << 16 | xs[i * K + 4 * j + par + 2];
  }
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(pairs_t.data_ptr<int32_t>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const Weight w = weight_of(qw);
  const auto tiles = dot_tiles(qw);
  const int64_t pairs = glu ? NT / 2 : (NT + 1) / 2, ldy = glu ? N / 2 : N;
  parallel_units(pairs, std::max<int64_t>(1, pairs / (4 * at::get_num_threads())), [&](WorkCursor& cursor) {
    alignas(64) float c[kDotRows * 2 * kTileRows] = {};
    const unsigned csr = _mm_getcsr();
    for (; cursor.valid(); cursor.advance()) {
      const int64_t p = cursor.unit();
      const int64_t first = glu ? p : 2 * p, second = glu ? p + NT / 2 : 2 * p + 1;
      for (int64_t i = 0; i < M;) {
        const int64_t rows = std::min<int64_t>(kDotRows, M - i), pass = rows == 3 ? 2 : rows;
        const DotTile f = tiles[pass == 1 ? 0 : pass == 2 ? 1 : 2];
        _mm_setcsr(csr | kDazFtz);  // the tiles' sums flush denormals; their epilogue does not
        f(xp + i * (K / 2), K / 2, w, first, c, 2 * kTileRows);
        if (second < NT) f(xp + i * (K / 2), K / 2, w, second, c + kTileRows, 2 * kTileRows);
        _mm_setcsr(csr);
        amx_store_pair(c, pass, p, N, bp, yp + i * ldy, glu);
        i += pass;
      }
    }
  });
  return y;
}

// The whole weight dequantized to bf16 in bf16_pack's layout ([ceil(n / 16), k / 2, 16, 2], zero past n): the bf16
// kernels' weight where the measured choice replaces the blocks (llmserve/kernels/calibrate.py's unblock), exactly
// BlockTensor.dequantize's values rounded to bf16. Needs AVX512-BF16.
at::Tensor qblock_dequantize_bf16(const QBlockWeight& qw) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "qblock_dequantize_bf16 needs AVX512-BF16");
  const int64_t NT = qw.codes.size(0);
  auto out = at::empty({NT, qw.k / 2, kTileRows, 2}, qw.codes.options().dtype(at::kBFloat16));
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const Weight w = weight_of(qw);
  const auto dequantize = tile_dequantizer(qw);
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) dequantize(w, t, op + t * qw.k * kTileRows);
  });
  return out;
}

at::Tensor qblock_rows(const QBlockWeight& qw, at::Tensor ids) {
  TORCH_CHECK(qblock_linear_supported(), "qblock_rows needs AVX-512 or AVX2");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), "qblock_rows: ids [R] int64");
  const auto idc = ids.contiguous();
  const int64_t R = idc.size(0), K = qw.k;
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < qw.n, "qblock_rows: id ", ip[i], " outside [0, ", qw.n, ")");
  auto out = at::empty({R, K}, qw.codes.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const Weight w = weight_of(qw);
  with_form(qw, [&](auto bits, auto s, auto g16) {
    constexpr int B = decltype(bits)::value;
    constexpr bool G = decltype(g16)::value;
    using S = decltype(s);
    at::parallel_for(0, R, std::max<int64_t>(1, kSerialElems / K), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (cpu_has_avx512()) dequantize_row<B, G, S>(w, ip[i], op + i * K);
        else dequantize_row_scalar<B, G, S>(w, ip[i], op + i * K);
      }
    });
  });
  return out;
}

bool qblock_vnni_supported() { return vnni_supported(); }

// x [M, K] fp32 or bf16 (K = the weight's columns) @ the block-quantized weight [n, K] ^T (+ bias) -> [M, n] in x's
// dtype. vnni: 1 int8 activations (VNNI, or without AVX-512 the AVX2 kernel: the same bits), 0 fp32 FMAs (AVX-512,
// else the AVX2 FMA kernel: the same bits), < 0 the weight's measured path (qw.fma: fp32 FMAs) else int8 activations
// where VNNI or AVX2 alone is, else fp32 FMAs; with int8 activations, batches of 16 rows and more run on AMX-INT8
// tiles where the CPU has them (the same bits), except with 2 (VNNI alone: for tests and timings); 3 the AVX2 int8
// kernel and 4 the AVX2 FMA kernel on any CPU with AVX2 (the tests compare their bits with AVX-512's).
at::Tensor qblock_linear(at::Tensor x, const QBlockWeight& qw, c10::optional<at::Tensor> bias, int64_t vnni) {
  TORCH_CHECK(qblock_linear_supported(), "qblock_linear needs a CPU with AVX-512, or AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "qblock_linear: x must be [M, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qblock_linear: x fp32 or bf16");
  TORCH_CHECK(x.size(1) == qw.k, "qblock_linear: x has ", x.size(1), " columns, the weight ", qw.k);
  TORCH_CHECK(vnni >= -1 && vnni <= 4, "qblock_linear: vnni -1 (auto), 0, 1, 2, 3 or 4, got ", vnni);
  if (vnni < 0 && qw.fma) vnni = 0;  // measured at calibration: fp32 FMAs for this weight
  // the AVX2 kernels: asked for, or where AVX-512 is not
  const bool use_avx2 = vnni >= 3 || !cpu_has_avx512();
  TORCH_CHECK(!use_avx2 || avx2_supported(), "qblock_linear: vnni=", vnni, " needs AVX2 and FMA");
  const bool fma_avx2 = use_avx2 && (vnni == 0 || vnni == 4);
  const bool use_vnni = vnni < 0 ? vnni_supported() : vnni > 0;
  TORCH_CHECK(use_avx2 || !use_vnni || vnni_supported(), "qblock_linear: vnni=1 needs AVX512-VNNI");
  at::Tensor b;
  const float* bp = bias_fp32(bias, qw.n, "qblock_linear", b);
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), qw.n}, x.options());
  const Weight w = weight_of(qw);
  const bool half = qw.scales.scalar_type() == at::kHalf;
  auto go = [&](auto t) {
    using T = decltype(t);
    T* yp = y.data_ptr<T>();
    auto with_bits = [&](auto s, auto g16) {
      using S = decltype(s);
      constexpr bool G16 = decltype(g16)::value;
#if defined(LLMSERVE_AVX2)
      if (use_avx2) {
        const int64_t NT = qw.codes.size(0);
        auto on = [&](auto fma) {  // fp32 FMAs on the codes, or int8 activations
          constexpr bool F = decltype(fma)::value;
          switch (qw.bits) {
            case 4: return run_avx2<T, S, 4, G16, F>(xc, w, qw.n, NT, bp, yp);
            case 5: return run_avx2<T, S, 5, G16, F>(xc, w, qw.n, NT, bp, yp);
            case 6: return run_avx2<T, S, 6, G16, F>(xc, w, qw.n, NT, bp, yp);
            default: return run_avx2<T, S, 8, G16, F>(xc, w, qw.n, NT, bp, yp);
          }
        };
        return fma_avx2 ? on(std::true_type{}) : on(std::false_type{});
      }
#endif
      switch (qw.bits) {
        case 4: return run<T, S, 4, G16>(xc, qw, w, bp, use_vnni, vnni != 2, yp);
        case 5: return run<T, S, 5, G16>(xc, qw, w, bp, use_vnni, vnni != 2, yp);
        case 6: return run<T, S, 6, G16>(xc, qw, w, bp, use_vnni, vnni != 2, yp);
        default: return run<T, S, 8, G16>(xc, qw, w, bp, use_vnni, vnni != 2, yp);
      }
    };
    // group 16 has fp32 scales (the constructor checks): half as many instantiations to compile
    if (qw.group == 16) with_bits(float{}, std::true_type{});
    else if (half) with_bits(c10::Half{}, std::false_type{});
    else with_bits(float{}, std::false_type{});
  };
  if (xc.scalar_type() == at::kBFloat16) go(c10::BFloat16{});
  else go(float{});
  return y;
}

QBlockWeight::QBlockWeight(at::Tensor codes_, at::Tensor scales_, c10::optional<at::Tensor> mins_, int64_t n_,
                           int64_t k_, int64_t bits_, int64_t group_, int64_t zero_)
    : codes(std::move(codes_)), scales(std::move(scales_)), mins(std::move(mins_)), n(n_), k(k_), bits(bits_),
      group(group_), zero(zero_) {
  const int64_t NT = (n + kTileRows - 1) / kTileRows;
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "QBlockWeight: 4-, 5-, 6- or 8-bit codes, got ", bits);
  TORCH_CHECK(k > 0 && k % kBlock == 0 && (group == 16 || (group > 0 && group % kBlock == 0)) && k % group == 0,
              "QBlockWeight: columns (", k, ") must be a multiple of 32 and group (", group,
              ") 16 or a multiple of 32 dividing them");
  TORCH_CHECK(group != 16 || scales.scalar_type() == at::kFloat, "QBlockWeight: group 16 takes fp32 scales");
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.dim() == 3 && codes.size(0) == NT && codes.size(1) == k / kBlock && codes.size(2) == bits * 64,
              "QBlockWeight: codes must be contiguous uint8 [", NT, ", ", k / kBlock, ", ", bits * 64, "]");
  auto check = [&](const at::Tensor& s, const char* what) {
    TORCH_CHECK(s.device().is_cpu() && (s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat) &&
                    s.is_contiguous() && s.dim() == 3 && s.size(0) == NT && s.size(1) == k / group && s.size(2) == 16,
                "QBlockWeight: ", what, " must be contiguous fp16 or fp32 [", NT, ", ", k / group, ", 16]");
    TORCH_CHECK(s.scalar_type() == scales.scalar_type(), "QBlockWeight: scales and mins of one dtype");
  };
  check(scales, "scales");
  if (mins.has_value()) check(*mins, "mins");
}

// codes uint8 [n, k] (one per byte, < 2^bits) -> the packed layout [ceil(n / 16), k / 32, bits * 64] (zero past n;
// see the header), as llmserve/layers/quant_blocks.py's pack_codes (its torch reference) lays it out; one pass at load.
at::Tensor qblock_pack(at::Tensor codes, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.device().is_cpu() && codes.size(1) % kBlock == 0,
              "qblock_pack: codes must be uint8 [n, k] on the CPU, k a multiple of 32");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "qblock_pack: 4, 5, 6 or 8 bits");
  const auto c = codes.contiguous();
  const int64_t n = c.size(0), k = c.size(1), NT = (n + kTileRows - 1) / kTileRows, KB = k / kBlock, bytes = bits * 64;
  const int64_t hb = bits - 4, per = hb > 0 ? 8 / hb : 0;  // high bits a code; vectors a high-plane vector serves
  auto out = at::zeros({NT, KB, bytes}, c.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < kTileRows && t * kTileRows + r < n; ++r) {
        const uint8_t* row = src + (t * kTileRows + r) * k;
        for (int64_t b = 0; b < KB; ++b) {
          uint8_t* o = dst + (t * KB + b) * bytes + 4 * r;
          const uint8_t* q = row + b * kBlock;
          for (int64_t v = 0; v < 8; ++v)
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t code = q[4 * v + i];
              if (bits == 8) {
                o[64 * v + i] = code;
                continue;
              }
              o[64 * (v / 2) + i] |= static_cast<uint8_t>((code & 15) << (4 * (v % 2)));
              if (hb > 0) o[256 + 64 * (v / per) + i] |= static_cast<uint8_t>((code >> 4) << (hb * (v % per)));
            }
        }
      }
  });
  return out;
}

// GGUF blocks of 32 columns holding 16 bytes of nibbles at `offset` in each `size`-byte block (Q4_0, Q4_1: byte j
// has column j low, j + 16 high): raw uint8 [rows, blocks * size] -> codes uint8 [rows, blocks * 32].
at::Tensor gguf_nibbles(at::Tensor raw, int64_t offset, int64_t size) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.device().is_cpu() && raw.size(1) % size == 0 &&
                  offset + 16 <= size,
              "gguf_nibbles: raw must be uint8 [rows, blocks * size] on the CPU");
  const auto r = raw.contiguous();
  const int64_t rows = r.size(0), KB = r.size(1) / size;
  auto out = at::empty({rows, KB * kBlock}, r.options());
  const uint8_t* src = r.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* q = src + (i * KB + b) * size + offset;
        uint8_t* o = dst + (i * KB + b) * kBlock;
        for (int j = 0; j < 16; ++j) {
          o[j] = q[j] & 15;
          o[j + 16] = q[j] >> 4;
        }
      }
  });
  return out;
}
