// Linears over weights packed once at load, multiplied with fp32 FMAs on CPUs with AVX-512: y[M, N] = x[M, K] @ W[N, K]^T
// (* scale) (+ bias), x and y bf16 or fp32, fp32 products and sums. Two weight formats share the kernel:
//   bf16 (bf16_pack):  [N/16][K/2][16][2]  one 64-byte load holds 2 columns of 16 outputs; a shift or a mask widens
//                                         each to fp32 (bf16 is the top half of fp32);
//   int8 (w8a8_pack):  [N/16][K/4][16][4]  4 columns of 16 outputs; two shifts and a conversion widen each, and the
//                                         per-output scale is applied to the sums (weight-only int8: x stays in
//                                         bf16/fp32, so only the weights are rounded). On CPUs with AVX512-VNNI
//                                         int8w_gemm takes int8w_gemm_a16 below instead (x rounded to int16).
// Each widened column is multiplied by one element of a row of x broadcast to every lane, so the 16 sums land in the
// lanes they belong to (no horizontal sums), and every block is one contiguous stream. A register tile is 6 rows of x
// by 4 blocks (24 accumulators).
//
// Why: which arithmetic is fastest depends on the CPU. On a Xeon with AVX512-BF16 but no AMX, vdpbf16ps runs at half
// the rate of fp32 FMAs, so widening in registers and using FMAs keeps the weight narrow (half or a quarter of fp32's
// bytes: what a memory-bound decode reads) and the arithmetic at FMA speed; on an AMD Zen 5, vdpbf16ps does twice the
// FMAs' products per cycle. So bf16 weights have a second tile over the same layout, tile_dot (bf16_gemm's dot=1, CPUs
// with AVX512-BF16): each 32-bit lane of a packed group holds one output's two columns, which is what vdpbf16ps
// multiplies against a broadcast pair of x's columns, so x stays bf16 and nothing is widened. Which of the two runs at
// which batch size is measured on the running machine (llmserve/kernels/calibrate.py), never assumed from the flags.
// Products are exact in fp32 and each output is summed over k in order on either path, so a row's result does not
// depend on the other rows of the batch (the two paths differ from each other: vdpbf16ps adds a pair's products
// before the accumulator, and flushes denormals).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"    // TileConfig, load_tile_config
#include "avx512_math.h"  // LLMSERVE_AVX512, storeu16, tail_mask16
#include "kernels.h"  // bf16_gemm_amx

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace {

constexpr int64_t kBlockRows = 16;   // outputs per packed block

// The weight formats: the element type, columns per 32-bit lane (kGroup), and column c of a lane widened to fp32.
struct Bf16Weights {
  using T = uint16_t;
  static constexpr int kGroup = 2;
  static constexpr int64_t kWideMinRows = 96;  // see "Chunks of at least" below
  LLMSERVE_AVX512 static __m512 widen(__m512i v, int c) {  // column 0: the low bf16, shifted up; 1: the high, masked
    return _mm512_castsi512_ps(c == 0 ? _mm512_slli_epi32(v, 16)
                                      : _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};
struct Int8Weights {
  using T = int8_t;
  static constexpr int kGroup = 4;
  // Widening int8 takes three ops per column against bf16's one, so it pays to widen once per chunk from fewer rows:
  // SmolLM2's decoders and LM head, best of 3, ms (registers only / widened per chunk): 16 rows 23.4-23.8 / 24.2-24.4;
  // 24: 32.6-32.7 / 30.7-31.6; 32: 43.8-43.9 / 40.1-40.9; 64: 83.0-83.7 / 65.9-67.2.
  static constexpr int64_t kWideMinRows = 24;
  LLMSERVE_AVX512 static __m512 widen(__m512i v, int c) {  // byte c of each lane, sign-extended
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * c), 24));
  }
};
constexpr int kTileRows = 6;
constexpr int kTileBlocks = 4;
constexpr int64_t kChunkRows = 240;  // rows of x per work unit at most (for_each_tile_group)
constexpr int64_t kSerialElems = 32768;  // below this many elements widening x runs on one thread

// Tiles of one or two rows of x are bound by streaming the weights: they prefetch each block this far ahead (the
// hardware streamers stop at 4 KB pages). SmolLM2-135M's decoders and LM head at one row, median of 30:
// 10.0-10.2 ms against 11.9-12.1 without.
constexpr int64_t kPrefetchBytes = 1024;
// The epilogue: sums * scale (int8 weights) + bias, either optional.
struct Epilogue {
  const float* scale;
  const float* bias;
};

// A tile's sums, through the epilogue, rounded to Y into y[i0 : i0 + MR, n0 : n0 + NR * 16], columns below N.
template <int MR, int NR, typename Y>
LLMSERVE_AVX512 __attribute__((always_inline)) inline void store_tile(const __m512 (&acc)[MR][NR], int64_t i0, int64_t n0,
                                                                      int64_t N, const Epilogue& e, Y* y) {
  _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
    const int64_t n = n0 + j * kBlockRows;
    const __mmask16 m = tail_mask16(N - n);
    const __m512 sv = e.scale != nullptr ? _mm512_maskz_loadu_ps(m, e.scale + n) : _mm512_setzero_ps();
    const __m512 bv = e.bias != nullptr ? _mm512_maskz_loadu_ps(m, e.bias + n) : _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      __m512 v = e.scale != nullptr ? _mm512_mul_ps(acc[i][j], sv) : acc[i][j];
      if (e.bias != nullptr) v = _mm512_add_ps(v, bv);
      storeu16(y + (i0 + i) * N + n, v, m);
    }
  }
}

// y[i0 : i0 + MR, n0 : n0 + NR * 16] for one register tile: MR rows of fp32 x (G groups of F::kGroup columns each, ldx
// apart), NR packed blocks (G groups of [16 rows][kGroup] each, block_elems apart).
// no-tree-pre: GCC 12 otherwise keeps the accumulators on the stack (see w8a8_linear.cpp).
template <int MR, int NR, typename F, typename Y>
LLMSERVE_AVX512 __attribute__((optimize("no-tree-pre"))) void tile(const float* x, int64_t ldx, int64_t G,
                                                                 const typename F::T* w, int64_t block_elems, int64_t i0,
                                                                 int64_t n0, int64_t N, const Epilogue& e, Y* y) {
  constexpr int kG = F::kGroup;
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (MR <= 2)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * block_elems + g * 16 * kG) + kPrefetchBytes, _MM_HINT_T0);
    _Pragma("GCC unroll 4") for (int c = 0; c < kG; ++c) {
      __m512 wv[NR];
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
        wv[j] = F::widen(_mm512_loadu_si512(w + j * block_elems + g * 16 * kG), c);
      _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
        const __m512 b = _mm512_set1_ps(x[(i0 + i) * ldx + kG * g + c]);
        _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(b, wv[j], acc[i][j]);
      }
    }
  }
  store_tile<MR, NR>(acc, i0, n0, N, e, y);
}

// The same tile over fp32 weights widened beforehand (widen_blocks) for columns [k0, k0 + kn): chunks of F::kWideMinRows
// rows and more widen each block once per chunk instead of once per tile, so the loop is loads, broadcasts and FMAs only.
// The sums run over k in the same order with the same FMAs, carried in acc (fp32, row stride kAccStride) between
// column chunks, so the result is bit for bit the narrow tile's.
constexpr int64_t kAccStride = kTileBlocks * kBlockRows;

template <int MR, int NR, typename Y>
LLMSERVE_AVX512 __attribute__((optimize("no-tree-pre"))) void tile_wide(
    const float* x, int64_t ldx, int64_t k0, int64_t kn, const float* wf, int64_t wf_stride, int64_t i0, float* acc_rows,
    bool first, bool last, int64_t n0, int64_t N, const Epilogue& e, Y* y) {
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_rows + i * kAccStride + j * kBlockRows);
  for (int64_t k = 0; k < kn; ++k) {
    __m512 wv[NR];
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(wf + j * wf_stride + k * kBlockRows);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(x[(i0 + i) * ldx + k0 + k]);
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(b, wv[j], acc[i][j]);
    }
  }
  if (!last) {
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
        _mm512_storeu_ps(acc_rows + i * kAccStride + j * kBlockRows, acc[i][j]);
    return;
  }
  store_tile<MR, NR>(acc, i0, n0, N, e, y);
}

// Groups [g0, g0 + gn) of nr packed blocks -> fp32 wf [nr][kGroup gn][16] (the columns in order).
template <typename F>
LLMSERVE_AVX512 void widen_blocks(const typename F::T* w, int64_t block_elems, int nr, int64_t g0, int64_t gn, float* wf) {
  constexpr int kG = F::kGroup;
  for (int j = 0; j < nr; ++j)
    for (int64_t g = 0; g < gn; ++g) {
      const __m512i v = _mm512_loadu_si512(w + j * block_elems + (g0 + g) * 16 * kG);
      float* o = wf + (j * kG * gn + kG * g) * kBlockRows;
      _Pragma("GCC unroll 4") for (int c = 0; c < kG; ++c) _mm512_storeu_ps(o + c * kBlockRows, F::widen(v, c));
    }
}

constexpr int64_t kWideColumns = 128;  // columns widened at once: 4 blocks x 128 columns x 16 fp32 = 32 KB (L1)
// Chunks of at least F::kWideMinRows rows take the widened path. bf16: SmolLM2's decoders, best of 5, alternated with the
// registers-only path: 256-1,024 rows 284-287 GFLOP/s against 260-267; 64-128 rows the same; 16-36 rows 10-25%
// slower (each column chunk reloads the partial sums, and too few tiles share a widening).

// rows of x -> fp32, ld per row (the padding columns 0)
template <typename X>
LLMSERVE_AVX512 void widen_rows(const X* x, int64_t M, int64_t K, int64_t ld, float* out) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 m = tail_mask16(K - k);
      _mm512_mask_storeu_ps(out + i * ld + k, m, loadu16(x + i * K + k, m));
    }
    for (int64_t k = K; k < ld; ++k) out[i * ld + k] = 0.f;
  }
}

// The driver both GEMMs here share: for_each_tile_group, each chunk of rows cut into register tiles (of kTileBlocks
// blocks at most).
// - Chunks of fewer than min_wide rows: narrow(mr, nb, i, block) for tiles of up to NarrowRows rows, which widen the
//   weights in registers.
// - Larger chunks, per column chunk of groups [g0, g0 + gn) (up to chunk_groups): widen(block, nr, g0, gn, buf) widens
//   those weights once into the thread's buffer (buf_elems of W), then wide(mr, nb, i, block, g0, gn, buf, acc_rows,
//   first, last) runs tiles of up to WideRows rows over it, carrying their partial sums in acc_rows (kAccStride floats
//   per row) from one column chunk to the next.
template <int NarrowRows, int WideRows, typename W, typename Narrow, typename Widen, typename Wide>
void for_each_tile_widened(int64_t M, int64_t NB, int64_t G, int64_t min_wide, int64_t chunk_groups,
                           int64_t buf_elems, const Narrow& narrow, const Widen& widen, const Wide& wide) {
  for_each_tile_group(M, NB, kChunkRows, NarrowRows, kTileBlocks, [&](int64_t rows) {
    const bool any_wide = rows >= min_wide;
    return [&, buf = std::vector<W>(any_wide ? buf_elems : 0),
            acc = std::vector<float>(any_wide ? rows * kAccStride : 0)](int64_t m0, int64_t m1, int64_t blk,
                                                                        int nr) mutable {
      if (m1 - m0 < min_wide) {
        for (int64_t i = m0; i < m1; i += NarrowRows)
          dispatch_tile<NarrowRows, kTileBlocks>(static_cast<int>(std::min<int64_t>(NarrowRows, m1 - i)), nr,
                                                 [&](auto mr, auto nb) { narrow(mr, nb, i, blk); });
        return;
      }
      for (int64_t g0 = 0; g0 < G; g0 += chunk_groups) {
        const int64_t gn = std::min(chunk_groups, G - g0);
        widen(blk, nr, g0, gn, buf.data());
        for (int64_t i = m0; i < m1; i += WideRows)
          dispatch_tile<WideRows, kTileBlocks>(static_cast<int>(std::min<int64_t>(WideRows, m1 - i)), nr,
                                               [&](auto mr, auto nb) {
            wide(mr, nb, i, blk, g0, gn, buf.data(), acc.data() + (i - m0) * kAccStride, g0 == 0, g0 + gn >= G);
          });
      }
    };
  });
}

// y = (x @ W^T) (* scale) (+ bias) over a packed weight of format F: x [M, K] (X = float or bf16) -> [M, N] in X.
template <typename F, typename X>
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Epilogue& e) {
  constexpr int kG = F::kGroup;
  constexpr int64_t kWideGroups = kWideColumns / kG;
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), G = packed.size(1), ld = G * kG;
  auto xf = at::empty({M, ld}, x.options().dtype(at::kFloat));
  float* xp = xf.data_ptr<float>();
  const X* xs = x.data_ptr<X>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / ld), [&](int64_t begin, int64_t end) {
    widen_rows(xs + begin * K, end - begin, K, ld, xp + begin * ld);
  });
  auto y = at::empty({M, N}, x.options());
  const auto* wp = reinterpret_cast<const typename F::T*>(packed.data_ptr());
  const int64_t be = G * 16 * kG;  // elements per packed block
  X* yp = y.data_ptr<X>();
  for_each_tile_widened<kTileRows, kTileRows, float>(
      M, NB, G, F::kWideMinRows, kWideGroups, kTileBlocks * kWideColumns * kBlockRows,
      [&](auto mr, auto nb, int64_t i, int64_t blk) {
        tile<decltype(mr)::value, decltype(nb)::value, F>(xp, ld, G, wp + blk * be, be, i, blk * kBlockRows, N, e, yp);
      },
      [&](int64_t blk, int nr, int64_t g0, int64_t gn, float* wf) { widen_blocks<F>(wp + blk * be, be, nr, g0, gn, wf); },
      [&](auto mr, auto nb, int64_t i, int64_t blk, int64_t g0, int64_t gn, const float* wf, float* acc, bool first,
          bool last) {
        tile_wide<decltype(mr)::value, decltype(nb)::value>(xp, ld, kG * g0, kG * gn, wf, kG * gn * kBlockRows, i, acc,
                                                            first, last, blk * kBlockRows, N, e, yp);
      });
  return y;
}

// ---------------------------------------------------------------------------------------------------------------------
// bf16 x bf16 -> fp32 with vdpbf16ps over bf16_pack's layout (bf16_gemm's dot path, CPUs with AVX512-BF16).

// y[i0 : i0 + MR, n0 : n0 + NR * 16] for one register tile: MR rows of x as bf16 column pairs (uint32, ldx pairs per
// row), NR packed blocks of G groups [16 outputs][2 columns]. Per group: NR loads, MR broadcasts, MR * NR dot products.
template <int MR, int NR, typename Y>
LLMSERVE_AVX512BF16 __attribute__((optimize("no-tree-pre"))) void tile_dot(const uint32_t* x, int64_t ldx, int64_t G,
                                                                         const uint16_t* w, int64_t block_elems,
                                                                         int64_t i0, int64_t n0, int64_t N,
                                                                         const Epilogue& e, Y* y) {
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (MR <= 2)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * block_elems + g * 32) + kPrefetchBytes, _MM_HINT_T0);
    __m512bh wv[NR];
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * block_elems + g * 32);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[(i0 + i) * ldx + g]));
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], b, wv[j]);
    }
  }
  store_tile<MR, NR>(acc, i0, n0, N, e, y);
}

constexpr int kDotTileRows = 6;  // 24 accumulators + 4 weights + a broadcast in 32 registers

at::Tensor packed_gemm_dot(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Epilogue& e) {
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), G = packed.size(1);
  at::Tensor xp = x;  // rows of G column pairs: x itself, or a zero-padded copy when K is odd
  if (K != 2 * G) {
    xp = at::zeros({M, 2 * G}, x.options());
    xp.narrow(1, 0, K).copy_(x);
  }
  const auto* xs = reinterpret_cast<const uint32_t*>(xp.data_ptr());
  auto y = at::empty({M, N}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t be = G * 32;  // elements per packed block
  auto* yp = y.data_ptr<at::BFloat16>();
  for_each_tile<kDotTileRows, kTileBlocks>(M, NB, kChunkRows, [&](auto mr, auto nb, int64_t i, int64_t blk) {
    tile_dot<decltype(mr)::value, decltype(nb)::value>(xs, G, G, wp + blk * be, be, i, blk * kBlockRows, N, e, yp);
  });
  return y;
}

}  // namespace

bool bf16_dot_supported() { return cpu_has_avx512_bf16(); }

bool int8w_a16_supported() { return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni"); }

namespace {

// ---------------------------------------------------------------------------------------------------------------------
// Weight-only int8 with 16-bit activations on CPUs with AVX512-VNNI (int8w_gemm's path there): each row of x is quantized
// to int16 (symmetric, its max |x| -> 32767) and multiplied with vpdpwssd, 32 products per instruction at the fp32
// FMA's rate (16), so twice the FMA path's arithmetic rate and none of its widening (three ops per int8 column):
//
//   y[i, n] = float(sum over 256-column chunks of the int32 sums xq[i, :] . Wq[n, :]) * s[i] * w_scale[n] (+ bias)
//
// A chunk's int32 sum cannot overflow (256 * 127 * 32767 < 2^31; 512 columns would fit too); chunks are added in fp32
// in column order, so a row's result does not depend on the rows around it. 16-bit activations round x by at most
// max|x| / 65534 (bf16 itself rounds its largest elements by max|x| / 512).
#define LLMSERVE_VNNI16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

constexpr int64_t kA16ChunkGroups = 64;  // 256 columns per int32 chunk (and per widening, below)
constexpr int kA16TileRows = 4;          // 16 int32 accumulators + 8 widened weights + broadcasts in 32 registers
// Chunks of at least this many rows widen each block's int8 weights to int16 once per chunk (widen_blocks_a16) instead of
// once per register tile (three ops per 64 bytes): the tiles' loop is then loads and vpdpwssd only, and with the weights
// out of registers a tile holds 6 rows. SmolLM2's linears (8 decoders) and LM head, bf16 x, median of 15, alternated
// (per tile / per chunk, ms): 16 rows 5.9-6.2 / 6.1-6.2; 24: 7.7-8.1 / 7.6; 48: 13.5-13.6 / 11.9-12.1; 64: 17.2-17.4
// / 14.6-14.7; 256: 64.4-64.6 / 50.7-52.1 (4-row wide tiles: 15.0, 51.6-53.2; 5 rows: 14.8-15.1, 51.6).
constexpr int64_t kA16WideMinRows = 24;
constexpr int kA16WideTileRows = 6;

// Whether the default (a16 < 0) takes this path: VNNI here, and LLMSERVE_INT8W_A16 is not "0" (A/B runs).
bool a16_default() {
  static const bool ok = int8w_a16_supported() && !env_is_zero("LLMSERVE_INT8W_A16");
  return ok;
}

// A row of x's int16 scale, max|x| / 32767 (1 for a row of zeros), and its values at columns k .. k + 15 (0 past K) as
// int32 lanes: x / scale rounded half to even by IEEE division, clamped to +-32767. Both 16-bit paths (the VNNI tiles
// and the AMX tiles) quantize through these two, so they multiply the same int16 values.
template <typename X>
LLMSERVE_VNNI16 float a16_scale(const X* x, int64_t K) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(loadu16(x + k, tail_mask16(K - k))));
  const float m = _mm512_reduce_max_ps(amax);
  return m > 0.f ? m / 32767.f : 1.f;
}

template <typename X>
LLMSERVE_VNNI16 inline __m512i a16_values(const X* x, int64_t k, int64_t K, __m512 sv) {
  const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(loadu16(x + k, tail_mask16(K - k)), sv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_set1_ps(32767.f), _mm512_max_ps(_mm512_set1_ps(-32767.f), v)));
}

// One row of x -> int16 in the order the tile reads: per group of 4 columns [x0, x2, x1, x3] (vpdpwssd pairs 32-bit
// lanes: the even columns' (x0, x2) against the weights' bytes 0 and 2, the odd ones' against 1 and 3); padding 0.
// IEEE division and rounding half to even, 16 columns at a time (a scalar loop was ~1 s of a 64-request int8 run).
template <typename X>
LLMSERVE_VNNI16 void quantize_row_a16(const X* x, int64_t K, int64_t K4, int16_t* q, float* s) {
  *s = a16_scale(x, K);
  const __m512 sv = _mm512_set1_ps(*s);
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t k = 0; k < K4; k += 16) {  // K4 is a multiple of 4: the last piece may be 4, 8 or 12 columns
    const __m512i n = _mm512_permutexvar_epi32(order, a16_values(x, k, K, sv));
    _mm256_mask_storeu_epi16(q + k, tail_mask16(K4 - k), _mm512_cvtepi32_epi16(n));
  }
}

template <int MR, int NR, typename Y>
LLMSERVE_VNNI16 __attribute__((optimize("no-tree-pre"))) void tile_a16(const int16_t* xq, int64_t ldx, int64_t G,
                                                                      const int8_t* w, int64_t block_bytes, int64_t i0,
                                                                      int64_t n0, int64_t N, const float* xs,
                                                                      const Epilogue& e, Y* y) {
  alignas(64) float sums[MR][NR][16];
  const int32_t* xr[MR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) xr[i] = reinterpret_cast<const int32_t*>(xq + (i0 + i) * ldx);
  for (int64_t g0 = 0; g0 < G; g0 += kA16ChunkGroups) {
    const int64_t g1 = std::min(G, g0 + kA16ChunkGroups);
    __m512i acc[MR][NR];
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t g = g0; g < g1; ++g) {
      if (MR <= 2)
        _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * block_bytes + g * 64) + kPrefetchBytes, _MM_HINT_T0);
      __m512i we[NR], wo[NR];
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
        const __m512i v = _mm512_loadu_si512(w + j * block_bytes + g * 64);
        we[j] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);  // bytes 0 and 2 of each lane, as int16
        wo[j] = _mm512_srai_epi16(v, 8);                         // bytes 1 and 3
      }
      _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
        const __m512i be = _mm512_set1_epi32(xr[i][2 * g]), bo = _mm512_set1_epi32(xr[i][2 * g + 1]);
        _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
          acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], be, we[j]);
          acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], bo, wo[j]);
        }
      }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
        const __m512 c = _mm512_cvtepi32_ps(acc[i][j]);
        _mm512_store_ps(sums[i][j], g0 == 0 ? c : _mm512_add_ps(_mm512_load_ps(sums[i][j]), c));
      }
  }
  __m512 out[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
    const __m512 sv = _mm512_set1_ps(xs[i0 + i]);
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) out[i][j] = _mm512_mul_ps(_mm512_load_ps(sums[i][j]), sv);
  }
  store_tile<MR, NR>(out, i0, n0, N, e, y);
}

// Groups [g0, g0 + gn) of nr packed int8 blocks -> int16 wf [nr][gn][2][32]: per group the lanes' bytes 0 and 2 (the
// register tile's `we`), then bytes 1 and 3 (`wo`).
LLMSERVE_VNNI16 void widen_blocks_a16(const int8_t* w, int64_t block_bytes, int nr, int64_t g0, int64_t gn, int16_t* wf) {
  for (int j = 0; j < nr; ++j)
    for (int64_t g = 0; g < gn; ++g) {
      const __m512i v = _mm512_loadu_si512(w + j * block_bytes + (g0 + g) * 64);
      int16_t* o = wf + (j * gn + g) * 64;
      _mm512_storeu_si512(o, _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8));
      _mm512_storeu_si512(o + 32, _mm512_srai_epi16(v, 8));
    }
}

// tile_a16 over weights widened beforehand for the int32 chunk of groups [g0, g0 + gn): the same vpdpwssd in the same
// order, and the chunk's sum added in fp32 to the partial sums carried in acc_rows (row stride kAccStride) between
// chunks, so the result is bit for bit tile_a16's.
template <int MR, int NR, typename Y>
LLMSERVE_VNNI16 __attribute__((optimize("no-tree-pre"))) void tile_wide_a16(
    const int16_t* xq, int64_t ldx, int64_t g0, int64_t gn, const int16_t* wf, int64_t i0, float* acc_rows, bool first,
    bool last, int64_t n0, int64_t N, const float* xs, const Epilogue& e, Y* y) {
  const int32_t* xr[MR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    xr[i] = reinterpret_cast<const int32_t*>(xq + (i0 + i) * ldx) + 2 * g0;
  __m512i acc[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < gn; ++g) {
    __m512i we[NR], wo[NR];
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
      we[j] = _mm512_loadu_si512(wf + (j * gn + g) * 64);
      wo[j] = _mm512_loadu_si512(wf + (j * gn + g) * 64 + 32);
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m512i be = _mm512_set1_epi32(xr[i][2 * g]), bo = _mm512_set1_epi32(xr[i][2 * g + 1]);
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], be, we[j]);
        acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], bo, wo[j]);
      }
    }
  }
  __m512 out[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
      const __m512 c = _mm512_cvtepi32_ps(acc[i][j]);
      out[i][j] = first ? c : _mm512_add_ps(_mm512_loadu_ps(acc_rows + i * kAccStride + j * kBlockRows), c);
    }
  if (!last) {
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
        _mm512_storeu_ps(acc_rows + i * kAccStride + j * kBlockRows, out[i][j]);
    return;
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
    const __m512 sv = _mm512_set1_ps(xs[i0 + i]);
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) out[i][j] = _mm512_mul_ps(out[i][j], sv);
  }
  store_tile<MR, NR>(out, i0, n0, N, e, y);
}

// x [M, K] -> xq [M, K4] int16 and xs [M] fp32: each row quantized by quantize(row, K, K4, q, s) (quantize_row_a16 or
// its AVX2 twin), rows in parallel.
template <typename X, typename Quantize>
void quantize_rows_a16(const at::Tensor& x, int64_t K4, at::Tensor& xq, at::Tensor& xs, const Quantize& quantize) {
  const int64_t M = x.size(0), K = x.size(1);
  xq = at::empty({M, K4}, x.options().dtype(at::kShort));
  xs = at::empty({M}, x.options().dtype(at::kFloat));
  int16_t* qp = xq.data_ptr<int16_t>();
  float* sp = xs.data_ptr<float>();
  const X* xp = x.data_ptr<X>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize(xp + i * K, K, K4, qp + i * K4, sp + i);
  });
}

template <typename X>
at::Tensor int8w_gemm_a16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Epilogue& e) {
  const int64_t M = x.size(0), NB = packed.size(0), G = packed.size(1), K4 = G * 4;
  at::Tensor xq, xs;
  quantize_rows_a16<X>(x, K4, xq, xs, [](const X* r, int64_t k, int64_t k4, int16_t* q, float* s) {
    quantize_row_a16(r, k, k4, q, s);
  });
  const int16_t* qp = xq.data_ptr<int16_t>();
  const float* sp = xs.data_ptr<float>();
  auto y = at::empty({M, N}, x.options());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t bb = G * 64;
  X* yp = y.data_ptr<X>();
  for_each_tile_widened<kA16TileRows, kA16WideTileRows, int16_t>(
      M, NB, G, kA16WideMinRows, kA16ChunkGroups, kTileBlocks * kA16ChunkGroups * 64,
      [&](auto mr, auto nb, int64_t i, int64_t blk) {
        tile_a16<decltype(mr)::value, decltype(nb)::value>(qp, K4, G, wp + blk * bb, bb, i, blk * kBlockRows, N, sp, e,
                                                           yp);
      },
      [&](int64_t blk, int nr, int64_t g0, int64_t gn, int16_t* wf) {
        widen_blocks_a16(wp + blk * bb, bb, nr, g0, gn, wf);
      },
      [&](auto mr, auto nb, int64_t i, int64_t blk, int64_t g0, int64_t gn, const int16_t* wf, float* acc, bool first,
          bool last) {
        tile_wide_a16<decltype(mr)::value, decltype(nb)::value>(qp, K4, g0, gn, wf, i, acc, first, last,
                                                                blk * kBlockRows, N, sp, e, yp);
      });
  return y;
}

// ---- The same product on AMX-INT8 tiles (CPUs with AMX) ----
// AMX has no int16 products, but each 16-bit activation q is 256 * hi + lo with hi = q >> 8 (signed byte) and
// lo = q & 255 (unsigned byte): x . w = 256 * (hi . w) + lo . w, one tdpbssd and one tdpbusd over the packed int8 weight
// as stored (its [16 groups][16 rows][4 bytes] are the B operand, as w8a8_linear.cpp's tiles read it). Both sums are
// exact in int32 over a 256-column chunk (|hi . w| <= 256 * 128 * 127, |lo . w| <= 256 * 255 * 127), and so is their
// combination (the chunk's exact sum, which vpdpwssd's int32 accumulators hold too), so each chunk's int32 sum, its
// conversion, the chunks' fp32 additions in column order and the rescale are tile_a16's: the same bits at any batch.
// Why: at 64 rows the VNNI register tiles do ~64 products a cycle and core; a tile product does 16,384 in ~16 cycles.
// w8a8's LM head (49152 x 576) on a 2-core Xeon with AMX (model 207), 64 rows, best of 15: 11.4 ms on VNNI, 5.3 in
// bf16 on AMX, 3.0 with int8 activations on AMX (which costs perplexity).
#define LLMSERVE_AMX16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))

constexpr int64_t kA16AmxGroups = 16;       // groups of 4 columns a tile step reads: 64 columns
constexpr int64_t kA16AmxChunkRows = 256;   // rows of x a work item takes at most
constexpr int64_t kA16AmxDefaultRows = 16;  // amx_rows < 0: the tiles from this many rows (calibration measures it)

// One row of x -> quantize_row_a16's int16 values, in column order, as bytes: lo[k] = q & 255, hi[k] = q >> 8; padding
// 0.
template <typename X>
LLMSERVE_VNNI16 void quantize_row_a16_split(const X* x, int64_t K, int64_t K4, uint8_t* lo, int8_t* hi, float* s) {
  *s = a16_scale(x, K);
  const __m512 sv = _mm512_set1_ps(*s);
  for (int64_t k = 0; k < K4; k += 16) {
    const __mmask16 out = tail_mask16(K4 - k);
    const __m512i n = a16_values(x, k, K, sv);
    _mm_mask_storeu_epi8(lo + k, out, _mm512_cvtepi32_epi8(n));  // the low byte
    _mm_mask_storeu_epi8(hi + k, out, _mm512_cvtepi32_epi8(_mm512_srai_epi32(n, 8)));
  }
}

// tmm0, tmm1: lo sums (block 0, block 1), tmm2, tmm3: hi sums, tmm4, tmm5: A (lo, hi bytes of r rows), tmm6, tmm7: B
class A16Tiles {
 public:
  LLMSERVE_AMX16 void configure(int r) {
    if (r == r_) return;
    TileConfig c;
    for (int k = 0; k < 8; ++k) {
      c.rows[k] = static_cast<uint8_t>(k >= 6 ? kA16AmxGroups : r);
      c.colsb[k] = 64;
    }
    load_tile_config(c);
    r_ = r;
  }
  LLMSERVE_AMX16 ~A16Tiles() {
    if (r_ >= 0) _tile_release();
  }

 private:
  int r_ = -1;
};

// Rows i0 .. i0 + r (r <= 16) by block w (and the next, bb bytes on, with two) -> y, through tile_a16's chunk sums and
// epilogue. G is a multiple of kA16AmxGroups.
template <bool TWO, typename Y>
LLMSERVE_AMX16 void unit_a16_amx(const uint8_t* lo, const int8_t* hi, int64_t ldx, int64_t G, const int8_t* w,
                                 int64_t bb, int r, int64_t i0, int64_t n0, int64_t N, const float* xs,
                                 const Epilogue& e, Y* y) {
  alignas(64) float sums[16][32];
  alignas(64) int32_t cl[16][32], ch[16][32];
  const uint8_t* l0 = lo + i0 * ldx;
  const int8_t* h0 = hi + i0 * ldx;
  for (int64_t g0 = 0; g0 < G; g0 += kA16ChunkGroups) {
    const int64_t g1 = std::min(G, g0 + kA16ChunkGroups);
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (TWO) {
      _tile_zero(1);
      _tile_zero(3);
    }
    for (int64_t g = g0; g < g1; g += kA16AmxGroups) {
      _tile_loadd(6, w + g * 64, 64);
      _tile_loadd(4, l0 + g * 4, ldx);
      _tile_loadd(5, h0 + g * 4, ldx);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbssd(2, 5, 6);
      if constexpr (TWO) {
        _tile_loadd(7, w + bb + g * 64, 64);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbssd(3, 5, 7);
      }
    }
    constexpr int64_t ldc = 32 * sizeof(int32_t);
    _tile_stored(0, &cl[0][0], ldc);
    _tile_stored(2, &ch[0][0], ldc);
    if constexpr (TWO) {
      _tile_stored(1, &cl[0][16], ldc);
      _tile_stored(3, &ch[0][16], ldc);
    }
    for (int i = 0; i < r; ++i)
      _Pragma("GCC unroll 2") for (int j = 0; j < (TWO ? 2 : 1); ++j) {
        const __m512i q = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(&ch[i][16 * j]), 8),
                                           _mm512_load_si512(&cl[i][16 * j]));
        const __m512 c = _mm512_cvtepi32_ps(q);
        _mm512_store_ps(&sums[i][16 * j], g0 == 0 ? c : _mm512_add_ps(_mm512_load_ps(&sums[i][16 * j]), c));
      }
  }
  for (int i = 0; i < r; ++i) {
    const __m512 sv = _mm512_set1_ps(xs[i0 + i]);
    _Pragma("GCC unroll 2") for (int j = 0; j < (TWO ? 2 : 1); ++j) {
      const __m512 out[1][1] = {{_mm512_mul_ps(_mm512_load_ps(&sums[i][16 * j]), sv)}};
      store_tile<1, 1>(out, i0 + i, n0 + j * kBlockRows, N, e, y);
    }
  }
}

// The tiles over every row. Work items: (chunk of at most kA16AmxChunkRows rows, pair of blocks), chunk-major, handed
// out in runs of consecutive pairs (work_queue.h), so a thread's items share its rows of x and read each pair once a
// chunk.
template <typename X>
at::Tensor int8w_gemm_a16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Epilogue& e) {
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), G = packed.size(1), K4 = G * 4;
  auto lo = at::empty({M, K4}, x.options().dtype(at::kByte));
  auto hi = at::empty({M, K4}, x.options().dtype(at::kChar));
  auto xs = at::empty({M}, x.options().dtype(at::kFloat));
  uint8_t* lp = lo.data_ptr<uint8_t>();
  int8_t* hp = hi.data_ptr<int8_t>();
  float* sp = xs.data_ptr<float>();
  const X* xp = x.data_ptr<X>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_row_a16_split(xp + i * K, K, K4, lp + i * K4, hp + i * K4, sp + i);
  });
  auto y = at::empty({M, N}, x.options());
  X* yp = y.data_ptr<X>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t bb = G * 64, pairs = (NB + 1) / 2;
  const int64_t nchunks = (M + kA16AmxChunkRows - 1) / kA16AmxChunkRows;
  const int64_t rows = ((M + nchunks - 1) / nchunks + 15) / 16 * 16;  // a chunk's, in whole units of 16 rows
  const int64_t chunks = (M + rows - 1) / rows;
  const int64_t run = std::max<int64_t>(1, chunks * pairs / (4 * at::get_num_threads()));
  parallel_units(chunks * pairs, run, [&](WorkCursor& cursor) {
    A16Tiles tiles;
    for (; cursor.valid(); cursor.advance()) {
      const int64_t u = cursor.unit(), c = u / pairs, b = u % pairs * 2;
      const int64_t m0 = c * rows, m1 = std::min(M, m0 + rows);
      const int8_t* w = wp + b * bb;
      for (int64_t i = m0; i < m1; i += 16) {
        const int r = static_cast<int>(std::min<int64_t>(16, m1 - i));
        tiles.configure(r);
        if (b + 1 < NB) unit_a16_amx<true>(lp, hp, K4, G, w, bb, r, i, b * kBlockRows, N, sp, e, yp);
        else unit_a16_amx<false>(lp, hp, K4, G, w, bb, r, i, b * kBlockRows, N, sp, e, yp);
      }
    }
  });
  return y;
}

// ---- The same 16-bit product on CPUs without AVX-512 (AVX2 + FMA: int8w_gemm's path there) ----
// vpmaddwd multiplies 16 int16 pairs and adds each pair into an int32 lane: with the weights' bytes 0 and 2 of a lane
// against x's (x0, x2) and bytes 1 and 3 against (x1, x3), two of them and two vpaddd give a lane what two vpdpwssd
// give it, as an exact int32 sum (a pair cannot overflow: |x| <= 32767). So each 256-column chunk's int32 sum is
// tile_a16's, and with the same fp32 steps after it (the chunks added in column order, * x's scale, * the weight's
// scale, + bias, no fused multiply-adds) every output is bit for bit the VNNI path's, at any batch, for finite x (a
// NaN's place in the max reduction differs: its row's scale may too). x is quantized as quantize_row_a16 does (the
// same division, rounding and clamp; the int32 -> int16 narrowing truncates as vpmovdw does). A packed block's group
// (64 bytes: 16 outputs x 4 columns) is two 256-bit halves of 8 outputs. int8w_gemm's a16=2 runs it on any CPU with
// AVX2 (AVX-512 ones too), so the tests compare its bits with the VNNI path's on one machine.
// Why: without it a CPU with AVX2 only ran --quantization int8 through torch, dequantizing the weights at every step
// (slower than fp32), and the native decoder stack, which needs packed linears, not at all. vpmaddwd's 16 products
// per instruction are twice an fp32 FMA's 8.
#define LLMSERVE_AVX2 __attribute__((target("avx2,fma")))

constexpr int kA16Avx2Rows = 4;  // 4 rows x 2 halves: 8 accumulators + 4 widened weights + 2 broadcasts in 16 registers

LLMSERVE_AVX2 inline __m256 load8f(const float* x) { return _mm256_loadu_ps(x); }
LLMSERVE_AVX2 inline __m256 load8f(const c10::BFloat16* x) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// x[k .. k + 7] as fp32, 0 past K
template <typename X>
LLMSERVE_AVX2 inline __m256 load8f_tail(const X* x, int64_t k, int64_t K) {
  if (K - k >= 8) return load8f(x + k);
  alignas(32) float buf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t j = k; j < K; ++j) buf[j - k] = static_cast<float>(x[j]);
  return _mm256_load_ps(buf);
}

// quantize_row_a16 with 8 lanes: the same scale (max|x| / 32767), values and order ([x0, x2, x1, x3] per 4 columns).
template <typename X>
LLMSERVE_AVX2 void quantize_row_a16_avx2(const X* x, int64_t K, int64_t K4, int16_t* q, float* s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(load8f_tail(x, k, K), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  *s = m > 0.f ? m / 32767.f : 1.f;
  const __m256 sv = _mm256_set1_ps(*s);
  const __m256i order = _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);
  // the low 16 bits of each int32 lane (vpmovdw's truncation), lane by lane into the low 8 bytes of each 128 bits
  const __m256i low_halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                              0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t k = 0; k < K4; k += 8) {  // K4 is a multiple of 4: the last piece may be 4 columns
    __m256 v = _mm256_round_ps(_mm256_div_ps(load8f_tail(x, k, K), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_set1_ps(32767.f), _mm256_max_ps(_mm256_set1_ps(-32767.f), v));
    const __m256i n = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(v), order);
    const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(n, low_halves), 0x08);  // 64-bit lanes 0, 2
    if (K4 - k >= 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm256_castsi256_si128(h));
    else _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm256_castsi256_si128(h));
  }
}

// y[i0 : i0 + MR, n0 : n0 + NB * 16] for one register tile (tile_a16's, in 8-lane halves): MR rows of int16 x (ldx
// apart, quantize_row_a16_avx2's order), NB packed int8 blocks (block_bytes apart).
template <int MR, int NB, typename Y>
LLMSERVE_AVX2 __attribute__((optimize("no-tree-pre"))) void tile_a16_avx2(const int16_t* xq, int64_t ldx, int64_t G,
                                                                         const int8_t* w, int64_t block_bytes,
                                                                         int64_t i0, int64_t n0, int64_t N,
                                                                         const float* xs, const Epilogue& e, Y* y) {
  constexpr int NH = 2 * NB;
  alignas(32) float sums[MR][NH][8];
  const int32_t* xr[MR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) xr[i] = reinterpret_cast<const int32_t*>(xq + (i0 + i) * ldx);
  for (int64_t g0 = 0; g0 < G; g0 += kA16ChunkGroups) {
    const int64_t g1 = std::min(G, g0 + kA16ChunkGroups);
    __m256i acc[MR][NH];
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
      _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) acc[i][h] = _mm256_setzero_si256();
    for (int64_t g = g0; g < g1; ++g) {
      if (MR <= 2)
        _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * block_bytes + g * 64) + kPrefetchBytes, _MM_HINT_T0);
      __m256i we[NH], wo[NH];
      _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (h / 2) * block_bytes + g * 64 +
                                                                              (h % 2) * 32));
        we[h] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);  // bytes 0 and 2 of each lane, as int16
        wo[h] = _mm256_srai_epi16(v, 8);                         // bytes 1 and 3
      }
      _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
        const __m256i be = _mm256_set1_epi32(xr[i][2 * g]), bo = _mm256_set1_epi32(xr[i][2 * g + 1]);
        _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) {
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(be, we[h]));
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(bo, wo[h]));
        }
      }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
      _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) {
        const __m256 c = _mm256_cvtepi32_ps(acc[i][h]);
        _mm256_store_ps(sums[i][h], g0 == 0 ? c : _mm256_add_ps(_mm256_load_ps(sums[i][h]), c));
      }
  }
  // store_tile's epilogue: ((sum * x's scale) * the weight's scale) + bias, rounded to Y (bf16: nearest even)
  _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) {
    const int64_t n = n0 + h * 8;
    if (n >= N) break;
    const int64_t lanes = std::min<int64_t>(8, N - n);
    alignas(32) float sc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, bi[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t l = 0; l < lanes; ++l) {
      if (e.scale != nullptr) sc[l] = e.scale[n + l];
      if (e.bias != nullptr) bi[l] = e.bias[n + l];
    }
    const __m256 wsv = _mm256_load_ps(sc), bv = _mm256_load_ps(bi);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      __m256 v = _mm256_mul_ps(_mm256_load_ps(sums[i][h]), _mm256_set1_ps(xs[i0 + i]));
      if (e.scale != nullptr) v = _mm256_mul_ps(v, wsv);
      if (e.bias != nullptr) v = _mm256_add_ps(v, bv);
      Y* out = y + (i0 + i) * N + n;
      if constexpr (std::is_same_v<Y, float>) {
        if (lanes == 8) {
          _mm256_storeu_ps(out, v);
          continue;
        }
      }
      alignas(32) float r[8];
      _mm256_store_ps(r, v);
      for (int64_t l = 0; l < lanes; ++l) out[l] = static_cast<Y>(r[l]);  // c10::BFloat16: nearest even, NaN 0x7FC0
    }
  }
}

template <typename X>
at::Tensor int8w_gemm_a16_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t N, const Epilogue& e) {
  const int64_t M = x.size(0), NB = packed.size(0), G = packed.size(1), K4 = G * 4;
  at::Tensor xq, xs;
  quantize_rows_a16<X>(x, K4, xq, xs, [](const X* r, int64_t k, int64_t k4, int16_t* q, float* s) {
    quantize_row_a16_avx2(r, k, k4, q, s);
  });
  const int16_t* qp = xq.data_ptr<int16_t>();
  const float* sp = xs.data_ptr<float>();
  auto y = at::empty({M, N}, x.options());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t bb = G * 64;
  X* yp = y.data_ptr<X>();
  // Tiles of up to 4 rows by 1 block, or of 1 row by 2 blocks (what 16 registers hold: 4 accumulators, 8 widened
  // weights, 2 broadcasts): 2 blocks a tile group.
  for_each_tile_group(M, NB, kChunkRows, kA16Avx2Rows, 2, [&](int64_t) {
    return [&](int64_t m0, int64_t m1, int64_t blk, int nr) {
      for (int64_t i = m0; i < m1; i += kA16Avx2Rows) {
        const int mr = static_cast<int>(std::min<int64_t>(kA16Avx2Rows, m1 - i));
        if (mr == 1 && nr == 2) {
          tile_a16_avx2<1, 2>(qp, K4, G, wp + blk * bb, bb, i, blk * kBlockRows, N, sp, e, yp);
          continue;
        }
        for (int j = 0; j < nr; ++j)
          with_int_constant<1, kA16Avx2Rows>(mr, [&](auto r) {
            tile_a16_avx2<decltype(r)::value, 1>(qp, K4, G, wp + (blk + j) * bb, bb, i, (blk + j) * kBlockRows, N, sp,
                                                  e, yp);
          });
      }
    };
  });
  return y;
}

// ---- fp32 weights on CPUs with AVX2 and FMA (fp32_gemm: an fp32 model's linears, where measured faster) ----
// fp32_pack's layout is the bf16 one with one column per lane: [N/16][K][16], each block one contiguous stream of K
// rows of its 16 outputs (two 8-lane halves). A register tile is MR rows of x by NB blocks: each k loads the blocks'
// halves once and multiplies each with x[i, k] broadcast, an FMA into lanes that hold one output each, so every output
// is summed over k in order from 0 (then + bias) whatever the tile, the batch or the thread: a row's result does not
// depend on the other rows. Tiles: 6 rows x 1 block (12 accumulators, 2 weights, 1 broadcast: AVX2's 16 registers,
// the classic 6 x 16 shape) for chunks of 3 rows and more; 2 x 2 and 1 x 4 (8 accumulators) for one or two rows,
// where the weights stream from memory. Every tile prefetches its blocks ahead: on the Zen 3 below, prefetching only
// in the 1-2 row tiles left 4-32 rows at 26-93 GFLOP/s, prefetching in all 36-121.
// Why: an fp32 model's linears ran in oneDNN, whose one-row products read the weights at 12-14 GB/s on a 2-core AMD
// EPYC Zen 3 (AVX2 only; 24-30 GB/s from memory). SmolLM2-135M's 30 decoders and LM head (538 MB), best of 5, this
// kernel against oneDNN's blocked matmul: 1 row 22-29 against 45 ms, 4 rows 27-31 against 54, 16 rows 48 against 77,
// 64 rows 131 against 188, 256-1,024 rows 159-160 GFLOP/s against 119-131 (the FMA peak measured 161). Which of the
// two runs is measured on the running machine (kernels/calibrate.py's fp32_linear), never assumed from the flags.
constexpr int kF32Rows = 6;
constexpr int kF32Blocks = 4;

template <int MR, int NB>
LLMSERVE_AVX2 __attribute__((optimize("no-tree-pre"))) void tile_f32_avx2(const float* x, int64_t ldx, int64_t K,
                                                                         const float* w, int64_t block_elems,
                                                                         int64_t i0, int64_t n0, int64_t N,
                                                                         const float* bias, float* y) {
  constexpr int NH = 2 * NB;
  __m256 acc[MR][NH];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) acc[i][h] = _mm256_setzero_ps();
  const float* xr[MR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) xr[i] = x + (i0 + i) * ldx;
  _Pragma("GCC unroll 2") for (int64_t k = 0; k < K; ++k) {
    _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * block_elems + k * 16) + kPrefetchBytes, _MM_HINT_T0);
    __m256 wv[NH];
    _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h)
      wv[h] = _mm256_loadu_ps(w + (h / 2) * block_elems + k * 16 + (h % 2) * 8);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m256 b = _mm256_broadcast_ss(xr[i] + k);
      _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) acc[i][h] = _mm256_fmadd_ps(b, wv[h], acc[i][h]);
    }
  }
  _Pragma("GCC unroll 8") for (int h = 0; h < NH; ++h) {
    const int64_t n = n0 + h * 8;
    if (n >= N) break;
    const int64_t lanes = std::min<int64_t>(8, N - n);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      float* out = y + (i0 + i) * N + n;
      if (lanes == 8) {
        _mm256_storeu_ps(out, bias != nullptr ? _mm256_add_ps(acc[i][h], _mm256_loadu_ps(bias + n)) : acc[i][h]);
        continue;
      }
      alignas(32) float r[8];
      _mm256_store_ps(r, acc[i][h]);
      for (int64_t l = 0; l < lanes; ++l) out[l] = bias != nullptr ? r[l] + bias[n + l] : r[l];
    }
  }
}

at::Tensor fp32_gemm_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), be = K * kBlockRows;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  for_each_tile_group(M, NB, kChunkRows, kF32Rows, kF32Blocks, [&](int64_t) {
    return [&](int64_t m0, int64_t m1, int64_t blk, int nr) {
      if (m1 - m0 <= 2) {  // one or two rows: tiles across the blocks, which stream from memory
        if (m1 - m0 == 2) {
          int j = 0;
          for (; j + 2 <= nr; j += 2)
            tile_f32_avx2<2, 2>(xp, K, K, wp + (blk + j) * be, be, m0, (blk + j) * kBlockRows, N, bias, yp);
          if (j < nr) tile_f32_avx2<2, 1>(xp, K, K, wp + (blk + j) * be, be, m0, (blk + j) * kBlockRows, N, bias, yp);
          return;
        }
        with_int_constant<1, kF32Blocks>(nr, [&](auto nb) {
          tile_f32_avx2<1, decltype(nb)::value>(xp, K, K, wp + blk * be, be, m0, blk * kBlockRows, N, bias, yp);
        });
        return;
      }
      for (int j = 0; j < nr; ++j)  // a block's weights stay in cache while the chunk's rows go past them
        for (int64_t i = m0; i < m1; i += kF32Rows)
          with_int_constant<1, kF32Rows>(static_cast<int>(std::min<int64_t>(kF32Rows, m1 - i)), [&](auto r) {
            tile_f32_avx2<decltype(r)::value, 1>(xp, K, K, wp + (blk + j) * be, be, i, (blk + j) * kBlockRows, N,
                                                 bias, yp);
          });
    };
  });
  return y;
}

// bias [N] (any float dtype) -> contiguous fp32 in holder, or nullptr without one
const float* fp32_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* what, at::Tensor& holder) {
  if (!bias.has_value()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(holder.numel() == N, what, ": bias [N]");
  return holder.data_ptr<float>();
}

}  // namespace

bool packed_gemm_supported() { return cpu_has_avx512(); }

// int8w_gemm runs here: AVX-512 (every path), or AVX2 with FMA (16-bit activations only: int8w_gemm_a16_avx2), unless
// LLMSERVE_INT8W_A16=0 asks for fp32 activations, which only the AVX-512 path has.
bool int8w_avx2_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool int8w_supported() {
  static const bool ok = packed_gemm_supported() || (int8w_avx2_supported() && !env_is_zero("LLMSERVE_INT8W_A16"));
  return ok;
}
// Whether int8w_gemm's default (a16 < 0) quantizes x to int16 here: VNNI (unless LLMSERVE_INT8W_A16=0), or AVX2 only.
bool int8w_default_a16() { return packed_gemm_supported() ? a16_default() : int8w_supported(); }

// weight [N, K] bf16 -> [ceil(N / 16), ceil(K / 2), 16, 2] bf16: per block of 16 output rows, the columns in pairs,
// each pair holding its 2 elements of the 16 rows; zero past N and K.
at::Tensor bf16_pack(at::Tensor weight) {
  return pack_weight_blocks<uint16_t>(weight, at::kBFloat16, Bf16Weights::kGroup,
                                      "bf16_pack: weight must be bf16 [N, K] on the CPU");
}

// x [M, K] bf16; packed: bf16_pack of the weight [N, K]; n: N; bias [N] (any float dtype) or None -> [M, N] bf16.
// path: 0 multiplies with fp32 FMAs on widened weights, 1 with vdpbf16ps (tile_dot; needs bf16_dot_supported()), 2 on
// AMX tiles (amx_gemm.cpp; needs amx_bf16_supported() and K a multiple of 32).
// glu (path 2 only): the weight is gate then up (n = 2 I) and the result silu(gate) * up [M, I] (bf16_gemm_amx).
at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias,
                     int64_t path, bool glu) {
  TORCH_CHECK(packed_gemm_supported(), "bf16_gemm needs a CPU with AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_gemm: x must be bf16 [M, K] on the CPU");
  const int64_t K = x.size(1), N = n;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kBlockRows && packed.size(3) == 2,
              "bf16_gemm: packed must be bf16_pack's contiguous bf16 [N / 16, K / 2, 16, 2]");
  TORCH_CHECK(N > 0 && packed.size(0) == (N + kBlockRows - 1) / kBlockRows && packed.size(1) == (K + 1) / 2,
              "bf16_gemm: packed weight ", packed.sizes(), " does not fit x's ", K, " columns and ", N, " outputs");
  at::Tensor b;
  const Epilogue e{nullptr, fp32_bias(bias, N, "bf16_gemm", b)};
  TORCH_CHECK(path >= 0 && path <= 2, "bf16_gemm: path 0 (fma), 1 (dot) or 2 (amx), got ", path);
  TORCH_CHECK(!glu || path == 2, "bf16_gemm: the fused gate/up (glu) runs on the amx path only");
  if (path == 2) return bf16_gemm_amx(x.contiguous(), packed, N, e.bias, glu);
  TORCH_CHECK(path == 0 || bf16_dot_supported(), "bf16_gemm: the dot path needs a CPU with AVX512-BF16");
  if (path == 1) return packed_gemm_dot(x.contiguous(), packed, N, e);
  return packed_gemm<Bf16Weights, at::BFloat16>(x.contiguous(), packed, N, e);
}

bool fp32_gemm_supported() { return int8w_avx2_supported(); }

// weight [N, K] fp32 -> [ceil(N / 16), K, 16, 1] fp32: per block of 16 output rows, each column's 16 elements
// together; zero past N.
at::Tensor fp32_pack(at::Tensor weight) {
  return pack_weight_blocks<float>(weight, at::kFloat, 1, "fp32_pack: weight must be fp32 [N, K] on the CPU");
}

// x [M, K] fp32; packed: fp32_pack of the weight [N, K]; n: N; bias [N] (any float dtype) or None -> [M, N] fp32, each
// output summed over k in order with FMAs (then + bias), whatever M. Needs fp32_gemm_supported() (AVX2 and FMA).
at::Tensor fp32_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(fp32_gemm_supported(), "fp32_gemm needs a CPU with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "fp32_gemm: x must be fp32 [M, K] on the CPU");
  const int64_t K = x.size(1), N = n;
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kBlockRows && packed.size(3) == 1,
              "fp32_gemm: packed must be fp32_pack's contiguous fp32 [N / 16, K, 16, 1]");
  TORCH_CHECK(N > 0 && packed.size(0) == (N + kBlockRows - 1) / kBlockRows && packed.size(1) == K,
              "fp32_gemm: packed weight ", packed.sizes(), " does not fit x's ", K, " columns and ", N, " outputs");
  at::Tensor b;
  return fp32_gemm_avx2(x.contiguous(), packed, N, fp32_bias(bias, N, "fp32_gemm", b));
}

// Weight-only int8: x [M, K] fp32 or bf16; packed: w8a8_pack of the int8 weight [N, K]; scale [N] fp32 (the weight is
// packed * scale per output row); bias [N] (any float dtype) or None -> [M, N] in x's dtype.
// a16: 1 quantizes x to int16 per row (int8w_gemm_a16, needs int8w_a16_supported(); on a CPU with AVX2 but not
// AVX-512, int8w_gemm_a16_avx2), 0 keeps it in fp32 (FMAs, AVX-512 only), < 0 picks (int8w_default_a16()), 2 runs
// int8w_gemm_a16_avx2 on any CPU with AVX2 (the same bits as 1). amx_rows (16-bit activations only): batches of at least this many rows run on
// AMX-INT8 tiles where the CPU has them and K is a multiple of 64 (int8w_gemm_a16_amx: the same bits); 0: never; < 0:
// the kernel's default (kA16AmxDefaultRows).
at::Tensor int8w_gemm(at::Tensor x, at::Tensor packed, at::Tensor scale, c10::optional<at::Tensor> bias,
                      int64_t a16, int64_t amx_rows) {
  TORCH_CHECK(int8w_supported() || (a16 == 2 && int8w_avx2_supported()),
              "int8w_gemm needs a CPU with AVX-512, or AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int8w_gemm: x must be fp32 or bf16 [M, K] on the CPU");
  const int64_t K = x.size(1), N = scale.numel();
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kBlockRows && packed.size(3) == 4,
              "int8w_gemm: packed must be w8a8_pack's contiguous int8 [N / 16, K / 4, 16, 4]");
  TORCH_CHECK(N > 0 && packed.size(0) == (N + kBlockRows - 1) / kBlockRows && packed.size(1) == (K + 3) / 4,
              "int8w_gemm: packed weight ", packed.sizes(), " does not fit x's ", K, " columns and scale's ", N, " rows");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "int8w_gemm: scale must be contiguous fp32 [N]");
  at::Tensor b;
  const Epilogue e{scale.data_ptr<float>(), fp32_bias(bias, N, "int8w_gemm", b)};
  const auto xc = x.contiguous();
  TORCH_CHECK(a16 <= 0 || int8w_a16_supported() || !packed_gemm_supported(),
              "int8w_gemm: 16-bit activations (a16=1) need a CPU with AVX512-VNNI; "
              "pass a16=0 (fp32 activations) or -1 (whichever runs here)");
  TORCH_CHECK(a16 != 2 || int8w_avx2_supported(), "int8w_gemm: a16=2 (the AVX2 path) needs a CPU with AVX2 and FMA");
  if (a16 == 2 || !packed_gemm_supported()) {  // AVX2: 16-bit activations only
    TORCH_CHECK(a16 != 0, "int8w_gemm: fp32 activations (a16=0) need a CPU with AVX-512; pass a16=-1 (whichever runs "
                "here)");
    if (xc.scalar_type() == at::kBFloat16) return int8w_gemm_a16_avx2<at::BFloat16>(xc, packed, N, e);
    return int8w_gemm_a16_avx2<float>(xc, packed, N, e);
  }
  if (a16 > 0 || (a16 < 0 && a16_default())) {
    if (amx_rows < 0) amx_rows = kA16AmxDefaultRows;
    if (amx_rows > 0 && xc.size(0) >= amx_rows && packed.size(1) % kA16AmxGroups == 0 && amx_int8_supported()) {
      if (xc.scalar_type() == at::kBFloat16) return int8w_gemm_a16_amx<at::BFloat16>(xc, packed, N, e);
      return int8w_gemm_a16_amx<float>(xc, packed, N, e);
    }
    if (xc.scalar_type() == at::kBFloat16) return int8w_gemm_a16<at::BFloat16>(xc, packed, N, e);
    return int8w_gemm_a16<float>(xc, packed, N, e);
  }
  if (xc.scalar_type() == at::kBFloat16) return packed_gemm<Int8Weights, at::BFloat16>(xc, packed, N, e);
  return packed_gemm<Int8Weights, float>(xc, packed, N, e);
}
