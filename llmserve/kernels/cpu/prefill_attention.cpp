// Prefill attention on CPU (AVX-512; fp32 FMAs in 8 lanes on AVX2): causal attention of each prompt chunk over its context, flash-style (online
// softmax over blocks of keys), fp32 arithmetic, for every prefill span of a step in one call.
//
// Where a span's keys come from, as in the torch reference (torch_backend.paged_attention):
// - a fresh prompt (nothing cached, and no sliding window shorter than it): this step's K/V rows, unrounded;
// - otherwise (a later chunk, a prefix-cache hit, a window shorter than the prompt): the paged cache at the span's
//   slots, every key of its context (this step's included, already written), dequantized for an int8 or int4 cache.
//
// Layout of the work. A work item is (span, KV head, tile of 16 query tokens): its rows are the G query heads
// sharing the KV head times the 16 tokens, head-major, so every 16-lane vector holds one head's 16 tokens and the
// causal mask of a key is the same for each head. Per block of up to 64 keys:
//   1. the span's K and V rows are widened (and dequantized: int8, int4) to fp32 once a call, K and V each [keys, D],
//      for all of its items (prefill_impl);
//   2. scores transposed, S^T [keys, rows] = K Q^T with Q^T [D, rows] made once per item: one FMA per key and
//      dimension gives 16 rows' scores, no horizontal sums (8 keys x up to 3 vectors of rows in registers);
//   3. the softmax runs down the keys, lane by lane (each lane is a row): max, exp, sum are vertical;
//   4. O^T [D, rows] += V^T P^T: one FMA per key and dimension for 16 rows (8 dimensions x 3 vectors held).
// Items are handed out longest first from a shared counter, so causal imbalance (the last tiles of a prompt
// see the most keys) evens out across threads.
//
// The dot path (dot=1, bf16 q and keys, CPUs with AVX512-BF16) computes the scores with vdpbf16ps instead: the sums
// run over pairs, so Q^T is kept as pairs of dimensions [D/2, rows] (unscaled: the scores are scaled after) and K rows
// are read as they are stored (their dimensions already come in pairs). Products are exact and sums fp32, in another
// order. P stays fp32 for the PV product: rounding it to bf16 (as flash attention's bf16 kernels do, and as this path
// first did) moved outputs by 2^-9 relative, so a prompt position computed here and the same position computed by
// the decode kernel after a prefix-cache hit got different tokens. Which path runs is measured on the running machine
// (llmserve/kernels/calibrate.py).
//
// The amx path (path=2, bf16 q and keys, CPUs with AMX-BF16, head_dim a multiple of 32) runs both products on AMX
// tiles in the same transposed layout, with a softmax of its own between them (softmax_pairs_amx):
//   - scores: S^T [16 keys, 16 tokens] tiles = K (the block's rows as stored) x Q^T pairs (the dot path's);
//   - values: O^T [16 dims, 16 tokens] tiles += V^T x P^T pairs, V^T (in blocks of 32 keys) made once a call per
//     (span, KV head) (the only operand that needs a transpose), and P split into two bf16 terms, P = hi + lo, ~17 of
//     its 24 bits (one bf16 P moved outputs by 2^-9, as the dot path found); products exact, sums fp32, in another
//     order than the FMAs'.
//   - keys are read in place where a block's rows are evenly spaced, else copied.
// Which path runs is measured (calibrate.py); the three agree but for a rare bf16 unit of the output.
//
// Why: torch's SDPA (flash attention for CPU) ran SmolLM2's prompts of 36-390 tokens at ~73 GFLOP/s in fp32 on
// 2 cores (1.8 s of a 64-request workload's prefill), and converting each span's q/k/v to fp32 and back
// copied every row twice more.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "float_types.h"  // dispatch_float

#include "amx_tiles.h"     // TileConfig, load_tile_config
#include "avx2_math.h"    // LLMSERVE_AVX2, exp256
#include "avx512_math.h"  // LLMSERVE_AVX512, load16, exp512
#include "kernels.h"       // amx_bf16_supported

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTileTokens = 16;  // query tokens per work item: one vector of lanes per head
constexpr int64_t kShortSpanTokens = kTileTokens;  // a span over a cached context of at most this many runs fp32
constexpr int64_t kKeyBlock = 64;    // keys per softmax block
constexpr int kRowsPerPass = 8;      // rows of S^T (keys) or O^T (dimensions) in registers at once
constexpr int kMaxRowVecs = 3;       // 16-row vectors in registers at once (8 x 3 = 24 accumulators)

// A source of K or V rows: element (key j, dimension d) at rows[j] + d, times scale[j] for an int8 cache; an int4
// cache's (uint8, two codes a byte: d / 2 bytes on) is code * params[j][0] + params[j][1].
template <typename T>
struct Rows {
  const T* base;
  const int64_t* slots;  // cache: slot of key j (row = slots[j] * slot_stride); null: tensor rows base + j * stride
  int64_t stride;        // elements between rows (slots or consecutive tokens)
  const float* scales;   // int8 cache: [slots, kv_heads] flattened with scale_stride; else null
  int64_t scale_stride;
  const at::Half* params = nullptr;  // int4 cache: (scale, zero) [slots, kv_heads, 2], scale_stride pairs a slot

  const T* row(int64_t j) const { return base + (slots != nullptr ? slots[j] : j) * stride; }
  // whether rows j0 .. j0 + n - 1 are stride apart in memory (every row of a tensor; consecutive slots of a cache)
  bool even(int64_t j0, int64_t n) const {
    if (slots == nullptr) return true;
    for (int64_t t = 1; t < n; ++t)
      if (slots[j0 + t] != slots[j0] + t) return false;
    return true;
  }
  float scale(int64_t j) const { return scales[(slots != nullptr ? slots[j] : j) * scale_stride]; }
  const at::Half* param(int64_t j) const { return params + 2 * (slots != nullptr ? slots[j] : j) * scale_stride; }
};

// dst[t, 0:D] = fp32 rows j0 .. j0 + n of src (dequantized for int8 and int4, as torch_backend.dequantize: int4's
// code * scale, rounded, + zero).
template <typename T>
LLMSERVE_AVX512 void widen_rows(const Rows<T>& src, int64_t j0, int64_t n, int64_t D, float* dst) {
  for (int64_t t = 0; t < n; ++t) {
    const T* r = src.row(j0 + t);
    float* o = dst + t * D;
    if constexpr (std::is_same_v<T, int8_t>) {
      const __m512 sc = _mm512_set1_ps(src.scale(j0 + t));
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(sc, load16(r + c)));
    } else if constexpr (std::is_same_v<T, uint8_t>) {
      widen_int4_row(r, src.param(j0 + t), D, o);
    } else {
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(o + c, load16(r + c));
    }
  }
}

// The two products of the attention, as one register-tiled pass: out[r, v] (+)= sum_s a[r * row_stride + s * sum_stride]
// b[s, v] for rows r in [0, rows) (a multiple of kRowsPerPass) and row vectors v in [v0, v0 + RV); out and b are
// [.., V, 16]. Scores: S^T[j, v] = sum_d K[j, d] Q^T[d, v] (a = K, row_stride D, sum_stride 1, out zeroed first).
// Values: O^T[d, v] += sum_j V[j, d] P^T[j, v] (a = V, row_stride 1, sum_stride D, accumulated).
// no-tree-pre: GCC 12 otherwise keeps the accumulators on the stack, see w8a8_linear.cpp.
template <int RV>
LLMSERVE_AVX512 __attribute__((optimize("no-tree-pre"))) void tile_pass(const float* a, int64_t row_stride,
                                                                      int64_t sum_stride, int64_t rows, int64_t sums,
                                                                      const float* b, int64_t V, int64_t v0,
                                                                      bool accumulate, float* out) {
  for (int64_t r = 0; r < rows; r += kRowsPerPass) {
    __m512 acc[kRowsPerPass][RV];
    _Pragma("GCC unroll 8") for (int k = 0; k < kRowsPerPass; ++k)
      _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v)
        acc[k][v] = accumulate ? _mm512_loadu_ps(out + ((r + k) * V + v0 + v) * 16) : _mm512_setzero_ps();
    for (int64_t i = 0; i < sums; ++i) {
      __m512 bv[RV];
      _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v) bv[v] = _mm512_loadu_ps(b + (i * V + v0 + v) * 16);
      _Pragma("GCC unroll 8") for (int k = 0; k < kRowsPerPass; ++k) {
        const __m512 ab = _mm512_set1_ps(a[(r + k) * row_stride + i * sum_stride]);
        _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_fmadd_ps(ab, bv[v], acc[k][v]);
      }
    }
    _Pragma("GCC unroll 8") for (int k = 0; k < kRowsPerPass; ++k)
      _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v) _mm512_storeu_ps(out + ((r + k) * V + v0 + v) * 16, acc[k][v]);
  }
}

template <typename Pass>
void by_row_vectors(int64_t V, const Pass& pass) {  // pass(RV tag, v0) over [0, V) in runs of <= kMaxRowVecs
  for (int64_t v0 = 0; v0 < V; v0 += kMaxRowVecs) {
    switch (std::min<int64_t>(kMaxRowVecs, V - v0)) {
      case 1: pass(std::integral_constant<int, 1>{}, v0); break;
      case 2: pass(std::integral_constant<int, 2>{}, v0); break;
      default: pass(std::integral_constant<int, 3>{}, v0); break;
    }
  }
}

// The scores S^T [keys, V, 16] by vdpbf16ps (the dot path): kp = the block's keys as bf16 pairs of dimensions
// [keys, pairs], qtp = Q^T pairs [pairs, V, 16]; the sums run over pairs. tile_pass's register tiling (8 keys x RV
// row vectors).
template <int RV>
LLMSERVE_AVX512BF16 __attribute__((optimize("no-tree-pre"))) void scores_dot(const uint32_t* kp, int64_t keys,
                                                                           int64_t pairs, const uint32_t* qtp,
                                                                           int64_t V, int64_t v0, float* st) {
  for (int64_t r = 0; r < keys; r += kRowsPerPass) {
    __m512 acc[kRowsPerPass][RV];
    _Pragma("GCC unroll 8") for (int k = 0; k < kRowsPerPass; ++k)
      _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
      __m512bh qv[RV];
      _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v)
        qv[v] = (__m512bh)_mm512_loadu_si512(qtp + (i * V + v0 + v) * 16);
      _Pragma("GCC unroll 8") for (int k = 0; k < kRowsPerPass; ++k) {
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(kp[(r + k) * pairs + i]));
        _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], kv, qv[v]);
      }
    }
    _Pragma("GCC unroll 8") for (int k = 0; k < kRowsPerPass; ++k)
      _Pragma("GCC unroll 8") for (int v = 0; v < RV; ++v) _mm512_storeu_ps(st + ((r + k) * V + v0 + v) * 16, acc[k][v]);
  }
}

#define LLMSERVE_AMX_ATTN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// Every tile 16 rows of 64 bytes; configured once per thread, released when it is done.
class AttnTiles {
 public:
  LLMSERVE_AMX_ATTN void configure() {
    if (on_) return;
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    load_tile_config(c);
    on_ = true;
  }
  LLMSERVE_AMX_ATTN ~AttnTiles() {
    if (on_) _tile_release();
  }

 private:
  bool on_ = false;
};

// S^T [nk16 keys, V, 16] = K Q^T: kp the block's keys [nk16, D] bf16, ldk elements apart, qtp Q^T pairs
// [D / 2, V, 16]. Unscaled.
LLMSERVE_AMX_ATTN void scores_amx(const uint16_t* kp, int64_t ldk, int64_t nk16, int64_t D, const uint32_t* qtp,
                                  int64_t V, float* st) {
  const int64_t ld = V * 16 * 4;  // bytes between Q^T's pair rows, and between S^T's keys
  for (int64_t kt = 0; kt < nk16 / 16; ++kt)
    for (int64_t g = 0; g < V; ++g) {
      _tile_zero(0);
      for (int64_t ks = 0; ks < D / 32; ++ks) {
        _tile_loadd(1, kp + kt * 16 * ldk + ks * 32, ldk * 2);
        _tile_loadd(2, qtp + (ks * 16 * V + g) * 16, ld);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, st + (kt * 16 * V + g) * 16, ld);
    }
}

// O^T [D, V, 16] += V^T P^T over nk32 keys: vt V^T in blocks of 32 keys, [keys / 32][D][32] from the block's first
// key (each A tile 1 KB in one piece, where a plain V^T's rows lie a context's width apart), pp the two terms of P^T
// pairs, each [nk32 / 2, V, 16] (term stride `term` uint32). Measured on the Xeon with AMX (perf): the time sits on the
// tdpbf16ps themselves, not the tile loads; keeping every head's C tile in a register across the A tiles gained
// nothing measurable.
LLMSERVE_AMX_ATTN void values_amx(const uint16_t* vt, int64_t nk32, int64_t D, const uint32_t* pp, int64_t term,
                                  int64_t V, float* ot) {
  const int64_t ld = V * 16 * 4;
  for (int64_t dt = 0; dt < D / 16; ++dt)
    for (int64_t g = 0; g < V; ++g) {
      float* o = ot + (dt * 16 * V + g) * 16;
      _tile_loadd(0, o, ld);
      for (int64_t kk = 0; kk < nk32 / 32; ++kk) {
        _tile_loadd(1, vt + (kk * D + dt * 16) * 32, 64);
        const uint32_t* b = pp + (kk * 16 * V + g) * 16;
        _tile_loadd(2, b, ld);
        _tile_loadd(3, b + term, ld);
        _tile_dpbf16ps(0, 1, 2);
        _tile_dpbf16ps(0, 1, 3);
      }
      _tile_stored(0, o, ld);
    }
}

// 2^x for x <= 0 (softmax's argument): x = n + f, |f| <= 1/2, 2^f by a degree-5 polynomial fitted to relative error
// (2.3e-7 in fp32 arithmetic, against P's ~2^-17 in the two bf16 terms below), times 2^n by vscalefps. Nine
// instructions where exp512's range reduction and rebuild take sixteen.
// No clamp: for any finite x, 2^n below fp32's range scales p to 0 (a denormal first), as exp would.
LLMSERVE_AVX512 inline __m512 exp2_neg(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3276422396e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6755409613e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507134646e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192f));
  return _mm512_scalef_ps(p, n);
}

// The amx path's online softmax over one block of n keys, straight from the raw scores to values_amx's operand. st:
// raw (unscaled) S^T [n, V, 16]; vis[j]: the lanes that see key j; m, l: each row's reference max (in units of
// x * scale * log2(e)) and sum, [V, 16]; ot: O^T [D, V, 16], rescaled here where a row's reference moved. Writes pp:
// P^T as pairs of keys (2j, 2j + 1) per lane, two bf16 terms P = hi + lo, each rounded half up from the bits (hi: P
// to 2^-9 of its value; lo: the exact rest P - hi to 2^-9 of itself, so P to ~2^-17), keys n .. nk32 zero.
// - Two passes over the scores (max; then exp, sum and split together), against four before (scale, max, exp,
//   split). The max runs on four accumulators: one was a chain of dependent vmaxps, 14% of the kernel's samples.
// - The reference max moves only where a row's max passes it by more than kLazyMax (P then stays below 2^kLazyMax,
//   and l and O^T carry the same factor, which the final division removes): with 16 rows a tile, some row's max
//   rose in nearly every block, and rescaling O^T (D vectors a head) took ~11% of the kernel's samples.
constexpr float kLazyMax = 8.f;

LLMSERVE_AVX512 void softmax_pairs_amx(const float* st, int64_t n, int64_t nk32, int64_t V, const __mmask16* vis,
                                       float scale, float* m, float* l, int64_t D, float* ot, uint32_t* pp,
                                       int64_t term) {
  const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i half = _mm512_set1_epi32(0x8000), high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // every lane sees every key of the block (most blocks): no masks; a positive scale (every model's): the max of the
  // raw scores times c is the max of the scaled ones
  bool all = true;
  for (int64_t j = 0; j < n; ++j) all &= vis[j] == __mmask16(0xFFFF);
  for (int64_t v = 0; v < V; ++v) {
    const float* sv = st + v * 16;
    const int64_t ld = V * 16;
    const __m512 old = _mm512_loadu_ps(m + v * 16);
    __m512 mx;
    if (all && scale > 0.f) {
      __m512 r[4] = {ninf, ninf, ninf, ninf};
      int64_t j = 0;
      for (; j + 4 <= n; j += 4)
        for (int e = 0; e < 4; ++e) r[e] = _mm512_max_ps(r[e], _mm512_loadu_ps(sv + (j + e) * ld));
      for (; j < n; ++j) r[0] = _mm512_max_ps(r[0], _mm512_loadu_ps(sv + j * ld));
      mx = _mm512_mul_ps(c, _mm512_max_ps(_mm512_max_ps(r[0], r[1]), _mm512_max_ps(r[2], r[3])));
    } else {
      mx = ninf;
      for (int64_t j = 0; j < n; ++j)
        mx = _mm512_mask_max_ps(mx, vis[j], mx, _mm512_mul_ps(c, _mm512_loadu_ps(sv + j * ld)));
    }
    // lanes whose block max passed their reference by more than kLazyMax (a lane's first visible keys included:
    // -inf + kLazyMax is -inf) take it as their new reference; lanes that have seen no key keep -inf and subtract 0
    // (their p are all masked to 0)
    const __mmask16 upd = _mm512_cmp_ps_mask(mx, _mm512_add_ps(old, _mm512_set1_ps(kLazyMax)), _CMP_GT_OQ);
    const __m512 ref = _mm512_mask_mov_ps(old, upd, mx);
    const __m512 sub = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ref, ninf, _CMP_NEQ_OQ), ref);
    const __mmask16 rescale = upd & _mm512_cmp_ps_mask(old, ninf, _CMP_NEQ_OQ);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // even and odd keys: two chains of adds, not one
    for (int64_t j = 0; j < nk32 / 2; ++j) {
      __m512i h[2], r[2];
      for (int e = 0; e < 2; ++e) {
        const int64_t key = 2 * j + e;
        __m512 p = _mm512_setzero_ps();
        if (key < n) {
          p = exp2_neg(_mm512_fmsub_ps(_mm512_loadu_ps(sv + key * ld), c, sub));
          if (!all) p = _mm512_maskz_mov_ps(vis[key], p);
          sum[e] = _mm512_add_ps(sum[e], p);
        }
        const __m512i bits = _mm512_castps_si512(p);
        h[e] = _mm512_and_si512(_mm512_add_epi32(bits, half), high);
        r[e] = _mm512_add_epi32(_mm512_castps_si512(_mm512_sub_ps(p, _mm512_castsi512_ps(h[e]))), half);
      }
      uint32_t* o = pp + (j * V + v) * 16;
      // (a >> 16) | (b & high): ternary logic 0xF8 is A | (B & C)
      _mm512_storeu_si512(o, _mm512_ternarylogic_epi32(_mm512_srli_epi32(h[0], 16), h[1], high, 0xF8));
      _mm512_storeu_si512(o + term, _mm512_ternarylogic_epi32(_mm512_srli_epi32(r[0], 16), r[1], high, 0xF8));
    }
    __m512 lv = _mm512_loadu_ps(l + v * 16);
    if (rescale != 0) {
      // 2^(old - new) where the reference moved, 1 elsewhere
      const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), rescale, exp2_neg(_mm512_sub_ps(
                                                  _mm512_maskz_mov_ps(rescale, old), _mm512_maskz_mov_ps(rescale, mx))));
      lv = _mm512_mul_ps(lv, alpha);
      for (int64_t d = 0; d < D; ++d) {
        float* o = ot + (d * V + v) * 16;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
      }
    }
    _mm512_storeu_ps(l + v * 16, _mm512_add_ps(lv, _mm512_add_ps(sum[0], sum[1])));
    _mm512_storeu_ps(m + v * 16, ref);
  }
}

// r[0..15] (16 rows of 16 32-bit lanes) transposed in place: r[j] lane i = the old r[i] lane j.
LLMSERVE_AVX512 inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // each 128-bit lane of r now holds a 4x4 block; gather the blocks: 128-bit lanes (0, 2) then (1, 3) of row pairs
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// The dot and amx paths' Q^T pairs of a tile, qtp [D / 2, G, 16]: qtp[(p G + g) 16 + i] = dimensions (2p, 2p + 1) of
// token i's row of head g (q0: token 0's row of head 0; rows q_row elements apart), lanes past nt zero; D % 32 == 0.
// 16 rows' pairs transposed 16 at a time in registers, where storing each pair on its own took ~9% of the kernel's
// samples over short prompts (a step of ~10 spans of 36-390 tokens).
LLMSERVE_AVX512 void q_pairs(const c10::BFloat16* q0, int64_t q_row, int64_t nt, int64_t G, int64_t D,
                             uint32_t* qtp) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < nt ? _mm512_loadu_si512(q0 + i * q_row + g * D + 2 * p0) : _mm512_setzero_si512();
      transpose16x16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(qtp + ((p0 + j) * G + g) * 16, r[j]);
    }
}

// A tile's output rows from O^T [D, G, 16] and the rows' sums l [G, 16]: out row i of head g = O^T[:, g, i] / l (0
// where l is 0), rounded to bf16 as static_cast does; rows past nt untouched; D % 32 == 0. Pairs of dimensions rounded
// 16 lanes at a time and transposed in registers, where the scalar loop's strided reads took ~11% of the kernel's
// samples over short prompts. The same bits.
LLMSERVE_AVX512 void out_rows(const float* ot, const float* l, int64_t nt, int64_t G, int64_t D, c10::BFloat16* out0,
                              int64_t out_row) {
  for (int64_t g = 0; g < G; ++g) {
    const __m512 lv = _mm512_loadu_ps(l + g * 16);
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(lv, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           _mm512_set1_ps(1.f), lv);
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t d = 2 * (p0 + j);
        const __m512i lo = bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(ot + (d * G + g) * 16), inv));
        const __m512i hi = bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(ot + ((d + 1) * G + g) * 16), inv));
        r[j] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      transpose16x16(r);
      for (int64_t i = 0; i < nt; ++i) _mm512_storeu_si512(out0 + i * out_row + g * D + 2 * p0, r[i]);
    }
  }
}

// The live lanes (query tokens at positions pos) that see `key`: key <= p (causal) and key > p - window (window > 0).
// masked false: the caller knows every lane sees every key of its block.
LLMSERVE_AVX512 inline __mmask16 visible(int64_t key, __mmask16 live, bool masked, __m512i pos, int64_t window) {
  if (!masked) return live;
  const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(key));
  __mmask16 v = live & _mm512_cmple_epi32_mask(k, pos);
  if (window > 0)
    v &= _mm512_cmpgt_epi32_mask(k, _mm512_sub_epi32(pos, _mm512_set1_epi32(static_cast<int32_t>(window))));
  return v;
}

struct Span {
  int64_t q_start, q_len, num_cached, slot_offset;
  bool from_cache;
};

struct Scratch {
  std::vector<float> qt, ot, st, m, l;
  std::vector<uint32_t> qtp, kp;  // the dot path's pairs: Q^T [D/2, V, 16], K [keys, D/2]
  std::vector<uint32_t> pp;       // the amx path's P^T pairs, two terms of [keys / 2, V, 16]
  Scratch(int64_t D, int64_t V) : qt(D * V * 16), ot(D * V * 16), st(kKeyBlock * V * 16), m(V * 16), l(V * 16),
                                  qtp(D / 2 * V * 16), kp(kKeyBlock * D / 2),
                                  pp(2 * kKeyBlock / 2 * V * 16) {}
};

// Q^T [D, G * 16] of a tile's nt tokens, pre-scaled, lanes past nt 0 (their outputs are never written): q0 the first
// token's first head of the group, rows q_row apart.
template <typename TQ>
void fill_qt(const TQ* q0, int64_t q_row, int64_t nt, int64_t G, int64_t D, float scale, Scratch& s) {
  std::fill(s.qt.begin(), s.qt.end(), 0.f);
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const TQ* qr = q0 + i * q_row + g * D;
      for (int64_t d = 0; d < D; ++d) s.qt[d * G * 16 + g * 16 + i] = static_cast<float>(qr[d]) * scale;
    }
}

// A work item's O^T, running max and sum, before its first block.
inline void reset_sums(Scratch& s) {
  std::fill(s.ot.begin(), s.ot.end(), 0.f);
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.f);
}

// O^T / l into the tile's nt output rows (out0: the first token's first head of the group, rows out_row apart).
template <typename TQ>
void write_out(const Scratch& s, int64_t nt, int64_t G, int64_t D, TQ* out0, int64_t out_row) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nt; ++i) {
      const float lsum = s.l[g * 16 + i];
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      TQ* o = out0 + i * out_row + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<TQ>(s.ot[(d * G + g) * 16 + i] * inv);
    }
}

// The dot path's keys of one block of n keys (padded to n8 with 0): the rows copied as they are stored, pairs of
// dimensions.
void pair_keys(const Rows<c10::BFloat16>& keys, int64_t j0, int64_t n, int64_t n8, int64_t D, Scratch& s) {
  for (int64_t t = 0; t < n8; ++t) {
    auto* o = reinterpret_cast<uint16_t*>(s.kp.data() + t * D / 2);
    if (t < n) {
      const auto* r = reinterpret_cast<const uint16_t*>(keys.row(j0 + t));
      std::copy(r, r + D, o);
    } else {
      std::fill(o, o + D, uint16_t{0});
    }
  }
}

// A (span, KV head)'s keys and values as prefill_impl made them for all its work items, from key 0: kp the dot path's
// keys as stored [rows, D] bf16 (else null), kf the fp32 path's widened keys (else null), vf the values widened
// [rows, D]; all null for the amx path, which reads vt and the keys in place.
struct Rowsets {
  const uint16_t* kp;
  const float* kf;
  const float* vf;
};

// One work item: query tokens [i0, i0 + 16) of a span (context positions num_cached + i), the G heads of KV head
// kvh, over keys [0, ctx) of the span's source. q/out rows: [T, H, D] with row strides q_row / out_row.
// path 1: the dot path where q and the keys are bf16 (the caller checked the CPU); path 2: the amx path where vt (the
// span's V^T for this KV head in blocks of 32 keys, values_amx's) is given; else fp32 FMAs. The dot and fp32 paths read
// the keys and values from `made` (prefill_impl makes them once for every item), the amx path from vt and keys.
template <typename TQ, typename TK>
LLMSERVE_AVX512 void attend_tile(const TQ* q, int64_t q_row, const Span& sp, int64_t i0, int64_t kvh, int64_t G,
                                 int64_t D, const Rows<TK>& keys, float scale,
                                 int64_t window, int64_t path, const uint16_t* vt, const Rowsets& made, Scratch& s,
                                 TQ* out, int64_t out_row) {
  constexpr bool kBf16 = std::is_same_v<TQ, c10::BFloat16> && std::is_same_v<TK, c10::BFloat16>;
  const bool dot = path == 1 && kBf16;
  const bool amx = path == 2 && kBf16 && vt != nullptr;
  const int64_t V = G;  // row vectors: one per head
  const int64_t nt = std::min(kTileTokens, sp.q_len - i0);
  // Q^T [D, V * 16], pre-scaled (dot, amx: pairs of dimensions [D / 2, V * 16], unscaled); lanes past nt are 0 (their
  // outputs are never written)
  if constexpr (kBf16) {
    if ((dot || amx) && D % 32 == 0) q_pairs(q + (sp.q_start + i0) * q_row + kvh * G * D, q_row, nt, G, D, s.qtp.data());
  }
  if ((dot || amx) && D % 32 != 0) {
    std::fill(s.qtp.begin(), s.qtp.end(), 0u);
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const auto* qr = reinterpret_cast<const uint16_t*>(q + (sp.q_start + i0 + i) * q_row + (kvh * G + g) * D);
        for (int64_t p = 0; p < D / 2; ++p)
          s.qtp[p * V * 16 + g * 16 + i] = qr[2 * p] | (static_cast<uint32_t>(qr[2 * p + 1]) << 16);
      }
  } else if (!dot && !amx) {
    fill_qt(q + (sp.q_start + i0) * q_row + kvh * G * D, q_row, nt, G, D, scale, s);
  }
  reset_sums(s);
  // the tile's tokens sit at context positions p0 .. p0 + nt - 1 and see keys (p - window, p]
  const int64_t p0 = sp.num_cached + i0, p_last = p0 + nt - 1;
  // (amx: from a multiple of 32, where vt's blocks start; keys before the window are masked like any other)
  const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) / (amx ? 32 : 1) * (amx ? 32 : 1) : 0;
  const int64_t hi = p_last + 1;
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(p0)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __mmask16 live = tail_mask16(nt);
  for (int64_t j0 = lo; j0 < hi; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, hi - j0), n8 = (n + kRowsPerPass - 1) / kRowsPerPass * kRowsPerPass;
    if constexpr (kBf16) {
      if (amx) {
        // the A tiles read the keys in place where the block's nk16 rows are evenly spaced context rows (a fresh
        // prompt's; a cache's within its blocks), else from a copy (rows past n zero)
        const int64_t nk16 = (n + 15) / 16 * 16;
        const uint16_t* kp = reinterpret_cast<const uint16_t*>(s.kp.data());
        int64_t ldk = D;
        if (j0 + nk16 <= sp.num_cached + sp.q_len && keys.even(j0, nk16)) {
          kp = reinterpret_cast<const uint16_t*>(keys.row(j0));
          ldk = keys.stride;
        } else {
          pair_keys(keys, j0, n, nk16, D, s);
        }
        scores_amx(kp, ldk, nk16, D, s.qtp.data(), V, s.st.data());
        // the same for every head
        __mmask16 vis[kKeyBlock];
        const bool masked = j0 + n - 1 > p0 || (window > 0 && j0 <= p_last - window);
        for (int64_t j = 0; j < n; ++j) vis[j] = visible(j0 + j, live, masked, pos, window);
        const int64_t nk32 = (n + 31) / 32 * 32, term = kKeyBlock / 2 * V * 16;
        softmax_pairs_amx(s.st.data(), n, nk32, V, vis, scale, s.m.data(), s.l.data(), D, s.ot.data(), s.pp.data(),
                          term);
        values_amx(vt + j0 * D, nk32, D, s.pp.data(), term, V, s.ot.data());
        continue;
      } else if (dot) {
        // the span's keys from j0 on (rows past n: scores unused)
        const auto* kp = reinterpret_cast<const uint32_t*>(made.kp + j0 * D);
        by_row_vectors(V, [&](auto rv, int64_t v0) {
          scores_dot<decltype(rv)::value>(kp, n8, D / 2, s.qtp.data(), V, v0, s.st.data());
        });
        const __m512 sv = _mm512_set1_ps(scale);
        for (int64_t e = 0; e < n8 * V; ++e) _mm512_storeu_ps(s.st.data() + e * 16,
                                                              _mm512_mul_ps(sv, _mm512_loadu_ps(s.st.data() + e * 16)));
      }
    }
    if (!dot && !amx) {
      const float* kf = made.kf + j0 * D;  // (rows past n: scores unused)
      by_row_vectors(V, [&](auto rv, int64_t v0) {
        tile_pass<decltype(rv)::value>(kf, D, 1, n8, D, s.qt.data(), V, v0, false, s.st.data());
      });
    }
    // a key is visible to a lane where j <= p (causal) and j > p - window; the block needs masks only where some
    // lane does not see all of it
    const bool masked = j0 + n - 1 > p0 || (window > 0 && j0 <= p_last - window);
    for (int64_t v = 0; v < V; ++v) {
      float* m = s.m.data() + v * 16;
      float* l = s.l.data() + v * 16;
      __m512 mx = _mm512_loadu_ps(m);
      const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __mmask16 vis[kKeyBlock];
      for (int64_t j = 0; j < n; ++j) {
        vis[j] = visible(j0 + j, live, masked, pos, window);
        mx = _mm512_mask_max_ps(mx, vis[j], mx, _mm512_loadu_ps(s.st.data() + (j * V + v) * 16));
      }
      // lanes that have seen no key yet keep max -inf; subtract 0 there instead (their p are all masked to 0)
      const __m512 old = _mm512_loadu_ps(m);
      const __mmask16 seen = _mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_OQ);
      const __m512 sub = _mm512_maskz_mov_ps(seen, mx);
      const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old, ninf, _CMP_NEQ_OQ),
                                               exp512(_mm512_sub_ps(_mm512_maskz_mov_ps(seen, old), sub)));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < n8; ++j) {
        float* sj = s.st.data() + (j * V + v) * 16;
        const __m512 p = j < n ? _mm512_maskz_mov_ps(vis[j], exp512(_mm512_sub_ps(_mm512_loadu_ps(sj), sub)))
                               : _mm512_setzero_ps();
        _mm512_storeu_ps(sj, p);
        sum = _mm512_add_ps(sum, p);
      }
      _mm512_storeu_ps(l, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l), alpha), sum));
      _mm512_storeu_ps(m, mx);
      // no lane's max moved (most blocks past the first few): O^T times 1 is O^T, skip the pass over it
      if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0)
        for (int64_t d = 0; d < D; ++d) {
          float* o = s.ot.data() + (d * V + v) * 16;
          _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
        }
    }
    const float* vf = made.vf + j0 * D;  // the block's values in fp32 [n, D]
    by_row_vectors(V, [&](auto rv, int64_t v0) {
      tile_pass<decltype(rv)::value>(vf, 1, D, D, n, s.st.data(), V, v0, true, s.ot.data());
    });
  }
  if constexpr (std::is_same_v<TQ, c10::BFloat16>) {
    if (D % 32 == 0)
      return out_rows(s.ot.data(), s.l.data(), nt, G, D, out + (sp.q_start + i0) * out_row + kvh * G * D, out_row);
  }
  write_out(s, nt, G, D, out + (sp.q_start + i0) * out_row + kvh * G * D, out_row);
}

#ifdef LLMSERVE_AVX2
// ---- The fp32 path on CPUs with AVX2 and FMA (no AVX-512) ----
// attend_tile's fp32 path with each 16-lane vector (one head's 16 query tokens) as two 8-lane halves: the same
// layouts (Q^T, S^T, O^T [.., V, 16]), keys and values made once a call by prefill_impl, the same online softmax down
// the keys; a key's visible lanes are a 16-bit set made into two lane masks. fp32, fp16 and bf16 q and caches (an int8
// or int4 cache's prefill stays on AVX-512, as its decode). exp256's polynomial, not exp512's: the outputs agree with
// the AVX-512 path's to fp32 rounding, not bit for bit.
// Why: without AVX-512 every prefill ran torch's SDPA and the attention's Python around it, and the native decoder
// stack (which needs native prefill attention for a step with prompts) ran decode-only steps. On a 2-core Zen 3 (AVX2
// only), SDPA took 0.54 ms a layer for a 36-token prompt (SmolLM2's 9 heads over 3 KV heads, head_dim 64), 7.0 at
// 500 tokens and 59 at 2,000: 16, 210 and 1,780 ms of those prompts' first tokens over 30 layers.

bool avx2_fma_supported() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

constexpr int kRowsPerPass2 = 4;  // rows of S^T (keys) or O^T (dimensions) in registers: 4 x 2 halves accumulators

inline __m256 load8w(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8w(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8w(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// widen_rows for the float caches (and this step's rows) in 8 lanes; D % 16 == 0.
template <typename T>
void widen_rows_avx2(const Rows<T>& src, int64_t j0, int64_t n, int64_t D, float* dst) {
  if constexpr (std::is_same_v<T, int8_t> || std::is_same_v<T, uint8_t>) {
    TORCH_CHECK(false, "prefill_attention: an int8 or int4 cache needs AVX-512");
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const T* r = src.row(j0 + t);
      for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(dst + t * D + c, load8w(r + c));
    }
  }
}

// tile_pass for one row vector v (two halves): out[r, v] (+)= sum_s a[r * row_stride + s * sum_stride] b[s, v], rows
// a multiple of kRowsPerPass2.
__attribute__((optimize("no-tree-pre"))) void tile_pass_avx2(const float* a, int64_t row_stride, int64_t sum_stride,
                                                              int64_t rows, int64_t sums, const float* b, int64_t V,
                                                              int64_t v, bool accumulate, float* out) {
  for (int64_t r = 0; r < rows; r += kRowsPerPass2) {
    __m256 acc[kRowsPerPass2][2];
    _Pragma("GCC unroll 4") for (int k = 0; k < kRowsPerPass2; ++k)
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
        acc[k][h] = accumulate ? _mm256_loadu_ps(out + ((r + k) * V + v) * 16 + 8 * h) : _mm256_setzero_ps();
    for (int64_t i = 0; i < sums; ++i) {
      const __m256 b0 = _mm256_loadu_ps(b + (i * V + v) * 16), b1 = _mm256_loadu_ps(b + (i * V + v) * 16 + 8);
      _Pragma("GCC unroll 4") for (int k = 0; k < kRowsPerPass2; ++k) {
        const __m256 ab = _mm256_broadcast_ss(a + (r + k) * row_stride + i * sum_stride);
        acc[k][0] = _mm256_fmadd_ps(ab, b0, acc[k][0]);
        acc[k][1] = _mm256_fmadd_ps(ab, b1, acc[k][1]);
      }
    }
    _Pragma("GCC unroll 4") for (int k = 0; k < kRowsPerPass2; ++k)
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(out + ((r + k) * V + v) * 16 + 8 * h, acc[k][h]);
  }
}

// visible's lanes as a 16-bit set: lane i (context position p0 + i) sees `key` where key <= p0 + i and, with a
// window, key > p0 + i - window; live: the tile's tokens.
inline uint32_t visible_bits(int64_t key, uint32_t live, bool masked, int64_t p0, int64_t window) {
  if (!masked) return live;
  uint32_t v = live & (0xFFFFu << std::clamp<int64_t>(key - p0, 0, 16)) & 0xFFFFu;
  if (window > 0) v &= (1u << std::clamp<int64_t>(key - p0 + window, 0, 16)) - 1u;
  return v;
}

// A 16-bit lane set as two masks of 8 lanes (all ones where the lane's bit is set).
inline void lane_masks(uint32_t bits, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_set1_epi32(static_cast<int32_t>(bits));
  const __m256i sel_lo = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i sel_hi = _mm256_slli_epi32(sel_lo, 8);
  lo = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, sel_lo), sel_lo));
  hi = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, sel_hi), sel_hi));
}

// One work item on the fp32 path (attend_tile's arguments; the keys and values from `made`).
template <typename TQ>
void attend_tile_avx2(const TQ* q, int64_t q_row, const Span& sp, int64_t i0, int64_t kvh, int64_t G, int64_t D,
                      float scale, int64_t window, const Rowsets& made, Scratch& s, TQ* out, int64_t out_row) {
  const int64_t V = G;
  const int64_t nt = std::min(kTileTokens, sp.q_len - i0);
  fill_qt(q + (sp.q_start + i0) * q_row + kvh * G * D, q_row, nt, G, D, scale, s);
  reset_sums(s);
  const int64_t p0 = sp.num_cached + i0, p_last = p0 + nt - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0, hi = p_last + 1;
  const uint32_t live = nt >= 16 ? 0xFFFFu : (1u << nt) - 1u;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), one = _mm256_set1_ps(1.f);
  for (int64_t j0 = lo; j0 < hi; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, hi - j0), n8 = (n + 7) / 8 * 8;
    const float* kf = made.kf + j0 * D;  // (rows past n: zeros or later keys, their scores unused)
    for (int64_t v = 0; v < V; ++v) tile_pass_avx2(kf, D, 1, n8, D, s.qt.data(), V, v, false, s.st.data());
    const bool masked = j0 + n - 1 > p0 || (window > 0 && j0 <= p_last - window);
    uint32_t vis[kKeyBlock];
    for (int64_t j = 0; j < n; ++j) vis[j] = visible_bits(j0 + j, live, masked, p0, window);
    for (int64_t v = 0; v < V; ++v) {
      float* m = s.m.data() + v * 16;
      float* l = s.l.data() + v * 16;
      __m256 mx[2] = {_mm256_loadu_ps(m), _mm256_loadu_ps(m + 8)};
      for (int64_t j = 0; j < n; ++j) {
        __m256 k[2];
        lane_masks(vis[j], k[0], k[1]);
        for (int h = 0; h < 2; ++h)
          mx[h] = _mm256_blendv_ps(mx[h], _mm256_max_ps(mx[h], _mm256_loadu_ps(s.st.data() + (j * V + v) * 16 + 8 * h)),
                                   k[h]);
      }
      // lanes that have seen no key yet keep max -inf; subtract 0 there instead (their p are all masked to 0)
      __m256 sub[2], alpha[2], sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      int moved = 0;
      for (int h = 0; h < 2; ++h) {
        const __m256 old = _mm256_loadu_ps(m + 8 * h);
        const __m256 seen = _mm256_cmp_ps(mx[h], ninf, _CMP_NEQ_OQ);
        sub[h] = _mm256_and_ps(seen, mx[h]);
        alpha[h] = _mm256_and_ps(_mm256_cmp_ps(old, ninf, _CMP_NEQ_OQ),
                                 exp256(_mm256_sub_ps(_mm256_and_ps(seen, old), sub[h])));
        moved |= _mm256_movemask_ps(_mm256_cmp_ps(alpha[h], one, _CMP_NEQ_UQ));
      }
      for (int64_t j = 0; j < n8; ++j) {
        float* sj = s.st.data() + (j * V + v) * 16;
        __m256 k[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if (j < n) lane_masks(vis[j], k[0], k[1]);
        for (int h = 0; h < 2; ++h) {
          const __m256 p = _mm256_and_ps(k[h], exp256(_mm256_sub_ps(_mm256_loadu_ps(sj + 8 * h), sub[h])));
          _mm256_storeu_ps(sj + 8 * h, p);
          sum[h] = _mm256_add_ps(sum[h], p);
        }
      }
      for (int h = 0; h < 2; ++h) {
        _mm256_storeu_ps(l + 8 * h, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(l + 8 * h), alpha[h]), sum[h]));
        _mm256_storeu_ps(m + 8 * h, mx[h]);
      }
      if (moved)  // (no lane's max moved, as in most blocks past the first few: O^T times 1 is O^T)
        for (int64_t d = 0; d < D; ++d)
          for (int h = 0; h < 2; ++h) {
            float* o = s.ot.data() + (d * V + v) * 16 + 8 * h;
            _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), alpha[h]));
          }
    }
    const float* vf = made.vf + j0 * D;  // the block's values in fp32 [n, D]
    for (int64_t v = 0; v < V; ++v) tile_pass_avx2(vf, 1, D, D, n, s.st.data(), V, v, true, s.ot.data());
  }
  write_out(s, nt, G, D, out + (sp.q_start + i0) * out_row + kvh * G * D, out_row);
}
#else
bool avx2_fma_supported() { return false; }
template <typename T>
void widen_rows_avx2(const Rows<T>&, int64_t, int64_t, int64_t, float*) {}
template <typename TQ>
void attend_tile_avx2(const TQ*, int64_t, const Span&, int64_t, int64_t, int64_t, int64_t, float, int64_t,
                      const Rowsets&, Scratch&, TQ*, int64_t) {}
#endif

template <typename TQ, typename TC>
void prefill_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const void* k_scales, const void* v_scales,
                  const std::vector<Span>& spans, const int64_t* slots, double scale, int64_t window, int64_t path,
                  at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k.size(1), G = H / KVH;
  const bool avx512 = cpu_has_avx512();  // else the fp32 path in 8 lanes (attend_tile_avx2)
  // the amx path: V^T in blocks of 32 keys, [(ctx + 32) / 32][D][32] bf16 (keys past the context 0), of each (span, KV
  // head) whose keys are bf16 (a fresh prompt's, or a bf16 cache's), made once here; other spans keep FMAs
  constexpr bool kBf16Cache = std::is_same_v<TC, c10::BFloat16>;
  const bool amx = path == 2 && std::is_same_v<TQ, c10::BFloat16>;
  // On the amx path, a span of one tile over a cached context (speculative decoding's verify span: a token and up to
  // 15 drafts) runs the fp32 path, the nearer to the fp32 decode kernel that computes the same rows without drafts: against it, the
  // amx path's outputs differed by a bf16 unit in 0.24% of elements, the fp32 path's in 0.023% (bf16, 20 spans of 32
  // tokens over 20-800 cached). At a near tie that unit decides a greedy token: SmolLM2 given a prediction equal to
  // its own output differed at token 176 of 300 on amx, nowhere on fp32. At one tile the paths cost the same (2-core
  // Xeon with AMX, a layer over 2,000 cached tokens: 9 tokens 0.54 / 0.52 ms fp32 / amx, 17 tokens 0.73 / 0.76; 33
  // tokens 1.03 / 0.48, so not past one tile). The dot path keeps P fp32 and agrees with the FMAs nearly always
  // (tests/attention/test_prefill_attention.py): it keeps its spans.
  std::vector<int64_t> span_path(spans.size());
  for (size_t s = 0; s < spans.size(); ++s)
    span_path[s] = path == 2 && spans[s].num_cached > 0 && spans[s].q_len <= kShortSpanTokens ? 0 : path;
  std::vector<int64_t> vt_at(spans.size() * KVH + 1, 0);
  std::vector<uint16_t> vts;
  if (amx) {
    for (size_t s = 0; s < spans.size(); ++s)
      for (int64_t h = 0; h < KVH; ++h)
        vt_at[s * KVH + h + 1] = vt_at[s * KVH + h] + (span_path[s] == 2 && (!spans[s].from_cache || kBf16Cache)
                                                           ? D * ((spans[s].num_cached + spans[s].q_len) / 32 + 2) * 32
                                                           : 0);
    vts.assign(vt_at.back(), 0);
    at::parallel_for(0, static_cast<int64_t>(spans.size()) * KVH, 1, [&](int64_t b, int64_t e) {
      for (int64_t u = b; u < e; ++u) {
        if (vt_at[u + 1] == vt_at[u]) continue;
        const Span& sp = spans[u / KVH];
        const int64_t h = u % KVH, ctx = sp.num_cached + sp.q_len;
        uint16_t* dst = vts.data() + vt_at[u];
        for (int64_t j = 0; j < ctx; ++j) {
          const uint16_t* r = reinterpret_cast<const uint16_t*>(v.data_ptr<TQ>()) + (sp.q_start + j) * v.stride(0) +
                              h * D;
          if constexpr (kBf16Cache) {
            if (sp.from_cache)
              r = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<TC>()) + slots[sp.slot_offset + j] * KVH * D +
                  h * D;
          }
          uint16_t* block = dst + (j / 32) * D * 32 + j % 32;
          for (int64_t d = 0; d < D; ++d) block[d * 32] = r[d];
        }
      }
    });
  }
  // Each (span, KV head) that does not run the amx path gets its keys and values once here, contiguous, in the form
  // its work items read them: the dot path's keys as stored (bf16 pairs) and its values widened to fp32; the fp32
  // path's keys and values widened (and dequantized: int8, int4). Every work item of 16 query tokens used to copy or
  // widen each block it read itself: a 2,000-token prompt's rows ~62 times each, from rows 1,920 bytes apart in the fused qkv
  // output (their loads were the kernel's hottest spot after its two products; 2-core Zen 5: 15.3-22.7 against
  // 11.9-13.0 ms a layer). Rows padded to a multiple of 8 (+ 8) with zeros: the score passes read whole groups of 8
  // keys. The same values as before: the same bits.
  constexpr bool kInt4 = std::is_same_v<TC, uint8_t>;  // packed: D / 2 bytes a row, (scale, zero) fp16 pairs
  const int64_t R = kInt4 ? D / 2 : D, cache_row = KVH * R;  // elements per row, per slot
  auto key_rows = [&](const Span& sp, int64_t h) {  // (keys, values) of the span's KV head h, cache or this step's
    auto rows = [&](const at::Tensor& cache, const void* scales) {
      Rows<TC> r{cache.data_ptr<TC>() + h * R, slots + sp.slot_offset, cache_row, nullptr, KVH};
      if constexpr (kInt4)
        r.params = static_cast<const at::Half*>(scales) + 2 * h;
      else if (scales != nullptr)
        r.scales = static_cast<const float*>(scales) + h;
      return r;
    };
    return std::make_pair(rows(k_cache, k_scales), rows(v_cache, v_scales));
  };
  auto step_rows = [&](const Span& sp, int64_t h) {
    return std::make_pair(Rows<TQ>{k.data_ptr<TQ>() + sp.q_start * k.stride(0) + h * D, nullptr, k.stride(0), nullptr, 0},
                          Rows<TQ>{v.data_ptr<TQ>() + sp.q_start * v.stride(0) + h * D, nullptr, v.stride(0), nullptr, 0});
  };
  constexpr bool kBf16Q = std::is_same_v<TQ, c10::BFloat16>;
  const int64_t units = static_cast<int64_t>(spans.size()) * KVH;
  std::vector<int64_t> rows_at(units + 1, 0);  // each unit's first row in the buffers (none: amx, which has vt)
  std::vector<bool> dot_rows(units, false);
  for (int64_t u = 0; u < units; ++u) {
    const Span& sp = spans[u / KVH];
    const bool bf16_keys = kBf16Q && (!sp.from_cache || kBf16Cache);
    dot_rows[u] = span_path[u / KVH] == 1 && bf16_keys;
    const bool own = amx && span_path[u / KVH] == 2 && bf16_keys;
    rows_at[u + 1] = rows_at[u] + (own ? 0 : ((sp.num_cached + sp.q_len) / 8 + 2) * 8);
  }
  std::unique_ptr<float[]> kfs(new float[rows_at.back() * D]), vfs(new float[rows_at.back() * D]);
  std::unique_ptr<uint16_t[]> kps(new uint16_t[rows_at.back() * D]);
  at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      if (rows_at[u + 1] == rows_at[u]) continue;
      const Span& sp = spans[u / KVH];
      const int64_t h = u % KVH, ctx = sp.num_cached + sp.q_len, row0 = rows_at[u], pad = rows_at[u + 1] - row0;
      float* vf = vfs.get() + row0 * D;
      auto widen = [&](const auto& rows, float* dst) {
        if (avx512) widen_rows(rows, 0, ctx, D, dst);
        else widen_rows_avx2(rows, 0, ctx, D, dst);
      };
      auto fill = [&](const auto& kr, const auto& vr) {
        widen(vr, vf);
        if (dot_rows[u]) {
          uint16_t* kp = kps.get() + row0 * D;
          for (int64_t j = 0; j < ctx; ++j) {
            const auto* r = reinterpret_cast<const uint16_t*>(kr.row(j));
            std::copy(r, r + D, kp + j * D);
          }
          std::fill(kp + ctx * D, kp + pad * D, uint16_t{0});
        } else {
          widen(kr, kfs.get() + row0 * D);
          std::fill(kfs.get() + (row0 + ctx) * D, kfs.get() + (row0 + pad) * D, 0.f);
        }
        std::fill(vf + ctx * D, vf + pad * D, 0.f);
      };
      if (sp.from_cache) {
        const auto [kr, vr] = key_rows(sp, h);
        fill(kr, vr);
      } else {
        const auto [kr, vr] = step_rows(sp, h);
        fill(kr, vr);
      }
    }
  });
  struct Item {
    int64_t span, kvh, i0, cost;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < static_cast<int64_t>(spans.size()); ++s)
    for (int64_t i0 = 0; i0 < spans[s].q_len; i0 += kTileTokens) {
      const int64_t keys = spans[s].num_cached + std::min(spans[s].q_len, i0 + kTileTokens);
      for (int64_t h = 0; h < KVH; ++h)
        items.push_back({s, h, i0, window > 0 ? std::min(keys, window + kTileTokens) : keys});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const TQ* qp = q.data_ptr<TQ>();
  TQ* op = out.data_ptr<TQ>();
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch s(D, G);
    AttnTiles tiles;
    if (amx) tiles.configure();
    for (int64_t u = next++; u < n_items; u = next++) {
      const Item& it = items[u];
      const Span& sp = spans[it.span];
      const float sc = static_cast<float>(scale);
      const int64_t vu = it.span * KVH + it.kvh;
      const uint16_t* vt = amx && vt_at[vu + 1] > vt_at[vu] ? vts.data() + vt_at[vu] : nullptr;
      const bool shared = rows_at[vu + 1] > rows_at[vu];
      const Rowsets made{shared && dot_rows[vu] ? kps.get() + rows_at[vu] * D : nullptr,
                         shared && !dot_rows[vu] ? kfs.get() + rows_at[vu] * D : nullptr,
                         shared ? vfs.get() + rows_at[vu] * D : nullptr};
      if (!avx512) {
        attend_tile_avx2<TQ>(qp, q.stride(0), sp, it.i0, it.kvh, G, D, sc, window, made, s, op, out.stride(0));
      } else if (sp.from_cache) {
        attend_tile<TQ, TC>(qp, q.stride(0), sp, it.i0, it.kvh, G, D, key_rows(sp, it.kvh).first, sc, window,
                            span_path[it.span], vt, made, s, op, out.stride(0));
      } else {  // this step's rows: token j of the span at row q_start + j
        attend_tile<TQ, TQ>(qp, q.stride(0), sp, it.i0, it.kvh, G, D, step_rows(sp, it.kvh).first, sc, window,
                            span_path[it.span], vt, made, s, op, out.stride(0));
      }
    }
  });
}

}  // namespace

bool prefill_attention_supported() { return cpu_has_avx512() || avx2_fma_supported(); }
bool prefill_attention_quantized_supported() { return cpu_has_avx512(); }

// q [T, H, D]; k, v [T, KVH, D] (this step's rows; each may have a row stride, e.g. views of a fused QKV output,
// but heads and dimensions contiguous); k_cache, v_cache [NB, BS, KVH, D] contiguous, fp32/bf16/fp16 or int8 with
// k_scales, v_scales [NB, BS, KVH] fp32, or int4 (uint8 [NB, BS, KVH, D / 2], two codes a byte, as write_kv_int4 stores
// them) with k_scales, v_scales [NB, BS, KVH, 2] fp16 (scale, zero); spans [S, 4] int64 (q_start, q_len, num_cached,
// slot offset into slots);
// slots: the spans' context slots concatenated. Writes the spans' rows of out [T, H, D] (q's dtype, contiguous).
// window <= 0: none. path: 1 runs the scores with vdpbf16ps where q and the keys are bf16 (needs AVX512-BF16); 2 both
// products on AMX tiles where q and the cache are bf16 and head_dim a multiple of 32 (needs AMX-BF16); other dtypes
// and 0 run fp32 FMAs.
void prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                       at::Tensor v_cache, c10::optional<at::Tensor> k_scales,
                       c10::optional<at::Tensor> v_scales, at::Tensor spans, at::Tensor slots, double scale,
                       int64_t window, at::Tensor out, int64_t path) {
  TORCH_CHECK(prefill_attention_supported(), "prefill_attention needs a CPU with AVX-512, or AVX2 and FMA");
  TORCH_CHECK(path != 1 || cpu_has_avx512_bf16(), "prefill_attention: path 1 (dot) needs a CPU with AVX512-BF16");
  TORCH_CHECK(path != 2 || (amx_bf16_supported() && cpu_has_avx512_bf16()),
              "prefill_attention: path 2 (amx) needs a CPU with AMX-BF16 and the OS's permission");
  TORCH_CHECK(path >= 0 && path <= 2, "prefill_attention: path 0 (fp32), 1 (dot) or 2 (amx), got ", path);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && out.sizes() == q.sizes(),
              "prefill_attention: q/out [T, H, D], k/v [T, KVH, D], caches [NB, BS, KVH, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "prefill_attention is CPU only");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const bool int4 = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(D % 16 == 0 && k.size(2) == D && k_cache.size(3) == (int4 ? D / 2 : D) && k_cache.size(2) == KVH &&
                  H % KVH == 0 && k.size(0) == T,
              "prefill_attention: head_dim a multiple of 16 (int4 caches: head_dim / 2 bytes a row), heads a multiple "
              "of kv_heads");
  for (const auto* t : {&q, &k, &v, &out})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D && t->scalar_type() == q.scalar_type(),
                "prefill_attention: q, k, v, out of one dtype, heads and dimensions contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "prefill_attention: contiguous caches of one dtype");
  const bool quantized = k_cache.scalar_type() == at::kChar || int4;
  TORCH_CHECK(!quantized || prefill_attention_quantized_supported(),
              "prefill_attention: an int8 or int4 cache needs a CPU with AVX-512");
  TORCH_CHECK(quantized == (k_scales.has_value() && v_scales.has_value()),
              "k_scales and v_scales are given exactly when the cache is int8 or int4");
  if (quantized)
    for (const auto& sc : {*k_scales, *v_scales})
      TORCH_CHECK(sc.scalar_type() == (int4 ? at::kHalf : at::kFloat) && sc.is_contiguous() &&
                      sc.numel() == k_cache.size(0) * k_cache.size(1) * KVH * (int4 ? 2 : 1),
                  int4 ? "scales must be contiguous float16 [num_blocks, block_size, kv_heads, 2]"
                       : "scales must be contiguous float32 [num_blocks, block_size, kv_heads]");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 4 && spans.is_contiguous() &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "prefill_attention: spans int64 [S, 4], slots int64");
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t n_slots = k_cache.size(0) * k_cache.size(1);
  std::vector<Span> list;
  for (int64_t s = 0; s < spans.size(0); ++s) {
    const int64_t q_start = sp[s * 4], q_len = sp[s * 4 + 1], cached = sp[s * 4 + 2], offset = sp[s * 4 + 3];
    TORCH_CHECK(q_start >= 0 && q_len >= 0 && q_start + q_len <= T && cached >= 0 && offset >= 0 &&
                    offset + cached + q_len <= slots.numel(), "prefill_attention: span ", s, " out of range");
    const bool fresh = cached == 0 && (window <= 0 || q_len <= window);
    if (!fresh)
      for (int64_t j = 0; j < cached + q_len; ++j)
        TORCH_CHECK(sl[offset + j] >= 0 && sl[offset + j] < n_slots, "prefill_attention: slot out of range");
    list.push_back({q_start, q_len, cached, offset, !fresh});
  }
  const void* ks = quantized ? k_scales->data_ptr() : nullptr;
  const void* vs = quantized ? v_scales->data_ptr() : nullptr;
  dispatch_float(q.scalar_type(), "prefill_attention (q)", [&](auto q_tag) {
    using q_t = decltype(q_tag);
    if (int4)
      return prefill_impl<q_t, uint8_t>(q, k, v, k_cache, v_cache, ks, vs, list, sl, scale, window, path, out);
    if (quantized)
      return prefill_impl<q_t, int8_t>(q, k, v, k_cache, v_cache, ks, vs, list, sl, scale, window, path, out);
    dispatch_float(k_cache.scalar_type(), "prefill_attention (the cache; int8 or int4 above)", [&](auto c_tag) {
      prefill_impl<q_t, decltype(c_tag)>(q, k, v, k_cache, v_cache, ks, vs, list, sl, scale, window,
                                         path == 2 && D % 32 != 0 ? 1 : path, out);
    });
  });
}
