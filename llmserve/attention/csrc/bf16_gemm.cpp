// bf16 linear on CPU without AMX: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 in and out, fp32 products and sums,
// over a weight packed once at load (bf16_pack): per block of 16 output rows, the columns in pairs,
// [N/16][K/2][16][2]. One 64-byte load holds 2 columns of 16 outputs; a shift and a mask widen them to two fp32
// vectors (bf16 is the top half of fp32), each multiplied by one element of a row of x broadcast to every lane,
// so the 16 sums land in the lanes they belong to (no horizontal sums), and every block is one contiguous stream.
// A register tile is 6 rows of x by 4 blocks (24 accumulators).
//
// Why: on a CPU with AVX512-BF16 but no AMX, vdpbf16ps runs at half the rate of fp32 FMAs, so bf16 GEMMs (oneDNN's
// included) top out near half the fp32 peak; widening in registers and using FMAs keeps the weight in bf16 (half
// the bytes of fp32) and the arithmetic at FMA speed. Products of bf16 values are exact in fp32 and each output is
// summed over k in order, so a row's result does not depend on the other rows of the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "avx512_math.h"  // LLMSERVE_AVX512, storeu16, tail_mask16

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlockRows = 16;   // outputs per packed block
constexpr int kTileRows = 6;
constexpr int kTileBlocks = 4;
constexpr int64_t kChunkRows = 240;  // rows of x per work unit at most (for_each_tile_group)
constexpr int64_t kSerialElems = 32768;  // below this many elements widening x runs on one thread

// Tiles of one or two rows of x are bound by streaming the weights: they prefetch each block this far ahead (the
// hardware streamers stop at 4 KB pages). SmolLM2-135M's decoders and LM head at one row, median of 30:
// 10.0-10.2 ms against 11.9-12.1 without.
constexpr int64_t kPrefetchBytes = 1024;
// A tile's sums (+ bias) rounded to bf16 into y[i0 : i0 + MR, n0 : n0 + NR * 16], columns below N.
template <int MR, int NR>
LLMSERVE_AVX512 __attribute__((always_inline)) inline void store_tile(const __m512 (&acc)[MR][NR], int64_t i0, int64_t n0,
                                                                      int64_t N, const float* bias, c10::BFloat16* y) {
  _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
    const int64_t n = n0 + j * kBlockRows;
    const __mmask16 m = tail_mask16(N - n);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + n) : _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(acc[i][j], bv) : acc[i][j];
      storeu16(y + (i0 + i) * N + n, v, m);
    }
  }
}

// y[i0 : i0 + MR, n0 : n0 + NR * 16] for one register tile: MR rows of fp32 x (K2 pairs each, ldx apart), NR packed
// blocks (K2 pairs of [16 rows][2] bf16 each, block_elems apart).
// no-tree-pre: GCC 12 otherwise keeps the accumulators on the stack (see w8a8_linear.cpp).
template <int MR, int NR>
LLMSERVE_AVX512 __attribute__((optimize("no-tree-pre"))) void tile(const float* x, int64_t ldx, int64_t K2,
                                                                 const uint16_t* w, int64_t block_elems, int64_t i0,
                                                                 int64_t n0, int64_t N, const float* bias,
                                                                 c10::BFloat16* y) {
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t g = 0; g < K2; ++g) {
    // column 2g: the low bf16 of each 32-bit pair, shifted up; column 2g + 1: the high one, masked
    __m512 wv[NR];
    if (MR <= 2)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * block_elems + g * 32) + kPrefetchBytes, _MM_HINT_T0);
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
      wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + j * block_elems + g * 32), 16));
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(x[(i0 + i) * ldx + 2 * g]);
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(b, wv[j], acc[i][j]);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
      wv[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + j * block_elems + g * 32), high));
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(x[(i0 + i) * ldx + 2 * g + 1]);
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(b, wv[j], acc[i][j]);
    }
  }
  store_tile<MR, NR>(acc, i0, n0, N, bias, y);
}

// The same tile over fp32 weights widened beforehand (widen_blocks) for columns [k0, k0 + kn): chunks of kWideMinRows
// rows and more widen each block once per chunk instead of once per tile, so the loop is loads, broadcasts and FMAs only.
// The sums run over k in the same order with the same FMAs, carried in acc (fp32, row stride kAccStride) between
// column chunks, so the result is bit for bit the narrow tile's.
constexpr int64_t kAccStride = kTileBlocks * kBlockRows;

template <int MR, int NR>
LLMSERVE_AVX512 __attribute__((optimize("no-tree-pre"))) void tile_wide(
    const float* x, int64_t ldx, int64_t k0, int64_t kn, const float* wf, int64_t wf_stride, int64_t i0, float* acc_rows,
    bool first, bool last, int64_t n0, int64_t N, const float* bias, c10::BFloat16* y) {
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
  store_tile<MR, NR>(acc, i0, n0, N, bias, y);
}

// Pairs [g0, g0 + gn) of nr packed blocks -> fp32 wf [nr][2 gn][16] (column 2g, then 2g + 1).
LLMSERVE_AVX512 void widen_blocks(const uint16_t* w, int64_t block_elems, int nr, int64_t g0, int64_t gn, float* wf) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int j = 0; j < nr; ++j)
    for (int64_t g = 0; g < gn; ++g) {
      const __m512i v = _mm512_loadu_si512(w + j * block_elems + (g0 + g) * 32);
      float* o = wf + (j * 2 * gn + 2 * g) * kBlockRows;
      _mm512_storeu_ps(o, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
      _mm512_storeu_ps(o + kBlockRows, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
    }
}

constexpr int64_t kWidePairs = 64;  // column pairs widened at once: 4 blocks x 128 columns x 16 fp32 = 32 KB (L1)
// Chunks of at least this many rows take the widened path. SmolLM2's decoders, best of 5, alternated with the
// registers-only path: 256-1,024 rows 284-287 GFLOP/s against 260-267; 64-128 rows the same; 16-36 rows 10-25%
// slower (each column chunk reloads the partial sums, and too few tiles share a widening).
constexpr int64_t kWideMinRows = 96;

// rows of bf16 x -> fp32, K2 * 2 per row (the padding column 0)
LLMSERVE_AVX512 void widen_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t ld, float* out) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 m = tail_mask16(K - k);
      _mm512_mask_storeu_ps(out + i * ld + k, m, loadu16(x + i * K + k, m));
    }
    for (int64_t k = K; k < ld; ++k) out[i * ld + k] = 0.f;
  }
}

}  // namespace

bool bf16_gemm_supported() { return cpu_has_avx512(); }

// weight [N, K] bf16 -> [ceil(N / 16), ceil(K / 2), 16, 2] bf16: per block of 16 output rows, the columns in pairs,
// each pair holding its 2 elements of the 16 rows; zero past N and K.
torch::Tensor bf16_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.device().is_cpu(),
              "bf16_pack: weight must be bf16 [N, K] on the CPU");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kBlockRows - 1) / kBlockRows, K2 = (K + 1) / 2;
  auto packed = torch::zeros({NB, K2, kBlockRows, 2}, w.options());
  pack_blocks(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N, K, 2,
              reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()));
  return packed;
}

// x [M, K] bf16; packed: bf16_pack of the weight [N, K]; n: N; bias [N] (any float dtype) or None -> [M, N] bf16.
torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(bf16_gemm_supported(), "bf16_gemm needs a CPU with AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_gemm: x must be bf16 [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1), N = n;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kBlockRows && packed.size(3) == 2,
              "bf16_gemm: packed must be bf16_pack's contiguous bf16 [N / 16, K / 2, 16, 2]");
  TORCH_CHECK(N > 0 && packed.size(0) == (N + kBlockRows - 1) / kBlockRows && packed.size(1) == (K + 1) / 2,
              "bf16_gemm: packed weight ", packed.sizes(), " does not fit x's ", K, " columns and ", N, " outputs");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bf16_gemm: bias [N]");
  }
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const auto xc = x.contiguous();
  const int64_t NB = packed.size(0), K2 = packed.size(1), ld = K2 * 2;
  auto xf = torch::empty({M, ld}, xc.options().dtype(at::kFloat));
  float* xp = xf.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / ld), [&](int64_t begin, int64_t end) {
    widen_rows(xc.data_ptr<at::BFloat16>() + begin * K, end - begin, K, ld, xp + begin * ld);
  });
  auto y = torch::empty({M, N}, xc.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t be = K2 * 32;  // elements per packed block
  auto* yp = y.data_ptr<at::BFloat16>();
  for_each_tile_group(M, NB, kChunkRows, kTileRows, kTileBlocks, [&](int64_t rows) {
    // per thread: widened weights of a tile's blocks, and the chunk's partial sums between column chunks
    const bool wide = rows >= kWideMinRows;
    return [&, wf = std::vector<float>(wide ? kTileBlocks * 2 * kWidePairs * kBlockRows : 0),
            acc = std::vector<float>(wide ? rows * kAccStride : 0)](int64_t m0, int64_t m1, int64_t blk,
                                                                     int nr) mutable {
      if (m1 - m0 < kWideMinRows) {  // widen in registers, each tile on its own
        for (int64_t i = m0; i < m1; i += kTileRows)
          dispatch_tile<kTileRows, kTileBlocks>(static_cast<int>(std::min<int64_t>(kTileRows, m1 - i)), nr,
                                                [&](auto mr, auto nb) {
            tile<decltype(mr)::value, decltype(nb)::value>(xp, ld, K2, wp + blk * be, be, i, blk * kBlockRows, N, bp, yp);
          });
        return;
      }
      for (int64_t g0 = 0; g0 < K2; g0 += kWidePairs) {
        const int64_t gn = std::min(kWidePairs, K2 - g0);
        widen_blocks(wp + blk * be, be, nr, g0, gn, wf.data());
        for (int64_t i = m0; i < m1; i += kTileRows)
          dispatch_tile<kTileRows, kTileBlocks>(static_cast<int>(std::min<int64_t>(kTileRows, m1 - i)), nr,
                                                [&](auto mr, auto nb) {
            tile_wide<decltype(mr)::value, decltype(nb)::value>(xp, ld, 2 * g0, 2 * gn, wf.data(), 2 * gn * kBlockRows,
                                                                i, acc.data() + (i - m0) * kAccStride, g0 == 0,
                                                                g0 + gn >= K2, blk * kBlockRows, N, bp, yp);
          });
      }
    };
  });
  return y;
}
