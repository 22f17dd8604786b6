// Paged decode attention on CPU: one query token per request, K/V read in place from the paged
// cache (no gather copy), online softmax block by block (flash-decoding style), fp32 accumulation.
// dot=1 (a bf16 query over a bf16 cache, head_dim % 32 == 0, CPUs with AVX512-BF16): both products by vdpbf16ps
// on the cache as stored (attend_one_dot), P as two bf16 terms (~17 bits, as prefill attention's amx path); else FMAs
// on widened copies. Which path runs is measured (llmserve/kernels/calibrate.py).
//
// Layouts (all contiguous):
//   q            [nd, H, D]            query of each decode request (scaled here, not by the caller)
//   k/v cache    [NB, BS, KVH, D]      one layer's paged cache; token t of block b at [b, t]
//                                      (fp32, bf16 or fp16, independent of q's dtype: a bf16 cache
//                                      under an fp32 model halves the bytes this memory-bound kernel reads;
//                                      or int8, AVX-512 path only, with:)
//   k/v scales   [NB, BS, KVH] fp32    int8 caches only: element = int8 value * the scale of its token and
//                                      head (symmetric, one per row of D; see write_kv_int8 in kv_int8.cpp)
//                [NB, BS, KVH, 2] fp16 int4 caches (uint8 [NB, BS, KVH, D / 2], two values a byte: write_kv_int4):
//                                      element = q * scale + zero, (scale, zero) per token and head; AVX-512
//                                      path only, unpacked in registers per block
//   block_tables [nd, MB] int64        block ids in context order (padding past len is never read)
//   lens         [nd] int64            context length including this step's token
//   out          [nd, H, D]
// Query head h reads KV head h / (H / KVH) (GQA, same as SDPA's enable_gqa).
// Parallel over (request, kv_head) units from a shared queue (work_queue.h) on at::parallel_for's threads, which are
// OpenMP in the CPU wheels: torch's OpenMP runtime (libgomp.so.1 is already loaded), torch.set_num_threads honoured.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "aligned.h"      // AlignedVector: the scratch
#include "float_types.h"  // dispatch_float
#include "work_queue.h"   // parallel_units

#include "avx2_math.h"     // exp256 (and LLMSERVE_AVX2 where the build has AVX2 and FMA)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// One layer's cache as the kernels read it. The scales are set for int8 caches only, the params for int4 only.
template <typename T>
struct CacheView {
  const T* k;
  const T* v;
  const float* k_scale = nullptr;  // [NB, BS, KVH]
  const float* v_scale = nullptr;
  const at::Half* k_param = nullptr;  // [NB, BS, KVH, 2]: (scale, zero)
  const at::Half* v_param = nullptr;
};

// uint8: packed int4 (two values a byte, with a scale and zero point a row); int8: one fp32 scale a row.
template <typename T>
constexpr bool kInt4 = std::is_same_v<T, uint8_t>;
template <typename T>
constexpr bool kInt8 = std::is_same_v<T, int8_t>;
template <typename T>
constexpr bool kQuantized = kInt8<T> || kInt4<T>;
// Elements of T in a row of D values: D / 2 bytes of packed int4, else D.
template <typename T>
constexpr int64_t row_elems(int64_t D) { return kInt4<T> ? D / 2 : D; }

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* __restrict x, float* __restrict y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * static_cast<float>(x[i]);
}

#ifdef LLMSERVE_AVX2
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Eight cache elements widened to fp32. bf16 -> fp32 is a 16-bit shift; fp16 uses F16C.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// s[t] = exp(s[t] - m) for t in [t0, t1); returns their sum.
inline float exp_sub_sum(float* s, int64_t t0, int64_t t1, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum256(acc);
  for (; t < t1; ++t) sum += (s[t] = std::exp(s[t] - m));
  return sum;
}

// Eight horizontal sums at once: lane j of the result is the sum of a[j]'s lanes.
inline __m256 hsum8x8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// Scores of one head against keys [t0, t1) of a block. Eight keys at a time, one accumulator each,
// reduced together by hsum8x8: a horizontal sum per key was most of this loop's time. Needs D % 8 == 0.
template <typename T>
inline void qk_block(const float* q, const T* kb, int64_t tok_stride, int64_t t0, int64_t t1, int64_t D,
                     float* s) {
  int64_t t = t0;
  for (; t + 8 <= t1; t += 8) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(kb + (t + j) * tok_stride + c), a[j]);
    }
    _mm256_storeu_ps(s + t, hsum8x8(a));
  }
  for (; t < t1; ++t) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(kb + t * tok_stride + c), a);
    s[t] = hsum256(a);
  }
}

// acc[0:D] += sum_t p[t] * v[t, 0:D] over [t0, t1), the accumulator chunk held in 8 registers.
template <typename T>
inline void pv_block(const float* p, const T* vb, int64_t tok_stride, int64_t t0, int64_t t1, int64_t D,
                     float* acc) {
  for (int64_t c = 0; c < D; c += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(acc + c + 8 * i);
    for (int64_t t = t0; t < t1; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const T* v = vb + t * tok_stride + c;
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pt, load8(v + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + c + 8 * i, a[i]);
  }
}
#endif

struct Dims {
  int64_t heads, kv_heads, group, head_dim, block_size, max_blocks;
};

// The next slice to read: a block's rows of one KV head, its first n tokens (token t's K and V at
// k / v + t * tok_stride, row_bytes each; an int8 cache's scales at ks / vs + t * kv_heads). k is null when there
// is none.
template <typename T>
struct NextSlice {
  const T* k = nullptr;
  const T* v = nullptr;
  const float* ks = nullptr;
  const float* vs = nullptr;
  int64_t n = 0, tok_stride = 0, row_bytes = 0, kv_heads = 0;
};

template <typename T>
inline NextSlice<T> next_slice(const CacheView<T>& kv, int64_t block, int64_t kvh, int64_t n, const Dims& dm) {
  const int64_t row0 = block * dm.block_size * dm.kv_heads;  // token 0's row of the block
  const int64_t row = row_elems<T>(dm.head_dim);
  const int64_t offset = (row0 + kvh) * row;
  NextSlice<T> s{kv.k + offset, kv.v + offset, nullptr, nullptr, n, dm.kv_heads * row,
                 row * static_cast<int64_t>(sizeof(T)), dm.kv_heads};
  if constexpr (kInt8<T>) {
    s.ks = kv.k_scale + row0 + kvh;
    s.vs = kv.v_scale + row0 + kvh;
  }
  return s;
}

// Online softmax over a context, shared by both paths: running max m and sum l per head of the group,
// and the unnormalised output acc [G, D]; normalised once at the end.
inline void reset_state(float* m, float* l, float* acc, int64_t G, int64_t D) {
  std::fill(m, m + G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + G, 0.f);
  std::fill(acc, acc + G * D, 0.f);
}

inline void normalize(float* acc, const float* l, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // empty context (len 0) -> zeros
    for (int64_t i = 0; i < D; ++i) acc[g * D + i] *= inv;
  }
}

// Keys of a block rounded up to whole 16-key score vectors: the AVX-512 path's scratch row count.
inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

#ifdef LLMSERVE_AVX2  // (AVX-512 CPUs have AVX2, so the extension is built with -mavx2 there)
// ---------------------------------------------------------------------------------------------
// AVX-512 path (CPUs with AVX-512 F/BW/DQ, checked at run time; compiled through target attributes,
// the extension itself is built for AVX2). D % 16 == 0. Per block of the context:
//   1. the block's keys [t0, t1) are widened once into an fp32 scratch [n16, D], zero rows padding n
//      up to a multiple of 16, so every query head of the group reads them from L1 without converting;
//   2. scores of 16 keys at a time per head: 16 accumulators over D, reduced together by a transpose-
//      add tree (hsum16x16), so no per-key horizontal sum;
//   3. values are widened once per token and each widened row feeds all heads of a pass (up to 4
//      heads x 64 dims of accumulators in registers).
// Why: the AVX2 path widened every cache element once per query head and reduced each score on its
// own; it was compute-bound at ~40 GFLOP/s (1.5 ms per layer at batch 64, contexts 300-520, GQA 3).
#include "avx512_math.h"  // LLMSERVE_AVX512, load16, tail_mask16, exp512

// r[j] = sum of a[j]'s 16 lanes, j = 0..15 (a is clobbered). Each level adds pairs of vectors after
// interleaving their halves, so after four levels lane j holds all of a[j].
LLMSERVE_AVX512 inline __m512 hsum16x16(__m512* a) {
  // level 1: 16 -> 8 vectors, each 256-bit half holds one input's partial sums
  for (int i = 0; i < 8; ++i) {
    const __m512 x = a[i], y = a[i + 8];
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  // now a[i] = [x.lo + x.hi (256 bits) | y.lo + y.hi]: inputs i and i+8
  // level 2: 8 -> 4, 128-bit lanes
  for (int i = 0; i < 4; ++i) {
    const __m512 x = a[i], y = a[i + 4];
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  // a[i]'s 128-bit lanes: inputs i, i+8, i+4, i+12
  // level 3: 4 -> 2, 64-bit pairs within each 128-bit lane
  for (int i = 0; i < 2; ++i) {
    const __m512 x = a[i], y = a[i + 2];
    a[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
  }
  // level 4: 2 -> 1, single floats
  const __m512 x = a[0], y = a[1];
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}
// Lane p of hsum16x16 holds the sum of input kHsumOrder[p] (the levels interleave 256-, 128-, 64- and
// 32-bit pieces). The order is its own inverse, so giving input j the key kHsumOrder[j] puts key p's
// score in lane p.
constexpr int kHsumOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// Scores of one head against the n16 keys of the scratch (rows of D floats): s[0:n16].
LLMSERVE_AVX512 inline void qk16(const float* q, const float* k, int64_t n16, int64_t D, float* s) {
  for (int64_t t = 0; t < n16; t += 16) {
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 qv = _mm512_loadu_ps(q + c);
      for (int j = 0; j < 16; ++j)
        a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (t + kHsumOrder[j]) * D + c), a[j]);
    }
    _mm512_storeu_ps(s + t, hsum16x16(a));
  }
}

// Ask for token t's key (prefetch_key) or value (prefetch_value) of the next slice (into L2) while this block is
// computed: blocks lie anywhere in the pool, so the hardware prefetchers cannot guess the next one, and the first rows
// of every 4 KiB page would miss. Requests a burst would fill the line-fill buffers and stall the loads the current
// block needs, so they go out spread over the block's work: the next keys one token per key during the scores, 16
// before each 16 keys' products, the next values one per token during P @ V. (2-core Xeon, 30 layers of 64 requests x
// 285 tokens, bf16: 29.8-30.3 ms per step against 35.2-36.5 without prefetching and 35.4-37.1 asking for the whole next
// block at once.) They went out, one key and one value per key, during the copy of the block's keys, a short loop
// that is itself a burst: there, on the 2-core Zen 5 (2026-12-02), over a third of attend_one_dot's samples waited on
// the copy's loads, and decode attention in the 64-request workload took 2.34-2.35 s against 1.74-1.75 now,
// alternated (BENCHMARKS.md).
// Two functions, not one helper taking the row and scale pointers: with that helper (81ae22f) GCC 12 -O3 emitted no
// prefetch at all in paged_decode.o, and on the 2-core Zen 4 (2026-12-03) 30 layers of 64 requests x 285 tokens took
// 36-53 ms a step against 20-29 with these. Even marked noinline the helper left no copy and no call: GCC models a
// prefetch as having no side effect, so a function that only prefetches looks pure and its calls are deleted unless
// it is inlined first, as these one-level functions are. They are forced inline: an int8 cache's forms, one prefetch
// longer (the scales), were left out of line by GCC 12 and so deleted, and until 2026-12-07 that path read its rows
// without a prefetch (30 layers of 64 requests x 285 tokens: 28.7 ms a step against bf16's 24.4 on the model-167
// Xeon, for half the bytes). tests/kernels/test_native_object.py checks each cache type's kernel.
template <typename T>
__attribute__((always_inline)) inline void prefetch_key(const NextSlice<T>& next, int64_t t) {
  if (next.k == nullptr || t >= next.n) return;
  const char* k = reinterpret_cast<const char*>(next.k + t * next.tok_stride);
  for (int64_t c = 0; c < next.row_bytes; c += 64) _mm_prefetch(k + c, _MM_HINT_T1);
  if constexpr (kInt8<T>) _mm_prefetch(reinterpret_cast<const char*>(next.ks + t * next.kv_heads), _MM_HINT_T1);
}
template <typename T>
__attribute__((always_inline)) inline void prefetch_value(const NextSlice<T>& next, int64_t t) {
  if (next.v == nullptr || t >= next.n) return;
  const char* v = reinterpret_cast<const char*>(next.v + t * next.tok_stride);
  for (int64_t c = 0; c < next.row_bytes; c += 64) _mm_prefetch(v + c, _MM_HINT_T1);
  if constexpr (kInt8<T>) _mm_prefetch(reinterpret_cast<const char*>(next.vs + t * next.kv_heads), _MM_HINT_T1);
}

// qk16 with vdpbf16ps (the dot path): scores of one head against 16 keys [t, t + 16) of the block's bf16 scratch
// (rows of D, zero past the block's keys, D % 32 == 0), s[t : t + 16], scaled here (the query is not: a scaled bf16
// query would be rounded). The query's dimensions and each key's are pairs, so each instruction does 32 products.
LLMSERVE_AVX512BF16 inline void qk16_dot(const uint16_t* q, const uint16_t* k, int64_t t, int64_t D, float scale,
                                         float* s) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
    for (int j = 0; j < 16; ++j)
      a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_loadu_si512(k + (t + kHsumOrder[j]) * D + c));
  }
  _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_set1_ps(scale), hsum16x16(a)));
}

// acc[g] += sum_t p[g, t] v[t] for NG heads of the dot path, NC chunks of 32 dims a pass, by vdpbf16ps over pairs
// of tokens: rows t and t + 1 of V interleaved (unpacklo / unpackhi_epi16) against the bf16 pair (p[g, t],
// p[g, t + 1]) broadcast, so each instruction does 32 products and V is read as stored. P comes as two bf16 terms,
// p = hi + lo (hi at p, lo `term` elements on), ~17 of its 24 bits: one bf16 P moves outputs by 2^-9 relative, and
// prefill attention keeps P in fp32 (so a prompt's last position gives the same token whether prefill or, after a
// prefix-cache hit, this kernel computes it; prefill_attention.cpp). The unpacks work within 128-bit lanes, so a
// chunk's 32 dims sit in its two accumulators permuted (dot_dim); the caller puts them back in order once, at the
// end. A row past n is never read: an odd last token pairs with zeros (and p there is 0).
template <int NG, int NC>
LLMSERVE_AVX512BF16 inline void pv_dot_pass(const uint16_t* p, int64_t p_stride, int64_t term, const uint16_t* vb,
                                            int64_t tok_stride, int64_t n, int64_t D, float* acc,
                                            const NextSlice<c10::BFloat16>* pf) {
  for (int64_t c = 0; c < D; c += 32 * NC) {
    __m512 a[NG][2 * NC];
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 2 * NC; ++j) a[g][j] = _mm512_loadu_ps(acc + g * D + c + 16 * j);
    for (int64_t t = 0; t < n; t += 2) {  // tokens t and t + 1 (a loop, not a lambda: the target's intrinsics)
      if (pf != nullptr && c == 0) {
        prefetch_value(*pf, t);
        prefetch_value(*pf, t + 1);
      }
      const bool odd = t + 1 == n;
      __m512i lo[NC], hi[NC];
      for (int i = 0; i < NC; ++i) {
        const __m512i r0 = _mm512_loadu_si512(vb + t * tok_stride + c + 32 * i);
        const __m512i r1 = odd ? _mm512_setzero_si512() : _mm512_loadu_si512(vb + (t + 1) * tok_stride + c + 32 * i);
        lo[i] = _mm512_unpacklo_epi16(r0, r1);
        hi[i] = _mm512_unpackhi_epi16(r0, r1);
      }
      for (int g = 0; g < NG; ++g)
        for (int64_t part = 0; part < 2; ++part) {
          int32_t pt;
          std::memcpy(&pt, p + part * term + g * p_stride + t, sizeof pt);
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(pt);
          for (int i = 0; i < NC; ++i) {
            a[g][2 * i] = _mm512_dpbf16_ps(a[g][2 * i], pp, (__m512bh)lo[i]);
            a[g][2 * i + 1] = _mm512_dpbf16_ps(a[g][2 * i + 1], pp, (__m512bh)hi[i]);
          }
        }
    }
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 2 * NC; ++j) _mm512_storeu_ps(acc + g * D + c + 16 * j, a[g][j]);
  }
}

template <int NC>
LLMSERVE_AVX512BF16 inline void pv_dot_heads(const uint16_t* p, int64_t p_stride, int64_t term, const uint16_t* vb,
                                             int64_t tok_stride, int64_t n, int64_t D, int64_t G, float* acc,
                                             const NextSlice<c10::BFloat16>* pf = nullptr) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const uint16_t* pg = p + g0 * p_stride;
    float* a = acc + g0 * D;
    const NextSlice<c10::BFloat16>* f = g0 == 0 ? pf : nullptr;  // the first pass asks for the next values
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: pv_dot_pass<1, NC>(pg, p_stride, term, vb, tok_stride, n, D, a, f); break;
      case 2: pv_dot_pass<2, NC>(pg, p_stride, term, vb, tok_stride, n, D, a, f); break;
      case 3: pv_dot_pass<3, NC>(pg, p_stride, term, vb, tok_stride, n, D, a, f); break;
      default: pv_dot_pass<4, NC>(pg, p_stride, term, vb, tok_stride, n, D, a, f); break;
    }
  }
}

// The dimension that lane k of accumulator j of pv_dot_pass holds: chunk j / 2 of 32 dims, unpacklo (j even) or
// unpackhi, 4 dims of each 128-bit lane (8 of each row).
inline int64_t dot_dim(int64_t j, int64_t k) { return 32 * (j / 2) + 8 * (k / 4) + 4 * (j % 2) + k % 4; }

// acc[g, 0:D] += sum_t p[g, t] v[t, 0:D] for NG heads, t in [0, n), NC * 16 dims per pass. Both are
// template parameters so the NG x NC accumulators stay in registers (run-time bounds spilled them).
template <int NG, int NC, typename T, typename N>
LLMSERVE_AVX512 inline void pv_pass(const float* p, int64_t p_stride, const T* vb, int64_t tok_stride,
                                    int64_t n, int64_t D, float* acc, const NextSlice<N>* pf) {
  for (int64_t c = 0; c < D; c += 16 * NC) {
    __m512 a[NG][NC];
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < NC; ++i) a[g][i] = _mm512_loadu_ps(acc + g * D + c + 16 * i);
    for (int64_t t = 0; t < n; ++t) {
      if (pf != nullptr && c == 0) prefetch_value(*pf, t);
      const T* v = vb + t * tok_stride + c;
      __m512 vv[NC];
      for (int i = 0; i < NC; ++i) vv[i] = load16(v + 16 * i);
      for (int g = 0; g < NG; ++g) {
        const __m512 pt = _mm512_set1_ps(p[g * p_stride + t]);
        for (int i = 0; i < NC; ++i) a[g][i] = _mm512_fmadd_ps(pt, vv[i], a[g][i]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < NC; ++i) _mm512_storeu_ps(acc + g * D + c + 16 * i, a[g][i]);
  }
}

// pf: where the next slice's values are asked for during the first pass (null: nowhere)
template <int NC, typename T, typename N = T>
LLMSERVE_AVX512 inline void pv_heads(const float* p, int64_t p_stride, const T* vb, int64_t tok_stride, int64_t n,
                                     int64_t D, int64_t G, float* acc, const NextSlice<N>* pf = nullptr) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* pg = p + g0 * p_stride;
    float* a = acc + g0 * D;
    const NextSlice<N>* f = g0 == 0 ? pf : nullptr;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: pv_pass<1, NC>(pg, p_stride, vb, tok_stride, n, D, a, f); break;
      case 2: pv_pass<2, NC>(pg, p_stride, vb, tok_stride, n, D, a, f); break;
      case 3: pv_pass<3, NC>(pg, p_stride, vb, tok_stride, n, D, a, f); break;
      default: pv_pass<4, NC>(pg, p_stride, vb, tok_stride, n, D, a, f); break;
    }
  }
}

// Block b's keys [t0, t0 + n) of a context's keys [start, len), blocks of BS (n16: n rounded up to whole 16-key score
// vectors): the block loop of both AVX-512 paths.
struct BlockKeys {
  int64_t t0, n, n16;
};
inline BlockKeys block_keys(int64_t b, int64_t start, int64_t len, int64_t BS) {
  const int64_t t0 = std::max(start - b * BS, int64_t(0)), n = std::min(len - b * BS, BS) - t0;
  return {t0, n, round16(n)};
}

// Online softmax over one block's n scores of each of the G heads (scores [G, bs16], rows padded to round16(n)): the
// scores become p = exp(s - m) (0 past n), the running max m and sum l [G] move on, and acc [G, D] is rescaled by
// exp(m_old - m_new) (element by element, so in whatever order acc holds its dims).
LLMSERVE_AVX512 inline void softmax_block(float* scores, int64_t bs16, int64_t n, int64_t G, int64_t D, float* m,
                                          float* l, float* acc) {
  const int64_t n16 = round16(n);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * bs16;
    // running max over the n real scores
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n16; t += 16) {
      const __mmask16 k = tail_mask16(n - t);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, k, s + t));
    }
    const float m_new = std::max(m[g], _mm512_reduce_max_ps(mx));
    const float alpha = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first block
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n16; t += 16) {
      const __mmask16 k = tail_mask16(n - t);
      const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv)));
      _mm512_storeu_ps(s + t, e);  // padded keys get probability 0
      sum = _mm512_add_ps(sum, e);
    }
    l[g] = l[g] * alpha + _mm512_reduce_add_ps(sum);
    m[g] = m_new;
    if (alpha != 1.f) {
      const __m512 av = _mm512_set1_ps(alpha);
      for (int64_t c = 0; c < D; c += 16)
        _mm512_storeu_ps(acc + g * D + c, _mm512_mul_ps(av, _mm512_loadu_ps(acc + g * D + c)));
    }
  }
}

// The dot path of attend_one_512 for a bf16 query over a bf16 cache (D % 32 == 0): both products by vdpbf16ps on the
// cache as stored. Per block: its keys copied in order into a contiguous bf16 scratch kb16 [round16(BS), D] (zero
// rows past n; streamed in order: loading 16 scattered cold rows straight into the products ran 1.3x slower), scores
// 16 keys at a time (qk16_dot), the softmax in fp32, the probabilities split into two bf16 terms (pb [2, G, bs16]: P
// rounded, then the exact rest rounded), then P @ V by pairs of tokens (pv_dot_pass) into fp32 accumulators. q: the
// group's unscaled bf16 query [G, D]; the other arguments as attend_one_512's.
LLMSERVE_AVX512BF16 void attend_one_dot(const uint16_t* q, const CacheView<c10::BFloat16>& kv, const int64_t* table,
                                        int64_t start, int64_t len, int64_t kvh, const Dims& dm, float scale,
                                        float* acc, uint16_t* kb16, float* scores, uint16_t* pb, float* m, float* l,
                                        const NextSlice<c10::BFloat16>& after) {
  const int64_t G = dm.group, D = dm.head_dim, BS = dm.block_size, KVH = dm.kv_heads;
  const int64_t bs16 = round16(BS);
  const int64_t tok_stride = KVH * D;
  const int64_t blk_stride = BS * tok_stride;
  reset_state(m, l, acc, G, D);
  for (int64_t b = start / BS; b * BS < len; ++b) {
    const auto [t0, n, n16] = block_keys(b, start, len, BS);
    const auto* kb = reinterpret_cast<const uint16_t*>(kv.k + table[b] * blk_stride + kvh * D + t0 * tok_stride);
    const auto* vb = reinterpret_cast<const uint16_t*>(kv.v + table[b] * blk_stride + kvh * D + t0 * tok_stride);
    const NextSlice<c10::BFloat16> next =
        (b + 1) * BS < len ? next_slice(kv, table[b + 1], kvh, std::min(len - (b + 1) * BS, BS), dm) : after;
    // the next slice's keys are asked for during these scores, its values during P @ V (prefetch_key)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < D; c += 32)
        _mm512_storeu_si512(kb16 + t * D + c, _mm512_loadu_si512(kb + t * tok_stride + c));
    for (int64_t t = n; t < n16; ++t)
      for (int64_t c = 0; c < D; c += 32) _mm512_storeu_si512(kb16 + t * D + c, _mm512_setzero_si512());
    for (int64_t t = 0; t < n16; t += 16) {
      for (int64_t i = t; i < t + 16; ++i) prefetch_key(next, i);
      for (int64_t g = 0; g < G; ++g) qk16_dot(q + g * D, kb16, t, D, scale, scores + g * bs16);
    }
    for (int64_t i = n16; i < next.n; ++i) prefetch_key(next, i);  // a short block: the rest now
    softmax_block(scores, bs16, n, G, D, m, l, acc);
    const int64_t term = G * bs16;  // pb: P's high bf16 terms [G, bs16], then its low ones
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < n16; t += 16) {
        const __m512 pv = _mm512_loadu_ps(scores + g * bs16 + t);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(pv);
        const __m512 rest = _mm512_sub_ps(pv, widen_bf16(h));  // exact
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + g * bs16 + t), h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + term + g * bs16 + t), (__m256i)_mm512_cvtneps_pbh(rest));
      }
    if (D % 64 == 0)
      pv_dot_heads<2>(pb, bs16, term, vb, tok_stride, n, D, G, acc, &next);
    else
      pv_dot_heads<1>(pb, bs16, term, vb, tok_stride, n, D, G, acc, &next);
    for (int64_t i = (n + 1) / 2 * 2; i < next.n; ++i) prefetch_value(next, i);
  }
  for (int64_t g = 0; g < G; ++g)  // each chunk's 32 dims back in order
    for (int64_t c = 0; c < D; c += 32) {
      float row[32];
      for (int64_t i = 0; i < 32; ++i) row[dot_dim(i / 16, i % 16)] = acc[g * D + c + i];
      std::copy_n(row, 32, acc + g * D + c);
    }
  normalize(acc, l, G, D);
}

template <typename T>
LLMSERVE_AVX512 void attend_one_512(const float* qs, const CacheView<T>& kv, const int64_t* table,
                                   int64_t start, int64_t len, int64_t kvh, const Dims& dm, float* acc,
                                   float* kf, float* scores, float* m, float* l, const NextSlice<T>& after) {
  // kf: [round16(BS), D] widened keys of the current block; scores: [G, round16(BS)]; m, l: [G].
  // after: what the caller reads next (the next unit's first block), prefetched during the last block.
  const int64_t G = dm.group, D = dm.head_dim, BS = dm.block_size, KVH = dm.kv_heads;
  const int64_t bs16 = round16(BS);
  const int64_t R = row_elems<T>(D);  // elements of T per row (int4: D / 2 bytes)
  const int64_t tok_stride = KVH * R;
  const int64_t blk_stride = BS * tok_stride;
  reset_state(m, l, acc, G, D);
  for (int64_t b = start / BS; b * BS < len; ++b) {
    const auto [t0, n, n16] = block_keys(b, start, len, BS);
    const T* kb = kv.k + table[b] * blk_stride + kvh * R + t0 * tok_stride;
    const T* vb = kv.v + table[b] * blk_stride + kvh * R + t0 * tok_stride;
    const int64_t scale0 = (table[b] * BS + t0) * KVH + kvh;  // int8: token t's scale at scale0 + t * KVH
    const NextSlice<T> next =
        (b + 1) * BS < len ? next_slice(kv, table[b + 1], kvh, std::min(len - (b + 1) * BS, BS), dm) : after;
    for (int64_t t = 0; t < n; ++t) {
      if constexpr (kInt4<T>) {  // unpacked and dequantized once here, then read by every head of the group
        widen_int4_row(kb + t * tok_stride, kv.k_param + 2 * (scale0 + t * KVH), D, kf + t * D);
      } else if constexpr (kQuantized<T>) {  // dequantized once here, then read by every head of the group
        const __m512 sc = _mm512_set1_ps(kv.k_scale[scale0 + t * KVH]);
        for (int64_t c = 0; c < D; c += 16)
          _mm512_storeu_ps(kf + t * D + c, _mm512_mul_ps(sc, load16(kb + t * tok_stride + c)));
      } else {
        for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(kf + t * D + c, load16(kb + t * tok_stride + c));
      }
    }
    for (int64_t t = n; t < n16; ++t)
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(kf + t * D + c, _mm512_setzero_ps());
    // the next slice's keys are asked for during these scores, its values during P @ V (prefetch_key)
    for (int64_t t = 0; t < n16; t += 16) {
      for (int64_t i = t; i < t + 16; ++i) prefetch_key(next, i);
      for (int64_t g = 0; g < G; ++g) qk16(qs + g * D, kf + t * D, 16, D, scores + g * bs16 + t);
    }
    for (int64_t i = n16; i < next.n; ++i) prefetch_key(next, i);  // a short block: the rest now
    softmax_block(scores, bs16, n, G, D, m, l, acc);
    if constexpr (kInt8<T>) {  // p * (v8 * scale) = (p * scale) * v8: fold V's scale into p
      for (int64_t t = 0; t < n; ++t) {
        const float sc = kv.v_scale[scale0 + t * KVH];
        for (int64_t g = 0; g < G; ++g) scores[g * bs16 + t] *= sc;
      }
    }
    if constexpr (kInt4<T>) {
      // the keys' scratch is free again: the block's values dequantized into it, then the fp32 rows go through
      // pv_heads as a float cache's would (the zero point keeps the scale from folding into p as int8's does)
      for (int64_t t = 0; t < n; ++t) {
        prefetch_value(next, t);
        widen_int4_row(vb + t * tok_stride, kv.v_param + 2 * (scale0 + t * KVH), D, kf + t * D);
      }
      if (D % 64 == 0)
        pv_heads<4>(scores, bs16, static_cast<const float*>(kf), D, n, D, G, acc);
      else
        pv_heads<1>(scores, bs16, static_cast<const float*>(kf), D, n, D, G, acc);
    } else if (D % 64 == 0) {
      pv_heads<4>(scores, bs16, vb, tok_stride, n, D, G, acc, &next);
    } else {
      pv_heads<1>(scores, bs16, vb, tok_stride, n, D, G, acc, &next);
    }
    for (int64_t i = n; i < next.n; ++i) prefetch_value(next, i);
  }
  normalize(acc, l, G, D);
}

bool avx512_decode_supported() {
  return cpu_has_avx512() && !env_is_zero("LLMSERVE_DECODE_AVX512");  // "0": the AVX2 path (tests, A/B)
}
bool decode_dot_supported() { return cpu_has_avx512_bf16(); }
#else
bool avx512_decode_supported() { return false; }
bool decode_dot_supported() { return false; }
template <typename T>
void attend_one_512(const float*, const CacheView<T>&, const int64_t*, int64_t, int64_t, int64_t, const Dims&,
                    float*, float*, float*, float*, float*, const NextSlice<T>&) {}
void attend_one_dot(const uint16_t*, const CacheView<c10::BFloat16>&, const int64_t*, int64_t, int64_t, int64_t,
                    const Dims&, float, float*, uint16_t*, float*, uint16_t*, float*, float*,
                    const NextSlice<c10::BFloat16>&) {}
#endif

// Attention of the `group` query heads sharing KV head `kvh` of one request over keys
// [start, len). qs: [group, D] pre-scaled query; acc: [group, D] output (normalised on return).
template <typename T>
void attend_one(const float* qs, const CacheView<T>& kv, const int64_t* table,
                int64_t start, int64_t len, int64_t kvh, const Dims& dm, float* acc, float* scores,
                float* m, float* l) {
  // scores: [G, BS] logits, then probabilities, of the current block; m, l: [G] running max / sum.
  const int64_t G = dm.group, D = dm.head_dim, BS = dm.block_size;
  const int64_t tok_stride = dm.kv_heads * D;  // elements between consecutive tokens of a block
  const int64_t blk_stride = BS * tok_stride;
  reset_state(m, l, acc, G, D);
  for (int64_t b = start / BS; b * BS < len; ++b) {
    const int64_t t0 = std::max(start - b * BS, int64_t(0));
    const int64_t t1 = std::min(len - b * BS, BS);
    const T* kb = kv.k + table[b] * blk_stride + kvh * D;
    const T* vb = kv.v + table[b] * blk_stride + kvh * D;
#ifdef LLMSERVE_AVX2
    if (D % 8 == 0) {  // vector kernels read the cache in place, widening bf16/fp16 in registers
      for (int64_t g = 0; g < G; ++g) qk_block(qs + g * D, kb, tok_stride, t0, t1, D, scores + g * BS);
    } else
#endif
    {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t g = 0; g < G; ++g) scores[g * BS + t] = dot(qs + g * D, kb + t * tok_stride, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores + g * BS;
      float m_new = m[g];
      for (int64_t t = t0; t < t1; ++t) m_new = std::max(m_new, s[t]);
      const float alpha = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first block
#ifdef LLMSERVE_AVX2
      const float sum = exp_sub_sum(s, t0, t1, m_new);
#else
      float sum = 0.f;
      for (int64_t t = t0; t < t1; ++t) sum += (s[t] = std::exp(s[t] - m_new));
#endif
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      if (alpha != 1.f)
        for (int64_t i = 0; i < D; ++i) acc[g * D + i] *= alpha;
    }
#ifdef LLMSERVE_AVX2
    if (D % 64 == 0) {
      for (int64_t g = 0; g < G; ++g) pv_block(scores + g * BS, vb, tok_stride, t0, t1, D, acc + g * D);
      continue;
    }
#endif
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) axpy(scores[g * BS + t], vb + t * tok_stride, acc + g * D, D);
  }
  normalize(acc, l, G, D);
}

// Splitting a context across threads (flash-decoding) pays only when each part keeps this many keys.
constexpr int64_t kMinSplitTokens = 256;

// How many parts each (request, kv_head) context is split into. A step with fewer (request, kv_head) items
// than two per thread left threads idle or unevenly loaded (one request with 3 KV heads on 2 threads: 2 + 1),
// so long contexts are split until every thread has the same number of parts, at least two.
int64_t choose_splits(int64_t items, int64_t max_context) {
  const int64_t threads = at::get_num_threads();
  if (items >= 2 * threads) return 1;
  const int64_t most = max_context / kMinSplitTokens;
  const int64_t least = (2 * threads + items - 1) / items;
  for (int64_t s = least; s <= std::min(most, 2 * least); ++s)
    if (s * items % threads == 0) return s;
  return std::max<int64_t>(1, std::min(most, least));
}

// Part s of S of the keys [start, len): whole blocks (so the parts tile the block loop), possibly empty.
inline void split_range(int64_t start, int64_t len, int64_t BS, int64_t s, int64_t S, int64_t* lo, int64_t* hi) {
  const int64_t b0 = start / BS, nb = (len + BS - 1) / BS - b0;
  *lo = std::max(start, (b0 + nb * s / S) * BS);
  *hi = std::min(len, (b0 + nb * (s + 1) / S) * BS);
}

template <typename TQ, typename T>
void paged_decode_impl(const TQ* q, const CacheView<T>& kv, const int64_t* tables,
                       const int64_t* lens, double scale, int64_t window, int64_t nd, const Dims& dm,
                       int64_t splits, bool dot, TQ* out) {
  const int64_t G = dm.group, D = dm.head_dim, items = nd * dm.kv_heads;
  const bool wide = D % 16 == 0 && avx512_decode_supported();
  // the dot path: a bf16 query over a bf16 cache on the AVX-512 path (the caller checked the CPU)
  constexpr bool kBf16 = std::is_same_v<TQ, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>;
  dot = dot && kBf16 && wide && D % 32 == 0;  // (other head dims: FMAs)
  TORCH_CHECK(wide || !kQuantized<T>, kInt4<T> ? "an int4" : "an int8",
              " KV cache needs the AVX-512 decode path (head_dim % 16 == 0)");
  auto key_range = [&](int64_t r) {  // [start, len) of request r
    const int64_t len = lens[r];
    return std::make_pair(window > 0 ? std::max(len - window, int64_t(0)) : int64_t(0), len);
  };
  if (splits <= 0) {
    int64_t longest = 0;
    for (int64_t r = 0; r < nd; ++r) longest = std::max(longest, key_range(r).second - key_range(r).first);
    splits = choose_splits(items, longest);
  }
  const int64_t S = splits;
  // S > 1: each part's normalised output and its softmax max / sum, merged below: [items, S, G, D] and [items, S, G]
  std::vector<float> part_acc(S > 1 ? items * S * G * D : 0), part_m(S > 1 ? items * S * G : 0),
      part_l(S > 1 ? items * S * G : 0);
  const int64_t total = items * S;
  auto worker = [&](WorkCursor& cursor) {
    // Per-thread scratch, reused across this thread's (request, kv_head, part) units.
    // The AVX-512 path scores whole 16-key vectors and widens a block's keys into kf first.
    const int64_t score_cols = wide ? round16(dm.block_size) : dm.block_size;
    // kf: the dot path's bf16 keys, else widened ones; pb: the dot path's P as two bf16 terms [2, G, score_cols]
    std::vector<float> qs(G * D), m(G), l(G);
    AlignedVector<float> acc_buf(G * D), scores_buf(G * score_cols), kf_buf(wide ? score_cols * D : 0);
    AlignedVector<uint16_t> pb_buf(dot ? 2 * G * score_cols : 0);
    float* const acc = acc_buf.data();
    float* const scores = scores_buf.data();
    float* const kf = kf_buf.data();
    uint16_t* const pb = pb_buf.data();
    auto unit_range = [&](int64_t u) {  // [start, len) of unit u's keys
      auto range = key_range(u / S / dm.kv_heads);
      if (S > 1) split_range(range.first, range.second, dm.block_size, u % S, S, &range.first, &range.second);
      return range;
    };
    auto process = [&](int64_t u, int64_t nu) {
      const int64_t w = u / S, r = w / dm.kv_heads, kvh = w % dm.kv_heads;
      const auto [start, len] = unit_range(u);
      NextSlice<T> after;  // the first block of this thread's next unit, prefetched during this unit's last
      if (nu >= 0) {
        const auto [next_start, next_len] = unit_range(nu);
        const int64_t nr = nu / S / dm.kv_heads, b = next_start / dm.block_size;
        if (wide && next_start < next_len)
          after = next_slice(kv, tables[nr * dm.max_blocks + b], nu / S % dm.kv_heads,
                             std::min(next_len - b * dm.block_size, dm.block_size), dm);
      }
      const int64_t head0 = kvh * G;  // first query head of this KV head's group
      const TQ* qr = q + (r * dm.heads + head0) * D;
      if (!dot)  // (the dot path reads the bf16 query as it is and scales the scores)
        for (int64_t i = 0; i < G * D; ++i) qs[i] = static_cast<float>(qr[i]) * static_cast<float>(scale);
      if (start >= len)  // an empty part (or context): no keys, weight 0 in the merge
        reset_state(m.data(), l.data(), acc, G, D);
      else if (dot) {
        if constexpr (kBf16)
          attend_one_dot(reinterpret_cast<const uint16_t*>(qr), kv, tables + r * dm.max_blocks, start, len, kvh, dm,
                         static_cast<float>(scale), acc, reinterpret_cast<uint16_t*>(kf), scores, pb, m.data(),
                         l.data(), after);
      } else if (wide)
        attend_one_512(qs.data(), kv, tables + r * dm.max_blocks, start, len, kvh, dm, acc, kf, scores, m.data(),
                       l.data(), after);
      else if constexpr (!kQuantized<T>)
        attend_one(qs.data(), kv, tables + r * dm.max_blocks, start, len, kvh, dm, acc, scores,
                   m.data(), l.data());
      if (S == 1) {
        TQ* o = out + (r * dm.heads + head0) * D;
        for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<TQ>(acc[i]);
      } else {
        std::copy_n(acc, G * D, part_acc.begin() + u * G * D);
        std::copy(m.begin(), m.end(), part_m.begin() + u * G);
        std::copy(l.begin(), l.end(), part_l.begin() + u * G);
      }
    };
    for (; cursor.valid(); cursor.advance()) process(cursor.unit(), cursor.upcoming());
  };
  // Runs of the work queue: with many requests, a request's kv heads together (their rows share the blocks' pages:
  // 30 layers of 64 x 288 tokens, 45.7 ms against 50.7 one unit at a time); with a few, and the parts of a split
  // context, one unit at a time, so that both threads have work.
  parallel_units(total, S == 1 && nd >= 4 * at::get_num_threads() ? dm.kv_heads : 1, worker);
  if (S == 1) return;
  // out = sum_s w_s acc_s / sum_s w_s, w_s = l_s exp(m_s - max_s m_s): the softmax over all keys again
  std::vector<float> merged(D);
  for (int64_t w = 0; w < items; ++w) {
    const int64_t r = w / dm.kv_heads, kvh = w % dm.kv_heads;
    for (int64_t g = 0; g < G; ++g) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t s = 0; s < S; ++s) top = std::max(top, part_m[(w * S + s) * G + g]);
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t s = 0; s < S; ++s) {
        const float l = part_l[(w * S + s) * G + g];
        if (!(l > 0.f)) continue;
        const float weight = l * std::exp(part_m[(w * S + s) * G + g] - top);
        const float* a = part_acc.data() + ((w * S + s) * G + g) * D;
        for (int64_t i = 0; i < D; ++i) merged[i] += weight * a[i];
        total += weight;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      TQ* o = out + (r * dm.heads + kvh * G + g) * D;
      for (int64_t i = 0; i < D; ++i) o[i] = static_cast<TQ>(merged[i] * inv);
    }
  }
}

}  // namespace

// window <= 0 means no sliding window; otherwise keys j with j >= len - window are visible.
// k_scales / v_scales: given exactly when the cache is int8.
// splits: parts each context is split into across threads (<= 0: choose_splits; tests and A/B set it).
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor block_tables, at::Tensor lens, double scale, int64_t window,
                        c10::optional<at::Tensor> k_scales, c10::optional<at::Tensor> v_scales,
                        int64_t splits, int64_t dot) {
  TORCH_CHECK(dot <= 0 || decode_dot_supported(), "paged_decode: dot=1 needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad ranks/shapes");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode is CPU only");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k and v cache dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 indices");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  lens = lens.contiguous();
  const int64_t nd = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  const bool int4 = k_cache.scalar_type() == at::kByte;  // packed: head_dim / 2 bytes a row
  TORCH_CHECK(k_cache.size(3) == (int4 ? D / 2 : D) && (!int4 || D % 2 == 0) && H % KVH == 0,
              "head_dim mismatch or heads not a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == nd && lens.size(0) == nd, "one table row and length per request");
  const Dims dm{H, KVH, H / KVH, D, k_cache.size(1), block_tables.size(1)};
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < nd; ++r)
    TORCH_CHECK(lp[r] >= 0 && lp[r] <= dm.block_size * dm.max_blocks, "context length outside the block table");
  const bool quantized = k_cache.scalar_type() == at::kChar || int4;
  TORCH_CHECK(quantized == (k_scales.has_value() && v_scales.has_value()),
              "k_scales and v_scales are given exactly when the cache is int8 or int4");
  if (quantized) {
    for (const auto& sc : {*k_scales, *v_scales})
      TORCH_CHECK(sc.scalar_type() == (int4 ? at::kHalf : at::kFloat) && sc.is_contiguous() &&
                      sc.dim() == (int4 ? 4 : 3) && sc.size(0) == k_cache.size(0) && sc.size(1) == k_cache.size(1) &&
                      sc.size(2) == KVH && (!int4 || sc.size(3) == 2),
                  int4 ? "scales must be contiguous float16 [num_blocks, block_size, kv_heads, 2]"
                       : "scales must be contiguous float32 [num_blocks, block_size, kv_heads]");
  }
  auto out = at::empty_like(q);
  // The query (and output) dtype and the cache dtype are dispatched separately: fp32, bf16, fp16 (and int8
  // for the cache).
  dispatch_float(q.scalar_type(), "paged_decode (q)", [&](auto q_tag) {
    using q_t = decltype(q_tag);
    auto run = [&](auto kv_tag) {
      using kv_t = decltype(kv_tag);
      CacheView<kv_t> kv{k_cache.data_ptr<kv_t>(), v_cache.data_ptr<kv_t>()};
      if (int4) {
        kv.k_param = k_scales->data_ptr<at::Half>();
        kv.v_param = v_scales->data_ptr<at::Half>();
      } else if (quantized) {
        kv.k_scale = k_scales->data_ptr<float>();
        kv.v_scale = v_scales->data_ptr<float>();
      }
      paged_decode_impl<q_t, kv_t>(q.data_ptr<q_t>(), kv, block_tables.data_ptr<int64_t>(),
                                   lens.data_ptr<int64_t>(), scale, window, nd, dm, splits, dot > 0,
                                   out.data_ptr<q_t>());
    };
    if (int4)
      run(uint8_t{});
    else if (quantized)
      run(int8_t{});
    else
      dispatch_float(k_cache.scalar_type(), "paged_decode (the cache; or int8)", run);
  });
  return out;
}

// Whether an int8 cache can be read here (the AVX-512 path; LLMSERVE_DECODE_AVX512=0 turns it off).
bool int8_kv_decode_supported() { return avx512_decode_supported(); }

// The split choose_splits makes, for the binding (tests read it).
int64_t decode_splits(int64_t items, int64_t max_context) { return choose_splits(items, max_context); }
