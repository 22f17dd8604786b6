// bf16 linears on AMX tiles (Intel Sapphire Rapids and later: AMX-TILE and AMX-BF16), over the very layout bf16_pack
// gives the fma and dot paths (packed_gemm.cpp): [N/16][K/2][16][2], where 16 column pairs of a block's 16 outputs are
// 16 rows of 64 bytes, which is what a B tile of tdpbf16ps holds. So the three paths share one copy of the weight, and
// which one runs is measured on the machine (bf16_gemm's path 2, llmserve/kernels/calibrate.py's "amx").
//
// y[M, N] = x[M, K] @ W^T (+ bias), x and y bf16, K a multiple of 32 (one tile's depth). A unit of work is up to 32 rows
// of x by 2 blocks of 16 outputs: 4 C tiles (tmm0-3, fp32 16 x 16), 2 A tiles (tmm4-5, 16 rows x 32 columns of x, read in
// place) and 2 B tiles (tmm6-7, 32 columns x 16 outputs of the weight). Each output is summed over k in tile order (32
// columns per tdpbf16ps, in order), whatever the other rows of the batch: a row's result does not depend on the batch
// (oneDNN's AMX matmul changes its blocking with M, and with it the sums: measured on a Xeon 6 207 here, row results of
// a 64-row batch differed from the same rows in a 512-row one).
//
// Why: on a 2-core Xeon with AMX (Intel family 6 model 207) the AVX-512 paths stay near 200 GFLOP/s on SmolLM2's shapes;
// torch's (oneDNN's) AMX matmul reached 860 on them, but its results depend on the batch and it cannot run inside the
// native decoder stack. These tiles, best of 7 against oneDNN (ms): 960x576 at 64 rows 0.034 / 0.058, at 512 rows
// 0.240 / 0.258 (2,355 GFLOP/s); 576x1536 at 512 rows 0.394 / 0.824; the 49152x576 LM head at 64 rows 6.7 / 4.8 (bound
// by reading the weight, where oneDNN streams it better).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"     // TileConfig, load_tile_config
#include "avx512_math.h"  // LLMSERVE_AVX512, storeu16, tail_mask16, bf16_pair
#include "kernels.h"
#include "work_queue.h"   // parallel_units

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <functional>
#include <vector>

#define LLMSERVE_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-bf16")))

namespace {

constexpr int64_t kBlockRows = 16;  // outputs per packed block (bf16_pack)
constexpr int64_t kTileK = 32;      // columns of x per tile
constexpr int64_t kUnitRows = 32;   // rows of x per unit (two A tiles)
constexpr int64_t kChunkRows = 256;  // rows of x per work item: a pair of blocks' weights (K x 32 bf16) stays in L1/L2
                                     // while the chunk's units pass over it
constexpr int64_t kPairMajorChunks = 2;  // chunks of rows up to which work items go pair by pair (amx_gemm_blocks)
constexpr int64_t kGroupPairs = 8;  // block pairs per work item, at most (amx_gemm_blocks)
constexpr int64_t kPairOuterUnits = 4;  // row units of an item up to which it runs pair by pair (amx_gemm_blocks)

// Linux keeps AMX's 8 KB tile state off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

constexpr int kAmxBf16Bit = 22;  // CPUID.(EAX=7, ECX=0):EDX
constexpr int kAmxTileBit = 24;
constexpr int kAmxInt8Bit = 25;

// Whether the CPU has AMX-TILE and the AMX feature at EDX bit `feature` of CPUID leaf 7, and the OS saves the tile
// state (XCR0's XTILECFG, bit 17, and XTILEDATA, bit 18).
bool cpuid_amx(int feature) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  if (!((d >> kAmxTileBit) & 1) || !((d >> feature) & 1)) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((lo >> 17) & 3) == 3;
}

bool request_tile_data() {
  unsigned long mask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) == 0 && ((mask >> kXfeatureXtiledata) & 1)) return true;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The tile configuration of a unit of `r0` + `r1` rows (r0 <= 16 in A0/C0/C1, r1 <= 16 in A1/C2/C3).
class Tiles {
 public:
  LLMSERVE_AMX void configure(int r0, int r1) {
    if (r0 == r0_ && r1 == r1_) return;
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(r0);
    c.rows[2] = c.rows[3] = c.rows[5] = static_cast<uint8_t>(r1);
    if (r1 == 0) c.colsb[2] = c.colsb[3] = c.colsb[5] = 0;
    c.rows[6] = c.rows[7] = 16;
    load_tile_config(c);
    r0_ = r0;
    r1_ = r1;
  }
  LLMSERVE_AMX ~Tiles() {
    if (r0_ >= 0) _tile_release();
  }

 private:
  int r0_ = -1, r1_ = -1;
};

// Weight blocks a unit asks for (into L2) while it runs: up to two blocks of `lines` cache lines each (null: none).
struct Ahead {
  const char* b0 = nullptr;
  const char* b1 = nullptr;
  int64_t lines = 0;
  int64_t step0 = 0, steps = 0;  // this unit's K steps are steps step0 .. step0 + kt - 1 of `steps` (0: kt)
};

// The epilogue of a finished unit (amx_store_pair over its C), run a slice of rows at a time while the next unit's tile
// products execute. The tiles run beside the vector units, so the stores, and above all the fused gate/up's SiLU
// (~60 vector operations per 16 outputs of a row), no longer leave the tiles idle between units. The same operations on
// the same values in another order: the bits do not change (tests/kernels/test_bf16_gemm.py).
// Measured on a 2-core Xeon with AMX (model 207, 2026-11-28), SmolLM2's gate/up (3072x576 with the SiLU), best of 21
// alternated in one process, after each unit / overlapped: 64 rows 0.268 / 0.185 ms, 512 rows 1.42 / 0.98, 2,048 rows
// 5.78 / 4.08 (oneDNN's plain matmul, no SiLU: 3.48). The other shapes, whose epilogue is only the stores: 0-8%.
class Epilogue {
 public:
  Epilogue(int64_t N, const float* bias, bool glu) : N_(N), ldy_(glu ? N / 2 : N), bias_(bias), glu_(glu) {}
  // the unit just stored in c: `rows` rows of pair p from row i of y (the previous unit's epilogue finished first)
  void set(const float* c, int64_t rows, int64_t p, at::BFloat16* y, int64_t i) {
    finish();
    c_ = c;
    rows_ = rows;
    p_ = p;
    y_ = y + i * ldy_;
    done_ = 0;
  }
  // step t of `steps`: the rows up to (t + 1) / steps of the unit's
  void slice(int64_t t, int64_t steps) {
    if (c_ == nullptr) return;
    const int64_t upto = rows_ * (t + 1) / steps;
    if (upto > done_) {
      amx_store_pair(c_ + done_ * 2 * kBlockRows, upto - done_, p_, N_, bias_, y_ + done_ * ldy_, glu_);
      done_ = upto;
    }
  }
  // the rows not yet stored (a thread's last unit, or before the next unit is set)
  void finish() {
    slice(0, 1);
    c_ = nullptr;
  }

 private:
  const int64_t N_, ldy_;  // outputs of the product, and of y (glu: N / 2) a row
  const float* bias_;
  const bool glu_;
  const float* c_ = nullptr;
  int64_t rows_ = 0, p_ = 0, done_ = 0;
  at::BFloat16* y_ = nullptr;
};

// One unit: C (fp32, 32 x 32, row stride 32) = rows [0, r0 + r1) of x (ldx bytes per row) times blocks w0 and w1 (w1
// only with TwoB), over K / 32 tiles of depth; the blocks of `ahead` prefetched spread over the K steps, and the previous
// unit's epilogue (`before`, on another C) run over them too.
template <bool TwoA, bool TwoB>
LLMSERVE_AMX void unit(const uint16_t* x, int64_t ldx, const uint16_t* w0, const uint16_t* w1, int64_t kt, float* c,
                       const Ahead& ahead, Epilogue& before) {
  _tile_zero(0);
  if (TwoB) _tile_zero(1);
  if (TwoA) {
    _tile_zero(2);
    if (TwoB) _tile_zero(3);
  }
  for (int64_t t = 0; t < kt; ++t) {
    const int64_t steps = ahead.steps > 0 ? ahead.steps : kt;
    ask_ahead(ahead.b0, ahead.lines, ahead.step0 + t, steps);
    ask_ahead(ahead.b1, ahead.lines, ahead.step0 + t, steps);
    _tile_loadd(4, x + t * kTileK, ldx);
    _tile_loadd(6, w0 + t * kTileK * kBlockRows, 64);
    if (TwoB) _tile_loadd(7, w1 + t * kTileK * kBlockRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TwoB) _tile_dpbf16ps(1, 4, 7);
    if (TwoA) {
      _tile_loadd(5, x + 16 * (ldx / 2) + t * kTileK, ldx);
      _tile_dpbf16ps(2, 5, 6);
      if (TwoB) _tile_dpbf16ps(3, 5, 7);
    }
    before.slice(t, kt);
  }
  constexpr int64_t ldc = 2 * kBlockRows * sizeof(float);
  _tile_stored(0, c, ldc);
  if (TwoB) _tile_stored(1, c + kBlockRows, ldc);
  if (TwoA) {
    _tile_stored(2, c + 16 * 2 * kBlockRows, ldc);
    if (TwoB) _tile_stored(3, c + 16 * 2 * kBlockRows + kBlockRows, ldc);
  }
}

// Row i of a unit's C (fp32, 32 a row: two blocks of 16 outputs) as v0, v1, plus the blocks' biases b0, b1 where the
// GEMM has a bias; bias_at(bias, n) is the bias of outputs n .. n + 15 (zero without one).
LLMSERVE_AVX512 inline __m512 bias_at(const float* bias, int64_t n) {
  return bias != nullptr ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
}
LLMSERVE_AVX512 inline void row_of(const float* c, int64_t i, const float* bias, __m512 b0, __m512 b1, __m512& v0,
                                   __m512& v1) {
  v0 = _mm512_loadu_ps(c + i * 2 * kBlockRows);
  v1 = _mm512_loadu_ps(c + i * 2 * kBlockRows + kBlockRows);
  if (bias != nullptr) {
    v0 = _mm512_add_ps(v0, b0);
    v1 = _mm512_add_ps(v1, b1);
  }
}

// Both blocks of a unit inside N, on a CPU with AVX512-BF16: each row's 32 outputs rounded at once by
// vcvtne2ps2bf16 (nearest even, as bf16_bits) and stored as one 64-byte line, where bf16_bits takes seven operations
// for 16 and a narrowing store. A row holding a denormal or NaN takes bf16_bits (bf16_pair, avx512_math.h), so the
// bits do not change (tests/kernels/test_bf16_gemm.py).
// Why: the tiles do not run beside the vector units here as hoped: SmolLM2's gate/up shape without the SiLU (3,072 x
// 576, 2,048 rows, 2 threads; 2-core Xeon with AMX, model 167, 2026-12-06) took 3.8-4.0 ms, 3.3-3.4 with its rows
// written to a few lines of scratch, 2.6 with no epilogue. In-process alternated, medians of 7: 960 x 576 at 2,048
// rows 1.22 -> 1.09 ms, 576 x 576 0.69 -> 0.64, 576 x 1,536 1.68 -> 1.54; at 64 rows 0.049 -> 0.042, 0.033 -> 0.028,
// 0.065 -> 0.056. The fused gate/up's epilogue rounded the same way (three roundings a row around the SiLU) was no
// faster (2,048 rows 3.70 -> 3.77 ms, 512 rows 0.88 -> 0.93): the SiLU's own operations dominate it, and it stays.
LLMSERVE_AVX512BF16 void store_unit_lines(const float* c, int64_t rows, int64_t n0, int64_t N, const float* bias,
                                          at::BFloat16* y) {
  const __m512 b0 = bias_at(bias, n0), b1 = bias_at(bias, n0 + kBlockRows);
  for (int64_t i = 0; i < rows; ++i) {
    __m512 v0, v1;
    row_of(c, i, bias, b0, b1, v0, v1);
    _mm512_storeu_si512(y + i * N + n0, bf16_pair(v0, v1));
  }
}

// y[i0 : i0 + rows, n0 : n0 + 32] (columns below N) = C (+ bias), rounded to bf16.
LLMSERVE_AVX512 void store_unit(const float* c, int64_t rows, int64_t n0, int64_t N, const float* bias,
                                at::BFloat16* y) {
  if (n0 + 2 * kBlockRows <= N && cpu_has_avx512_bf16()) return store_unit_lines(c, rows, n0, N, bias, y);
  for (int j = 0; j < 2; ++j) {
    const int64_t n = n0 + j * kBlockRows;
    if (n >= N) break;
    const __mmask16 m = tail_mask16(N - n);
    const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + n) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      __m512 v = _mm512_loadu_ps(c + i * 2 * kBlockRows + j * kBlockRows);
      if (bias != nullptr) v = _mm512_add_ps(v, bv);
      storeu16(y + i * N + n, v, m);
    }
  }
}

// The fused gate/up epilogue: gate = C[:, 0:16] (+ bias), up = C[:, 16:32] (+ bias), each rounded to bf16 as the
// GEMM's output would be, then silu_mul's operations (silu16, rounded, times up): out[i0 : i0 + rows, n0 : n0 + 16] of
// y [M, I].
LLMSERVE_AVX512 void store_glu(const float* c, int64_t rows, int64_t n0, int64_t I, const float* bias,
                               at::BFloat16* y) {
  const __m512 bg = bias_at(bias, n0), bu = bias_at(bias, I + n0);
  for (int64_t i = 0; i < rows; ++i) {
    __m512 g, u;
    row_of(c, i, bias, bg, bu, g, u);
    const __m512 s = round_bf16(silu16(round_bf16(g)));
    storeu16(y + i * I + n0, _mm512_mul_ps(s, round_bf16(u)), __mmask16(0xFFFF));
  }
}

}  // namespace

bool amx_bf16_supported() {
  static const bool ok = cpu_has_avx512() && cpuid_amx(kAmxBf16Bit) && request_tile_data();
  return ok;
}

bool amx_int8_supported() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni") && cpuid_amx(kAmxInt8Bit) &&
                         request_tile_data();
  return ok;
}

// The epilogue of one unit: c's rows (fp32, 32 a row: pair p's two blocks of 16 outputs) plus bias, rounded to bf16,
// into y's rows (y: the unit's first row); glu: silu(gate) * up.
void amx_store_pair(const float* c, int64_t rows, int64_t p, int64_t N, const float* bias, at::BFloat16* y, bool glu) {
  if (glu) store_glu(c, rows, p * kBlockRows, N / 2, bias, y);
  else store_unit(c, rows, 2 * p * kBlockRows, N, bias, y);
}

// x [M, K] bf16 contiguous, K % 32 == 0; packed: bf16_pack of W [N, K]; bias fp32 [N] or nullptr -> [M, N] bf16.
at::Tensor bf16_gemm_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                         bool glu) {
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t be = x.size(1) * kBlockRows;
  return amx_gemm_blocks(x, packed.size(0), N, bias, [&](int64_t b, uint16_t*) { return wp + b * be; }, glu, wp);
}

// The driver: weight blocks of 16 outputs in bf16_pack's layout come from block(b, scratch) (a pointer to the block,
// or to scratch, K * 16 bf16, which it may fill); see kernels.h.
at::Tensor amx_gemm_blocks(const at::Tensor& x, int64_t NB, int64_t N, const float* bias,
                           const std::function<const uint16_t*(int64_t, uint16_t*)>& block, bool glu,
                           const uint16_t* plain) {
  TORCH_CHECK(amx_bf16_supported(), "bf16_gemm: the amx path needs a CPU with AMX-BF16 (and the OS's permission)");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kTileK == 0, "bf16_gemm: the amx path needs K a multiple of 32, got ", K);
  TORCH_CHECK(!glu || (N % (2 * kBlockRows) == 0 && NB == N / kBlockRows),
              "the fused gate/up needs 2 I outputs, I a multiple of 16");
  // glu: the pairs are (gate block p, up block p + NB / 2), and y is silu(gate) * up, [M, N / 2]
  auto y = at::empty({M, glu ? N / 2 : N}, x.options());
  if (M == 0) return y;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t kt = K / kTileK, ldx = K * 2;
  const int64_t pairs = glu ? NB / 2 : (NB + 1) / 2, chunks = (M + kChunkRows - 1) / kChunkRows;
  // Work items: (group of block pairs, chunk of rows); within one, unit by unit (32 rows), every pair of the group.
  // - Up to kPairMajorChunks chunks, a group's chunks are consecutive, so its weights are reused from cache and each
  //   thread reads half of them. With more rows, x no longer fits in L2 and was read again for every pair (2,048 rows:
  //   576x576 at 553 GFLOP/s against 754 at 512 rows), so a chunk's groups are consecutive instead: its rows stay in
  //   L2 while the weights go past.
  // - Groups, not single pairs, because of the stores: a unit writes 32 rows of y, N * 2 bytes apart, so with one pair
  //   an item's 8 units touched 256 rows' pages before coming back to the first: past ~2,000 outputs (rows 4 KB and
  //   more apart) one 4 KB page each, beyond the first-level TLB. The time per output column at 2,000 rows rose with
  //   N, 1.10 us at N = 384 to 1.66 at 3,072, where oneDNN's stayed at ~1.0. A group of up to 8 pairs writes 512 bytes
  //   of each row before moving on; its weights (8 pairs, K x 256 bf16) stay in L2.
  // - The order changes no result: each output is still summed over k in tile order.
  const bool pair_major = chunks <= kPairMajorChunks;
  const int64_t threads = at::get_num_threads();
  const int64_t group = std::clamp<int64_t>(pairs * chunks / (4 * threads), 1, kGroupPairs);
  const int64_t groups = (pairs + group - 1) / group;
  // Runs of the work queue: pair-major, a group's chunks (they share its weights); chunk-major, item by item. Whole
  // chunks as runs (their rows of x shared) were coarser than the queue needs: SmolLM2's 30 decoders' four linears
  // over 2,000 rows on the blocks, in-process alternated (Xeon with AMX), medians 554-528 ms item by item against
  // 614-618 a chunk a run and 735-827 in equal shares; 64-1,000 rows alike.
  // Weights that block() makes (plain null: a block-quantized weight's tiles dequantized as they are read, the
  // blocks_amx kernel), with more chunks than pair-major runs: each group's blocks are made once a call, by the first
  // item that needs them, into a buffer every later chunk reads, rather than once per item (chunk-major, every chunk
  // made every group's again: at 2,048 rows eight times). A thread that needs a group another is making waits for it
  // (made_state: 0 not yet, 1 being made, 2 ready); the same values either way, so the same bits. The buffer is the
  // whole weight in bf16 for the call (an LM head of 49,152 x 576: 57 MB, freed on return; only past 512 rows).
  // Pair-major, a thread's run is one group's chunks, so it keeps the group's blocks from one item to the next
  // (w_group). SmolLM2's four decoder linears on blocks_amx (Q4_1, hot), 2-core Xeon with AMX (model 167, 2026-12-06),
  // processes alternated, medians of 7, before / after (with store_unit_lines, worth ~4% of it): 2,048 rows 8.6-9.2 /
  // 7.3-7.6 ms, 1,024 rows 4.4-4.9 / 3.8-4.3, 512 rows 2.2 / 1.8, 300 rows 1.5-1.6 / 1.2.
  // pair p's two blocks (glu: gate block p and up block p + NB / 2); the second is past NB where NB is odd
  auto pair_blocks = [&](int64_t p) {
    return std::array<int64_t, 2>{glu ? p : 2 * p, glu ? p + NB / 2 : 2 * p + 1};
  };
  const bool made_once = plain == nullptr && !pair_major;
  std::unique_ptr<uint16_t[]> made;  // (not zeroed: block() writes every block an item reads)
  std::unique_ptr<std::atomic<int>[]> made_state;
  std::vector<const uint16_t*> made_at;
  if (made_once) {
    made.reset(new uint16_t[NB * K * kBlockRows]);
    made_state.reset(new std::atomic<int>[groups]);
    for (int64_t g = 0; g < groups; ++g) made_state[g].store(0, std::memory_order_relaxed);
    made_at.assign(NB, nullptr);
  }
  parallel_units(groups * chunks, pair_major ? chunks : 1, [&](WorkCursor& cursor) {
    Tiles tiles;
    alignas(64) float c[2][kUnitRows * 2 * kBlockRows];  // the unit's C and the previous one's, still being stored
    int cur = 0;
    Epilogue pending(N, bias, glu);
    std::vector<uint16_t> scratch(made_once ? 0 : group * 2 * K * kBlockRows);
    const uint16_t* w[2 * kGroupPairs];
    int64_t w_group = -1;  // the group whose blocks w holds
    for (; cursor.valid(); cursor.advance()) {
      const int64_t u = cursor.unit(), next_u = cursor.upcoming();
      const int64_t g = pair_major ? u / chunks : u % groups, chunk = pair_major ? u % chunks : u / groups;
      const int64_t m0 = chunk * kChunkRows, m1 = std::min(M, m0 + kChunkRows);
      // the group's pairs p0 .. p1: w[2 (p - p0)], w[2 (p - p0) + 1] their blocks (the second null past NB)
      const int64_t p0 = g * group, p1 = std::min(pairs, p0 + group);
      if (made_once) {
        if (made_state[g].load(std::memory_order_acquire) != 2) {
          int expected = 0;
          if (made_state[g].compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
            for (int64_t p = p0; p < p1; ++p)
              for (const int64_t b : pair_blocks(p))
                if (b < NB) made_at[b] = block(b, made.get() + b * K * kBlockRows);
            made_state[g].store(2, std::memory_order_release);
          } else {
            while (made_state[g].load(std::memory_order_acquire) != 2) _mm_pause();
          }
        }
        for (int64_t p = p0; p < p1; ++p) {
          const auto [first, second] = pair_blocks(p);
          w[2 * (p - p0)] = made_at[first];
          w[2 * (p - p0) + 1] = second < NB ? made_at[second] : nullptr;
        }
      } else if (g != w_group) {  // (pair-major: a group's chunks come one after the other, the blocks made once)
        w_group = g;
        for (int64_t p = p0; p < p1; ++p) {
          const auto [first, second] = pair_blocks(p);
          uint16_t* at = scratch.data() + 2 * (p - p0) * K * kBlockRows;
          w[2 * (p - p0)] = block(first, at);
          w[2 * (p - p0) + 1] = second < NB ? block(second, at + K * kBlockRows) : nullptr;
        }
      }
      // One unit: rows [i, i + 32) by pair p, the pair's unit `order`-th of `units` (-1: it asks for nothing); `ahead`
      // asks for the pair read next (a weight packed whole), spread over those units' K steps.
      auto run_unit = [&](int64_t i, int64_t p, int64_t order, int64_t units) {
        const int64_t rows = std::min(kUnitRows, m1 - i);
        const int r0 = static_cast<int>(std::min<int64_t>(16, rows)), r1 = static_cast<int>(rows - r0);
        tiles.configure(r0, r1);
        const uint16_t* xi = xs + i * K;
        const uint16_t *w0 = w[2 * (p - p0)], *w1 = w[2 * (p - p0) + 1];
        const bool two_b = w1 != nullptr;
        if (!two_b) w1 = w0;
        // The hardware prefetchers cannot guess the pair read next: blocks of 16 outputs are contiguous, but a
        // pair's two streams start anew in another page. Measured over SmolLM2-135M's 90 bf16 decoder linears on the
        // tiles, cold, in-process alternated (2-core Xeon with AMX, model 207, 2026-11-27), ms: 8 rows 14.5 / 15.8
        // without, 32 rows 17.0 / 20.6, 64 rows 26.7 / 30.0, 128 rows 48.4 / 50.8, 512 rows 162 / 164; two pairs
        // ahead was no better, four worse.
        Ahead ahead;
        if (plain != nullptr && order >= 0) {
          int64_t np = p + 1;
          if (np == p1 && next_u >= 0) np = (pair_major ? next_u / chunks : next_u % groups) * group;
          if (np < pairs) {
            const auto [first, second] = pair_blocks(np);
            ahead = {reinterpret_cast<const char*>(plain + first * K * kBlockRows),
                     second < NB ? reinterpret_cast<const char*>(plain + second * K * kBlockRows) : nullptr,
                     K * kBlockRows * 2 / 64, order * kt, units * kt};
          }
        }
        float* ci = c[cur];
        if (r1 > 0 && two_b) unit<true, true>(xi, ldx, w0, w1, kt, ci, ahead, pending);
        else if (r1 > 0) unit<true, false>(xi, ldx, w0, w1, kt, ci, ahead, pending);
        else if (two_b) unit<false, true>(xi, ldx, w0, w1, kt, ci, ahead, pending);
        else unit<false, false>(xi, ldx, w0, w1, kt, ci, ahead, pending);
        pending.set(ci, rows, p, yp, i);
        cur ^= 1;
      };
      const int64_t units = (m1 - m0 + kUnitRows - 1) / kUnitRows;
      if (units <= kPairOuterUnits) {
        // few row units (decode batches): pair by pair, each pair's units together, so the next pair's prefetch
        // spreads over all of them rather than over the first unit alone, where it waited on memory while the
        // others' products ran on weights already in L2. SmolLM2-135M's 120 decoder linears (random bf16 weights,
        // read from memory), medians of 7, alternated, 2-core Xeon with AMX (model 167, 2026-12-03): 64 rows 15.65 /
        // 15.75 ms against 17.02 / 17.45 unit by unit, 128 rows 20.3 / 21.0 against 22.4 / 22.9; 16 and 32 rows (one
        // unit) alike
        // (every other pair takes its units in reverse, so a partial last unit costs one tile reconfiguration a
        // pair, not two)
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t s = 0; s < units; ++s)
            run_unit(m0 + ((p - p0) % 2 ? units - 1 - s : s) * kUnitRows, p, s, units);
      } else {
        // unit by unit, every pair of the group: the unit's rows of x stay in L1 while the group's weights go past
        for (int64_t i = m0; i < m1; i += kUnitRows)
          for (int64_t p = p0; p < p1; ++p) run_unit(i, p, i == m0 ? 0 : -1, 1);
      }
    }
    pending.finish();
  });
  return y;
}
