// AVX-512 helpers shared by the kernels (compiled through target attributes: the extension itself is built
// for generic x86-64 or AVX2, and callers check the CPU at run time).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "work_queue.h"  // parallel_units, env_is_zero

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#define LLMSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
// Code that also runs vdpbf16ps (AVX512-BF16: bf16 pairs multiplied and summed into fp32); callers check
// cpu_has_avx512_bf16() first.
#define LLMSERVE_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// Whether this CPU runs LLMSERVE_AVX512 code (F, BW, DQ and VL); asked once.
inline bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return ok;
}

// Whether this CPU also runs LLMSERVE_AVX512BF16 code; asked once.
inline bool cpu_has_avx512_bf16() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

// exp(x) for x <= 0 (paged_decode.cpp's exp256 polynomial, Cephes, ~2 ulp), 16 lanes.
LLMSERVE_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 lanes loaded as fp32: load16 whole, loadu16 masked (masked-off lanes read as 0).
LLMSERVE_AVX512 inline __m512 widen_bf16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
LLMSERVE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
LLMSERVE_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
LLMSERVE_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
LLMSERVE_AVX512 inline __m512 load16(const int8_t* p) {  // int8 KV caches: the caller applies the scale
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// dst[0:D] = an int4 row dequantized (D % 16 == 0; decode and prefill attention): each lane's code picks its value
// from a table of the row's 16, scale * c + zero for c = 0..15 (mul then add: torch_backend.dequantize's roundings),
// where widening each code to fp32 and then scaling it took three more operations per 16 values. (2-vCPU Xeon, model
// 167, 30 layers of 64 requests x 285 tokens: decode attention over an int4 cache is bound by its arithmetic,
// 18.4-18.6 ms with one layer's cache in L3 against 22.0-23.0 from memory; with the table 17.5-17.9 / 21.0-21.5,
// alternated.) Widening a
// bf16 or int4 row's even and odd dims apart by a shift and a mask (the query and output permuted to match) was tried
// as well: int4 gained ~5% more, bf16 nothing (13.7 against 13.9 ms in L2), not worth the permutations.
LLMSERVE_AVX512 inline void widen_int4_row(const uint8_t* row, const c10::Half* param, int64_t D, float* dst) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(static_cast<float>(param[0])), codes),
                                     _mm512_set1_ps(static_cast<float>(param[1])));
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t c = 0; c < D; c += 16) {  // 16 codes from 8 bytes (pack_int4's layout: 2i low nibble, 2i + 1 high)
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2));
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm512_storeu_ps(dst + c, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table));
  }
}
LLMSERVE_AVX512 inline __m512 loadu16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
LLMSERVE_AVX512 inline __m512 loadu16(const c10::BFloat16* p, __mmask16 m) {
  return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}

// fp32 stores, rounding to nearest even for bf16 as torch's casts do.

// fp32 -> bf16 bits (in the low half of each lane), nearest even, NaN kept quiet.
LLMSERVE_AVX512 inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

LLMSERVE_AVX512 inline void storeu16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
LLMSERVE_AVX512 inline void storeu16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// silu(x) = x / (1 + exp(-x)) as torch computes it, unrounded, with exp taken of -|x| only (exp512 is for arguments
// <= 0): for x < 0 the same quotient is x exp(x) / (1 + exp(x)). The quotient as num * (1 / d), the reciprocal from
// vrcp14ps and one Newton step (within 2 ulp; vdivps's latency and throughput made silu_mul ~2x slower at a
// 2,000-token prefill's 3M elements). fused_ops.cpp's silu_mul and amx_gemm.cpp's fused gate/up both use it.
LLMSERVE_AVX512 inline __m512 silu16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp512(_mm512_or_ps(x, _mm512_set1_ps(-0.f)));  // exp(-|x|)
  const __m512 num = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), x, e);
  const __m512 d = _mm512_add_ps(one, e);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, one), r);
  return _mm512_mul_ps(num, r);
}

// v rounded to bf16 (nearest even, as storeu16 and torch's casts), as fp32
LLMSERVE_AVX512 inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }

// v0 and v1 rounded to bf16 as bf16_bits does, as one vector of 32 (v0's 16 first, the order they sit in memory): one
// vcvtne2ps2bf16 where no lane is NaN or denormal (which that instruction reads as zero / keeps the sign and payload
// of), else bf16_bits' integer rounding. Same bits either way; ~3 instructions a vector against bf16_bits' ~9 with its
// narrowing (the fused ops' roundings: fused_ops.cpp).
LLMSERVE_AVX512BF16 inline __m512i bf16_pair(__m512 v0, __m512 v1) {
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // vfpclassps: quiet NaN, denormal, signalling NaN
  if ((_mm512_fpclass_ps_mask(v0, kNanOrDenormal) | _mm512_fpclass_ps_mask(v1, kNanOrDenormal)) == 0)
    return (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(v0))),
                            _mm512_cvtepi32_epi16(bf16_bits(v1)), 1);
}

// The 32 bf16 of p (bf16_pair's) widened to fp32: the first 16, the last 16.
LLMSERVE_AVX512 inline __m512 bf16_first(__m512i p) { return widen_bf16(_mm512_castsi512_si256(p)); }
LLMSERVE_AVX512 inline __m512 bf16_last(__m512i p) { return widen_bf16(_mm512_extracti64x4_epi64(p, 1)); }

inline __mmask16 tail_mask16(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// The packed-weight GEMMs' weight layout: src [N, K] row-major -> dst [ceil(N / 16), ceil(K / group), 16, group], for
// each block of 16 output rows the columns in groups, each group holding its `group` elements of the 16 rows. dst
// must come zeroed (the padding past N and K stays 0).
template <typename T>
inline void pack_blocks(const T* src, int64_t N, int64_t K, int64_t group, T* dst) {
  const int64_t NB = (N + 15) / 16, G = (K + group - 1) / group;
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < 16 && b * 16 + r < N; ++r) {
        const T* row = src + (b * 16 + r) * K;
        T* out = dst + (b * G * 16 + r) * group;  // group g of this row at out + g * 16 * group
        for (int64_t g = 0; g < G; ++g)
          for (int64_t j = 0; j < group && g * group + j < K; ++j) out[g * 16 * group + j] = row[g * group + j];
      }
  });
}

// weight [N, K] of `type` (T's bytes) on the CPU -> a new zeroed [ceil(N / 16), ceil(K / group), 16, group] tensor filled by
// pack_blocks: bf16_pack and w8a8_pack. `refusal`: the message for any other weight.
template <typename T>
inline at::Tensor pack_weight_blocks(const at::Tensor& weight, at::ScalarType type, int64_t group, const char* refusal) {
  TORCH_CHECK(weight.scalar_type() == type && weight.dim() == 2 && weight.device().is_cpu(), refusal);
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  auto packed = at::zeros({(N + 15) / 16, (K + group - 1) / group, 16, group}, w.options());
  pack_blocks(static_cast<const T*>(w.data_ptr()), N, K, group, static_cast<T*>(packed.data_ptr()));
  return packed;
}

// The work split of the packed-weight GEMMs (w8a8_linear.cpp, packed_gemm.cpp). The M rows of x are cut into balanced
// chunks of at most max_rows (a multiple of tile_rows; a chunk's rows of x stay in L2), and the work units are
// (chunk, span of whole tile groups of blocks), chunk-major, about four spans a thread over the call, handed out by
// work_queue.h's queue: at a few rows the threads split the weights and with many rows the chunks, and a thread that
// is ahead takes more of them. make_worker(rows) is called once per thread (rows: the
// chunk size, for its scratch); the worker it returns gets (m0, m1, block, nr) for each group of nr <= tile_blocks
// consecutive blocks of a chunk [m0, m1), so the group's weights stay in L1/L2 while the chunk's rows go past them.
template <typename MakeWorker>
inline void for_each_tile_group(int64_t M, int64_t NB, int64_t max_rows, int64_t tile_rows, int64_t tile_blocks,
                                const MakeWorker& make_worker) {
  if (M == 0 || NB == 0) return;
  const int64_t even = (M + (M + max_rows - 1) / max_rows - 1) / ((M + max_rows - 1) / max_rows);
  const int64_t rows = (even + tile_rows - 1) / tile_rows * tile_rows;
  const int64_t chunks = (M + rows - 1) / rows;
  const int64_t want = (chunks * NB + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  const int64_t span = std::min(NB, (want + tile_blocks - 1) / tile_blocks * tile_blocks);
  const int64_t spans = (NB + span - 1) / span;
  parallel_units(chunks * spans, 1, [&](WorkCursor& cursor) {
    auto worker = make_worker(rows);
    for (; cursor.valid(); cursor.advance()) {
      const int64_t c = cursor.unit() / spans, b0 = cursor.unit() % spans * span, b1 = std::min(NB, b0 + span);
      const int64_t m0 = c * rows, m1 = std::min(M, m0 + rows);
      for (int64_t b = b0; b < b1; b += tile_blocks) worker(m0, m1, b, static_cast<int>(std::min(tile_blocks, b1 - b)));
    }
  });
}

// f(std::integral_constant<int, n>{}) for n in [First, Last]; any n above Last runs as Last.
template <int First, int Last, typename F>
inline void with_int_constant(int n, const F& f) {
  if constexpr (First == Last) {
    f(std::integral_constant<int, First>{});
  } else {
    if (n == First) return f(std::integral_constant<int, First>{});
    with_int_constant<First + 1, Last>(n, f);
  }
}

// f(MR, NR) with the packed GEMMs' register-tile shape (1 <= mr <= MaxRows rows of x, 1 <= nr <= MaxBlocks blocks) as
// std::integral_constant arguments: the tiles take them as template parameters, since run-time bounds would spill
// their accumulators.
template <int MaxRows, int MaxBlocks, typename F>
inline void dispatch_tile(int mr, int nr, const F& f) {
  with_int_constant<1, MaxRows>(mr, [&](auto m) { with_int_constant<1, MaxBlocks>(nr, [&](auto n) { f(m, n); }); });
}

// for_each_tile_group with no per-thread scratch, every chunk cut into register tiles of up to MaxRows rows of x by
// MaxBlocks blocks: tile(mr, nb, i, block) for the tile whose first row is i and first block `block` (mr, nb as
// dispatch_tile gives them).
template <int MaxRows, int MaxBlocks, typename Tile>
inline void for_each_tile(int64_t M, int64_t NB, int64_t max_rows, const Tile& tile) {
  for_each_tile_group(M, NB, max_rows, MaxRows, MaxBlocks, [&](int64_t) {
    return [&](int64_t m0, int64_t m1, int64_t b, int nr) {
      for (int64_t i = m0; i < m1; i += MaxRows)
        dispatch_tile<MaxRows, MaxBlocks>(static_cast<int>(std::min<int64_t>(MaxRows, m1 - i)), nr,
                                          [&](auto mr, auto nb) { tile(mr, nb, i, b); });
    };
  });
}
