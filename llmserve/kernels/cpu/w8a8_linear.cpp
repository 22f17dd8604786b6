// W8A8 linear on CPU: int8 weights (one symmetric fp32 scale per output row) times int8 activations
// quantized per row of x on the fly (asymmetric: a scale and an integer zero point per row):
//
//   x[i, :] ~= s[i] * (xq[i, :] - zp[i])           xq, zp integers in [-128, 127]
//   y[i, n]  = float(acc[i, n] - zp[i] * wsum[n]) * (s[i] * w_scale[n]) (+ bias[n])
//   acc      = xq @ Wq^T (int32, exact),  wsum[n] = sum_k Wq[n, k]
//
// Why: on a CPU with AVX512-VNNI and no AMX, int8 products run at ~4x the rate of bf16 ones (vpdpbusd: 64
// pairs per instruction at twice vdpbf16ps's rate); SmolLM2's linears took 5x less time than bf16 at 64 rows.
//
// The product is this file's own GEMM over a weight packed once at load (w8a8_pack): per block of 16 output
// rows, groups of 4 columns, [N/16][K/4][16][4] bytes. One 64-byte load then holds 4 columns of 16 outputs,
// vpdpbusd multiplies it by 4 bytes of one row of x broadcast to every lane, and the 16 int32 sums land in the
// lanes they belong to: no horizontal reduction, and every block is one contiguous stream, which the hardware
// prefetchers follow (the plain [N, K] rows of SmolLM2 are 576-1,536 bytes, and they stop at each row end).
// A register tile is 6 rows of x by 4 blocks (24 accumulators). x is stored unsigned (xq + 128, as
// vpdpbusd multiplies unsigned by signed bytes) and 128 * wsum comes off again with the zero point.
// Measured over SmolLM2's 30 decoders' linears (2-core AVX512-VNNI Xeon, interleaved, quantize and rescale
// included) against the former path (a matrix-vector kernel on the plain rows up to 8 rows, torch._int_mm
// beyond): M = 1: 4.2-4.7 ms vs 4.4-5.3; M = 8: 6.5-7.3 vs 8.6-10.4; M = 16: 8.0-9.5 vs 13.3-15.1; M = 36:
// 12.0-14.2 vs 18.0-20.9; M = 64: 17.7-19.9 vs 23.7-27.9; M = 256: 57-74 vs 67-70; M = 1,024: 217 vs 246-248.
//
// The int32 products are exact whichever tile computes them, so a row's result does not depend on the
// batch around it. Asymmetric per-row activations keep SmolLM2-135M's perplexity within 0.4% of fp32 where
// symmetric ones lose 4% (the inputs of down_proj and of the q/k/v projection are far from centred).
// Rounding is round-half-to-even on x * (1 / s) in fp32, and the rescale is evaluated in the order written
// above without fused multiply-adds, so torch ops in the same order give bit-identical results (the tests
// compare with torch._int_mm that way).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"     // TileConfig, load_tile_config
#include "avx512_math.h"  // LLMSERVE_AVX512, masked loads and stores
#include "float_types.h"  // dispatch_float
#include "kernels.h"      // amx_int8_supported

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#define LLMSERVE_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define LLMSERVE_AMX8 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))

namespace {

constexpr int64_t kBlockRows = 16;   // output rows (columns of y) per packed block: one zmm of int32 sums
constexpr int kTileRows = 6;         // rows of x per register tile
constexpr int kTileBlocks = 4;       // packed blocks per register tile (6 x 4 accumulators, 4 weights, 1 x)
constexpr int64_t kChunkRows = 240;  // rows of x per work unit at most (for_each_tile_group)
// Tiles of one or two rows of x are bound by streaming the weights: they prefetch each block this far ahead (the
// hardware streamers stop at 4 KB pages). SmolLM2-135M's decoders at one row, best of 30: 2.6-2.7 ms against
// 2.8-3.0 without.
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kMaxColumns = (int64_t{1} << 31) / (255 * 127);  // 66311, see w8a8_linear
constexpr int64_t kSerialElems = 32768;  // below this many elements quantizing x runs on one thread
constexpr int64_t kAmxGroups = 16;       // groups of 4 columns a tile product takes (a 64-byte row of x)
constexpr int64_t kAmxUnitRows = 32;     // rows of x per AMX unit (two A tiles)
constexpr int64_t kAmxChunk = 256;       // rows of x per AMX work item at most
constexpr int64_t kAmxDefaultRows = 16;  // amx_rows < 0: the tiles from this many rows (calibration measures it)

// One row of x -> K4 unsigned bytes xq + 128 (the padding past K: 0), its scale and its zero point + 128.
// The range always includes 0, so 0 is exact.
template <typename T>
LLMSERVE_AVX512 void quantize_row(const T* x, int64_t K, int64_t K4, uint8_t* q, float* scale, int32_t* zpu) {
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask16(K - k);
    const __m512 v = loadu16(x + k, m);  // masked-off lanes read as 0, inside the range already
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  const float min = _mm512_reduce_min_ps(lo), max = _mm512_reduce_max_ps(hi);
  float s = (max - min) / 255.f;
  if (!(s > 0.f) || !std::isfinite(s)) s = 1.f;  // an all-zero row (or inf/NaN: garbage in, finite out)
  const float inv = 1.f / s;
  const int32_t zp = static_cast<int32_t>(std::nearbyint(-min * inv)) - 128;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i vzpu = _mm512_set1_epi32(zp + 128);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask16(K - k);
    // cvtps rounds half to even (the default MXCSR mode). Clamping xq to [-128, 127] and adding 128 is
    // clamping xq + 128 to [0, 255]: max with 0, then cvtusepi32 saturates at 255.
    const __m512i r = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(loadu16(x + k, m), vinv)), vzpu);
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtusepi32_epi8(_mm512_max_epi32(r, _mm512_setzero_si512())));
  }
  for (int64_t k = K; k < K4; ++k) q[k] = 0;  // meets zero weights; set only so that no garbage is read
  *scale = s;
  *zpu = zp + 128;
}

struct Rescale {
  const float* s;        // [M] activation scales
  const int32_t* zpu;    // [M] zero points + 128 (x is stored unsigned)
  const int32_t* wsum;   // [N]
  const float* w_scale;  // [N]
  const float* bias;     // [N] or null
};

// The rescale of one packed block's 16 outputs n .. n + 15 (those below N), for any row's int32 sums: both kernels
// (VNNI register tiles, AMX tiles) end in it, so their outputs are the same bits.
struct Outputs {
  int64_t n, N;
  __mmask16 m;
  __m512i ws;
  __m512 wsc, bv;
  LLMSERVE_AVX512 Outputs(const Rescale& e, int64_t n_, int64_t N_) : n(n_), N(N_), m(tail_mask16(N_ - n_)) {
    ws = _mm512_maskz_loadu_epi32(m, e.wsum + n);
    wsc = _mm512_maskz_loadu_ps(m, e.w_scale + n);
    bv = e.bias != nullptr ? _mm512_maskz_loadu_ps(m, e.bias + n) : _mm512_setzero_ps();
  }
  template <typename T>
  LLMSERVE_AVX512 void store(const Rescale& e, __m512i acc, int64_t row, T* y) const {
    // (xq + 128) . w - (zp + 128) * wsum = xq . w - zp * wsum: int32 wraps alike on both sides
    const __m512i c = _mm512_sub_epi32(acc, _mm512_mullo_epi32(_mm512_set1_epi32(e.zpu[row]), ws));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(_mm512_set1_ps(e.s[row]), wsc));
    if (e.bias != nullptr) v = _mm512_add_ps(v, bv);
    storeu16(y + row * N + n, v, m);
  }
};

// y[i0 : i0 + MR, n0 : n0 + NR * 16] (columns below N) for one register tile: MR rows of x (G groups of 4
// unsigned bytes each, ldx apart), NR packed blocks (G groups of [16 rows][4 bytes] each, block_bytes apart).
// no-tree-pre: with it GCC 12 stores all 24 accumulators to the stack on every iteration (measured 2x slower).
template <int MR, int NR, typename T>
LLMSERVE_VNNI __attribute__((optimize("no-tree-pre"))) void tile(const uint8_t* x, int64_t ldx, int64_t G,
                                                                const int8_t* w, int64_t block_bytes, int64_t i0,
                                                                int64_t n0, int64_t N, const Rescale& e, T* y) {
  __m512i acc[MR][NR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  const int32_t* xr[MR];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) xr[i] = reinterpret_cast<const int32_t*>(x + (i0 + i) * ldx);
  for (int64_t g = 0; g < G; ++g) {
    __m512i wv[NR];
    if (MR <= 2)
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * block_bytes + g * 64) + kPrefetchBytes, _MM_HINT_T0);
    _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w + j * block_bytes + g * 64);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {
      const __m512i b = _mm512_set1_epi32(xr[i][g]);
      _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], b, wv[j]);
    }
  }
  _Pragma("GCC unroll 8") for (int j = 0; j < NR; ++j) {
    const Outputs o(e, n0 + j * kBlockRows, N);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) o.store(e, acc[i][j], i0 + i, y);
  }
}

// ---- The same product on AMX-INT8 tiles (CPUs with AMX: Sapphire Rapids and later) ----
// A packed block's [G][16][4] bytes are, 16 groups at a time, the B operand of tdpbusd as stored (16 rows of 64 bytes:
// row g holds columns 4g .. 4g + 3 of the 16 outputs), and x's unsigned bytes (xq + 128, K4 a row) the A operand read
// in place: one tile product sums 64 columns of 16 rows by 16 outputs into int32, exactly as vpdpbusd does (the sums are
// exact: |sum| <= K * 255 * 128 < 2^31 for K <= kMaxColumns), so the int32 sums, and after Outputs' rescale y, are the
// VNNI kernel's bits: a batch may take either, and a request's result does not depend on its batch. Columns past the
// last whole 16 groups (K % 64) are summed by vpdpbusd into the stored tiles.
// Why: the VNNI register tile does ~1 vpdpbusd (64 products) per cycle and core; a tile product does 16,384 in ~16.
// On a 2-core Xeon with AMX (model 207, 2026-11-28), weights hot, best of 15 alternated in one process, VNNI / tiles:
// gate/up 3072x576 at 64 rows 0.223 / 0.080 ms, 512 rows 1.72 / 0.63, 2,048 rows 6.74 / 2.62 (our bf16 AMX GEMM: 0.167,
// 0.93, 4.14); over SmolLM2-135M's 30 decoders' linears read cold, 0.8-0.9x at 1-4 rows, 1.06x at 8, 1.4-1.7x from 16.
// From how many rows the tiles run is the measured choice of the running machine (amx_rows, llmserve/kernels/
// calibrate.py's measure_w8a8): at a few rows a tile is mostly padding.

// tmm0-3: C (rows i0 .. i0 + 15 by block 0, by block 1; rows i0 + 16 .. by block 0, by block 1), tmm4, tmm5: A
// (rows r0, r1), tmm6, tmm7: B (16 x 64 bytes). Configured for a unit's rows (r0 <= 16, r1 <= 16), released at the
// end of the thread's work.
class W8A8Tiles {
 public:
  LLMSERVE_AMX8 void configure(int r0, int r1) {
    if (r0 == r0_ && r1 == r1_) return;
    TileConfig c;
    for (int k = 0; k < 8; ++k) {
      const bool second = k == 2 || k == 3 || k == 5;  // the second 16 rows' C and A tiles
      c.rows[k] = static_cast<uint8_t>(k >= 6 ? kAmxGroups : second ? std::max(r1, 1) : r0);
      c.colsb[k] = 64;
    }
    load_tile_config(c);
    r0_ = r0, r1_ = r1;
  }
  LLMSERVE_AMX8 ~W8A8Tiles() {
    if (r0_ >= 0) _tile_release();
  }

 private:
  int r0_ = -1, r1_ = -1;
};

// A stored unit's epilogue (its int32 sums, the columns past the tiles by vpdpbusd, then Outputs' rescale), run a
// slice of rows after each K step of the next unit's tile products, which execute beside the vector units meanwhile.
// The same operations on the same values: the bits do not change. Over SmolLM2-135M's 30 decoders' linears (Xeon with
// AMX, model 207, cold, best of 7 alternated in one process): 3-15% faster than each unit's epilogue after its tiles
// (64 rows 19.0 -> 17.1 ms, 128 rows 32.9 -> 28.5).
template <typename T>
class W8A8Epilogue {
 public:
  W8A8Epilogue(const uint8_t* x, int64_t ldx, int64_t G, int64_t bb, int64_t N, const Rescale& e, T* y)
      : x_(x), ldx_(ldx), G_(G), GT_(G / kAmxGroups * kAmxGroups), bb_(bb), N_(N), e_(e), y_(y) {}
  // the unit just stored in c (row stride 32): rows i0 .. i0 + r by block n0 / 16 at w (and the next, with two)
  void set(const int32_t* c, int r, int64_t i0, const int8_t* w, int64_t n0, bool two) {
    finish();
    c_ = c, r_ = r, i0_ = i0, w_ = w, n0_ = n0, two_ = two, done_ = 0;
  }
  // step t of `steps`: the rows up to (t + 1) / steps of the unit's
  LLMSERVE_VNNI void slice(int64_t t, int64_t steps) {
    if (c_ == nullptr) return;
    const int upto = static_cast<int>(r_ * (t + 1) / steps);
    if (upto <= done_) return;
    _Pragma("GCC unroll 2") for (int j = 0; j < 2; ++j) {
      if (j == 1 && !two_) break;
      const Outputs o(e_, n0_ + j * kBlockRows, N_);
      const int8_t* wj = w_ + j * bb_;
      for (int i = done_; i < upto; ++i) {
        __m512i acc = _mm512_loadu_si512(c_ + i * 32 + j * 16);
        const int32_t* xr = reinterpret_cast<const int32_t*>(x_ + (i0_ + i) * ldx_);
        for (int64_t g = GT_; g < G_; ++g)
          acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(xr[g]), _mm512_loadu_si512(wj + g * 64));
        o.store(e_, acc, i0_ + i, y_);
      }
    }
    done_ = upto;
  }
  // the rows not yet stored (a thread's last unit, or before the next unit is set)
  void finish() {
    slice(0, 1);
    c_ = nullptr;
  }

 private:
  const uint8_t* x_;
  const int64_t ldx_, G_, GT_, bb_, N_;
  const Rescale& e_;
  T* y_;
  const int32_t* c_ = nullptr;
  int r_ = 0, done_ = 0;
  int64_t i0_ = 0, n0_ = 0;
  const int8_t* w_ = nullptr;
  bool two_ = false;
};

// One unit's tile products: C (int32, rows x 32, row stride 32) = rows x0 .. (16 more with R2) of x by block w (and the
// next, bb bytes on, with B2) over GT / 16 steps of 64 columns; `ahead_lines` cache lines at `ahead` asked for (into L2)
// over the steps, and the previous unit's epilogue (`before`) run over them too.
template <bool R2, bool B2, typename T>
LLMSERVE_AMX8 void unit_amx(const uint8_t* x0, int64_t ldx, int64_t GT, const int8_t* w, int64_t bb, int32_t* c,
                            const char* ahead, int64_t ahead_lines, int64_t step0, int64_t total,
                            W8A8Epilogue<T>& before) {
  const uint8_t* x1 = x0 + 16 * ldx;
  _tile_zero(0);
  if constexpr (B2) _tile_zero(1);
  if constexpr (R2) {
    _tile_zero(2);
    if constexpr (B2) _tile_zero(3);
  }
  const int64_t steps = GT / kAmxGroups;
  for (int64_t t = 0; t < steps; ++t) {
    const int64_t g = t * kAmxGroups;
    ask_ahead(ahead, ahead_lines, step0 + t, total);
    _tile_loadd(6, w + g * 64, 64);
    _tile_loadd(4, x0 + g * 4, ldx);
    _tile_dpbusd(0, 4, 6);
    if constexpr (B2) {
      _tile_loadd(7, w + bb + g * 64, 64);
      _tile_dpbusd(1, 4, 7);
    }
    if constexpr (R2) {
      _tile_loadd(5, x1 + g * 4, ldx);
      _tile_dpbusd(2, 5, 6);
      if constexpr (B2) _tile_dpbusd(3, 5, 7);
    }
    before.slice(t, steps);
  }
  constexpr int64_t ldc = 32 * sizeof(int32_t);
  _tile_stored(0, c, ldc);
  if constexpr (B2) _tile_stored(1, c + 16, ldc);
  if constexpr (R2) {
    _tile_stored(2, c + 16 * 32, ldc);
    if constexpr (B2) _tile_stored(3, c + 16 * 32 + 16, ldc);
  }
}

// The tiles over every row. Work items: (chunk of rows, pair of blocks), chunk-major, so a thread's items share its rows
// of x (in L2) and read each block pair once a chunk. A pair's units ask for the next pair's blocks (consecutive in
// memory) where the thread's next item takes them, spread over all of its units' steps: over SmolLM2's 30 decoders'
// linears read cold (Xeon with AMX, best of 9 alternated in one process), 2-10% faster than asking over the first unit
// only (64 rows 10.4 -> 9.7 ms, 256 rows 27.7 -> 25.5), and two pairs ahead was no better. The chunks are as even as
// whole units allow, at most kAmxChunk rows (320 rows as 256 + 64 left one thread a quarter of the work: 0.69 ms
// against 0.39 for 256 rows).
template <typename T>
void run_amx(const uint8_t* qp, int64_t ldx, int64_t G, const int8_t* wp, int64_t bb, int64_t M, int64_t NB, int64_t N,
             const Rescale& e, T* yp) {
  const int64_t pairs = (NB + 1) / 2, GT = G / kAmxGroups * kAmxGroups;
  const int64_t even = (M + (M + kAmxChunk - 1) / kAmxChunk - 1) / ((M + kAmxChunk - 1) / kAmxChunk);
  const int64_t rows = (even + kAmxUnitRows - 1) / kAmxUnitRows * kAmxUnitRows;  // a chunk's
  const int64_t chunks = (M + rows - 1) / rows;
  // runs of consecutive pairs of a chunk (its rows of x stay in L2; the next pair is the next in memory), ~4 a thread
  const int64_t run = std::max<int64_t>(1, chunks * pairs / (4 * at::get_num_threads()));
  parallel_units(chunks * pairs, run, [&](WorkCursor& cursor) {
    W8A8Tiles tiles;
    alignas(64) int32_t cbuf[2][32 * 32];
    W8A8Epilogue<T> epilogue(qp, ldx, G, bb, N, e, yp);
    int cur = 0;
    for (; cursor.valid(); cursor.advance()) {
      const int64_t u = cursor.unit(), c = u / pairs, b = u % pairs * 2;
      const int64_t m0 = c * rows, m1 = std::min(M, m0 + rows);
      const bool two = b + 1 < NB;
      const int8_t* w = wp + b * bb;
      // the pair this thread takes next (the next in memory within a run), asked for during this one's units
      const int64_t up = cursor.upcoming(), nb = up >= 0 ? up % pairs * 2 : NB;
      const int64_t next = nb < NB ? std::min<int64_t>(2, NB - nb) : 0;  // blocks asked for
      const int64_t units = (m1 - m0 + kAmxUnitRows - 1) / kAmxUnitRows, steps = GT / kAmxGroups;
      const int64_t n0 = b * kBlockRows;
      for (int64_t i = m0; i < m1; i += kAmxUnitRows) {
        const int r = static_cast<int>(std::min<int64_t>(kAmxUnitRows, m1 - i));
        tiles.configure(std::min(r, 16), std::max(r - 16, 0));
        int32_t* cb = cbuf[cur];
        cur ^= 1;
        const char* ahead = next > 0 ? reinterpret_cast<const char*>(wp + nb * bb) : nullptr;
        const int64_t lines = next * bb / 64, step0 = (i - m0) / kAmxUnitRows * steps, total = units * steps;
        const uint8_t* x0 = qp + i * ldx;
        if (r > 16) {
          if (two) unit_amx<true, true, T>(x0, ldx, GT, w, bb, cb, ahead, lines, step0, total, epilogue);
          else unit_amx<true, false, T>(x0, ldx, GT, w, bb, cb, ahead, lines, step0, total, epilogue);
        } else {
          if (two) unit_amx<false, true, T>(x0, ldx, GT, w, bb, cb, ahead, lines, step0, total, epilogue);
          else unit_amx<false, false, T>(x0, ldx, GT, w, bb, cb, ahead, lines, step0, total, epilogue);
        }
        epilogue.set(cb, r, i, w, n0, two);
      }
    }
    epilogue.finish();
  });
}

template <typename T>
at::Tensor w8a8_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                     const at::Tensor& wsum, const float* bias, int64_t amx_rows) {
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), G = packed.size(1), K4 = G * 4;
  const int64_t N = wsum.numel();
  auto xq = at::empty({M, K4}, x.options().dtype(at::kByte));
  auto s = at::empty({M}, x.options().dtype(at::kFloat));
  auto zpu = at::empty({M}, x.options().dtype(at::kInt));
  const T* xp = x.data_ptr<T>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  float* sp = s.data_ptr<float>();
  int32_t* zp = zpu.data_ptr<int32_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_row(xp + i * K, K, K4, qp + i * K4, sp + i, zp + i);
  });
  auto y = at::empty({M, N}, x.options());
  const Rescale e{sp, zp, wsum.data_ptr<int32_t>(), w_scale.data_ptr<float>(), bias};
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t bb = G * 64;  // bytes per packed block
  T* yp = y.data_ptr<T>();
  if (amx_rows < 0) amx_rows = kAmxDefaultRows;
  if (amx_rows > 0 && M >= amx_rows && G >= kAmxGroups && amx_int8_supported()) {
    run_amx<T>(qp, K4, G, wp, bb, M, NB, N, e, yp);
    return y;
  }
  for_each_tile<kTileRows, kTileBlocks>(M, NB, kChunkRows, [&](auto mr, auto nb, int64_t i, int64_t b) {
    tile<decltype(mr)::value, decltype(nb)::value, T>(qp, K4, G, wp + b * bb, bb, i, b * kBlockRows, N, e, yp);
  });
  return y;
}

}  // namespace

// Whole 16-element pieces of a row of quantize_rows_int8: IEEE division, rounding half to even, clamp; returns how far it
// got (a multiple of 16).
template <typename T>
LLMSERVE_AVX512 int64_t quantize_row16(const T* row, int64_t K, float s, int8_t* q) {
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(row + k), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)))));
  }
  return k;
}

// weight [N, K] (fp32, bf16 or fp16) -> (int8 [N, K], fp32 scales [N]): each row symmetric, its max |w| -> 127, as
// llmserve.layers.linear.quantize_rows does in torch (the same fp32 operations, rounding half to even), so the bytes
// are the same; one pass instead of six over the weight (SmolLM2-135M's linears and LM head: ~0.5 s of a w8a8 start).
std::vector<at::Tensor> quantize_rows_int8(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "quantize_rows_int8: weight must be [N, K] on the CPU");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  auto q = at::empty({N, K}, w.options().dtype(at::kChar));
  auto scale = at::empty({N}, w.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  dispatch_float(w.scalar_type(), "quantize_rows_int8", [&](auto tag) {
    using T = decltype(tag);
    const T* wp = w.data_ptr<T>();
    at::parallel_for(0, N, std::max<int64_t>(1, kSerialElems / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const T* row = wp + n * K;
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(row[k])));
        const float s = std::max(amax, 1e-12f) / 127.0f;
        sp[n] = s;
        int64_t k = 0;
        if constexpr (!std::is_same_v<T, c10::Half>) {
          if (cpu_has_avx512()) k = quantize_row16(row, K, s, qp + n * K);  // the same operations, 16 at a time
        }
        for (; k < K; ++k) {
          const float v = std::nearbyint(static_cast<float>(row[k]) / s);
          qp[n * K + k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        }
      }
    });
  });
  return {q, scale};
}

bool w8a8_linear_supported() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// qweight [N, K] int8 -> [ceil(N / 16), ceil(K / 4), 16, 4] int8: for each block of 16 output rows, the
// columns in groups of 4, each group holding its 4 bytes of the 16 rows; zero past N and K.
at::Tensor w8a8_pack(at::Tensor qweight) {
  return pack_weight_blocks<int8_t>(qweight, at::kChar, 4, "w8a8_pack: qweight must be int8 [N, K] on the CPU");
}

// x [M, K] fp32 or bf16; packed: w8a8_pack of the int8 weight [N, K]; w_scale [N] fp32; wsum [N] int32 (row
// sums of the int8 weight); bias [N] (any float dtype) or None. Returns [M, N] in x's dtype. amx_rows: batches of at
// least this many rows run on AMX-INT8 tiles where the CPU has them and K >= 64 (the same bits as VNNI); 0: never;
// < 0: kAmxDefaultRows.
at::Tensor w8a8_linear(at::Tensor x, at::Tensor packed, at::Tensor w_scale, at::Tensor wsum,
                       c10::optional<at::Tensor> bias, int64_t amx_rows) {
  TORCH_CHECK(w8a8_linear_supported(), "w8a8_linear needs a CPU with AVX-512 (F, BW, VL, DQ) and VNNI");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "w8a8_linear: x must be [M, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w8a8_linear: x fp32 or bf16");
  const int64_t K = x.size(1), N = wsum.numel();
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kBlockRows && packed.size(3) == 4,
              "w8a8_linear: packed must be w8a8_pack's contiguous int8 [N / 16, K / 4, 16, 4]");
  TORCH_CHECK(packed.size(0) == (N + kBlockRows - 1) / kBlockRows && packed.size(1) == (K + 3) / 4,
              "w8a8_linear: packed weight ", packed.sizes(), " does not fit x's ", K, " columns and wsum's ", N,
              " rows");
  // acc - zp * wsum = sum_k (xq - zp) * w with 0 <= xq - zp <= 255, |w| <= 127: int32 holds it for K <= 66311.
  TORCH_CHECK(K <= kMaxColumns, "w8a8_linear: rows of at most ", kMaxColumns, " columns (int32 sums); got ", K,
              ": quantize this model with int8 (weight-only) instead of w8a8");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && w_scale.is_contiguous(),
              "w8a8_linear: w_scale must be contiguous fp32 [N]");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous(), "w8a8_linear: wsum must be contiguous int32 [N]");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "w8a8_linear: bias [N]");
  }
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const auto xc = x.contiguous();
  if (xc.scalar_type() == at::kBFloat16) return w8a8_impl<at::BFloat16>(xc, packed, w_scale, wsum, bp, amx_rows);
  return w8a8_impl<float>(xc, packed, w_scale, wsum, bp, amx_rows);
}
