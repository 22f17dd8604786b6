// Linear layers over block-quantized weights (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K, AWQ, GPTQ) kept at their bit width:
//
//   w[n, k] = d[n, g] * q[n, k] + m[n, g]       q: unsigned 4- or 8-bit codes, g = k / group (group % 32 == 0)
//   m = mins[n, g], or -zero * d[n, g] where the format has one integer zero point for every group (Q4_0: 8, Q8_0:
//   128; the products are exact in fp32, so the values are the format's own)
//
// The layout (llmserve/layers/quant_blocks.py packs it at load): per tile of 16 output rows and block of 32 columns,
// 256 bytes of 4-bit codes (512 of 8-bit) in the order vpdpbusd reads: 64-byte vector v holds, in lane r's 4 bytes,
// row r's columns 4v .. 4v + 3 (4-bit: vector h's low nibbles are vector 2h, its high nibbles 2h + 1); tiles are
// consecutive in k, so one tile is one stream. scales / mins: [tiles, K / group, 16], fp16 or fp32.
//
// The product: each row of x is quantized per block of 32 to int8 with its own scale (max |x| / 127, as llama.cpp
// quantizes activations for its Q8 dot products) and the block's sums are exact int32 (vpdpbusd: the codes are the
// unsigned operand, x the signed one):
//
//   y[i, n] = sum_b dx[i, b] * (d[n, g] * sum_k q[n, k] xq[i, k] + m[n, g] * sum_k xq[i, k])
//
// summed over blocks b in order with fused multiply-adds, the same operations whatever the tile: a row's result does
// not depend on the rows batched with it. Why int8 activations: measured against fp32 FMAs on the unpacked codes
// (the same layout, x in fp32: qblock_linear(..., vnni=0)) over SmolLM2-135M's Q4_1-shaped decoder linears (30 layers,
// bf16 x, 2-core AMD EPYC Zen 5, best of 20, a busy machine): M = 1: 1.66 ms vs 2.18 ms; M = 64: 15.4 ms vs 54.2 ms
// (w8a8_linear over int8 weights: 2.31 and 9.9 ms). The FMA path stays for AVX-512 CPUs without VNNI.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "avx512_math.h"  // LLMSERVE_AVX512, masked loads and stores, for_each_tile
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#define LLMSERVE_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

namespace {

constexpr int64_t kTileRows = 16;     // outputs per tile: one zmm of sums
constexpr int64_t kBlock = 32;        // columns per activation block
constexpr int kMaxRows = 4;           // rows of x per register tile
constexpr int kMaxTiles = 3;          // weight tiles per register tile (4 x 3 accumulators, 8 codes, d, m)
constexpr int64_t kChunkRows = 240;   // rows of x per work unit at most (for_each_tile_group)
constexpr int64_t kPrefetchBytes = 1024;  // one- and two-row tiles stream the codes: prefetch this far ahead
constexpr int64_t kSerialElems = 32768;   // below this many elements quantizing x runs on one thread

struct Weight {
  const uint8_t* codes;
  const void* scales;  // float or c10::Half [NT, KG, 16]
  const void* mins;    // the same, or null: m = -zero * d
  int64_t KB, KG, blocks_per_group, bytes, zero;
};

// Quantized activations: xq [M, K] int8, per block of 32: dx (scale) and sx (sum of xq, as float) [M, KB].
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

// The 8 vectors of one (tile, block): vector v = lane r's columns 4v .. 4v + 3 as unsigned bytes.
template <int BITS>
LLMSERVE_AVX512 inline void unpack_codes(const uint8_t* c, __m512i* v) {
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    _Pragma("GCC unroll 4") for (int h = 0; h < 4; ++h) {
      const __m512i raw = _mm512_loadu_si512(c + 64 * h);
      v[2 * h] = _mm512_and_si512(raw, low);
      v[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
  } else {
    _Pragma("GCC unroll 8") for (int h = 0; h < 8; ++h) v[h] = _mm512_loadu_si512(c + 64 * h);
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
// the same): one chain of 8 waits on vpdpbusd's latency (over SmolLM2's decoder linears at 64 rows, 2-core Zen 5, a
// noisy VM: 1.03-1.18x bf16's dot tile with two chains against 1.08-1.09x with one; four chains spill).
template <int MR, int NR, int BITS, typename S, typename T>
LLMSERVE_VNNI __attribute__((optimize("no-tree-pre"))) void tile_vnni(const Act& a, const Weight& w, int64_t i0,
                                                                      int64_t t0, int64_t N, const float* bias, T* y) {
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b / w.blocks_per_group;
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
      const uint8_t* c = w.codes + ((t0 + j) * a.KB + b) * w.bytes;
      if (MR <= 2)
        for (int64_t off = 0; off < w.bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(c + off + kPrefetchBytes), _MM_HINT_T0);
      __m512i v[8];
      unpack_codes<BITS>(c, v);
      __m512 d, m;
      group_scales<S>(w, t0 + j, g, d, m);
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
        const int64_t row = i0 + i;
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + row * a.K + b * kBlock);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        dpbusd_bcast<0>(s0, v[0], xq), dpbusd_bcast<1>(s1, v[1], xq), dpbusd_bcast<2>(s0, v[2], xq);
        dpbusd_bcast<3>(s1, v[3], xq), dpbusd_bcast<4>(s0, v[4], xq), dpbusd_bcast<5>(s1, v[5], xq);
        dpbusd_bcast<6>(s0, v[6], xq), dpbusd_bcast<7>(s1, v[7], xq);
        const __m512i s = _mm512_add_epi32(s0, s1);
        const __m512 t = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx[row * a.KB + b]), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
        acc[i][j] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.dx[row * a.KB + b]), acc[i][j]);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
      store_rows(y, N, i0 + i, (t0 + j) * kTileRows, acc[i][j], bias);
}

// The same product with x in fp32 and fp32 FMAs on the widened codes (AVX-512 without VNNI). xf: [M, K] fp32; a.sx:
// the blocks' sums of x.
template <int MR, int NR, int BITS, typename S, typename T>
LLMSERVE_AVX512 __attribute__((optimize("no-tree-pre"))) void tile_fma(const float* xf, const Act& a, const Weight& w,
                                                                      int64_t i0, int64_t t0, int64_t N,
                                                                      const float* bias, T* y) {
  __m512 acc[MR][NR];
  _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int64_t b = 0; b < a.KB; ++b) {
    const int64_t g = b / w.blocks_per_group;
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
      __m512i v[8];
      unpack_codes<BITS>(w.codes + ((t0 + j) * a.KB + b) * w.bytes, v);
      __m512 d, m;
      group_scales<S>(w, t0 + j, g, d, m);
      __m512 s[MR];
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) s[i] = _mm512_setzero_ps();
      _Pragma("GCC unroll 8") for (int k = 0; k < 8; ++k)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[k], 8 * c), byte));
          _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
            s[i] = _mm512_fmadd_ps(q, _mm512_set1_ps(xf[(i0 + i) * a.K + b * kBlock + 4 * k + c]), s[i]);
        }
      _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i) {
        const __m512 t = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sx[(i0 + i) * a.KB + b]), _mm512_mul_ps(d, s[i]));
        acc[i][j] = _mm512_add_ps(acc[i][j], t);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j)
    _Pragma("GCC unroll 4") for (int i = 0; i < MR; ++i)
      store_rows(y, N, i0 + i, (t0 + j) * kTileRows, acc[i][j], bias);
}

// One row of x, per block of 32: int8 codes round(x / dx) with dx = max |x| / 127 (0 for an all-zero block), their
// sum, and dx.
template <typename T>
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
    sx[b] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// One row of x in fp32 and its blocks' sums (the FMA path).
template <typename T>
LLMSERVE_AVX512 void widen_row(const T* x, int64_t KB, float* xf, float* sx) {
  for (int64_t b = 0; b < KB; ++b) {
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    _mm512_storeu_ps(xf + b * kBlock, v0);
    _mm512_storeu_ps(xf + b * kBlock + 16, v1);
    sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
  }
}

bool vnni_supported() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

template <typename T, typename S, int BITS>
void run(const torch::Tensor& x, const QBlockWeight& qw, const Weight& w, const float* bias, bool vnni, T* yp) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock, N = qw.n, NT = qw.codes.size(0);
  const T* xp = x.data_ptr<T>();
  auto dx = torch::empty({M, KB}, x.options().dtype(at::kFloat));
  auto sx = torch::empty({M, KB}, x.options().dtype(at::kFloat));
  torch::Tensor xq = torch::empty({M, K}, x.options().dtype(vnni ? at::kChar : at::kFloat));
  float* dxp = dx.data_ptr<float>();
  float* sxp = sx.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (vnni) quantize_row(xp + i * K, KB, xq.data_ptr<int8_t>() + i * K, dxp + i * KB, sxp + i * KB);
      else widen_row(xp + i * K, KB, xq.data_ptr<float>() + i * K, sxp + i * KB);
    }
  });
  const Act a{vnni ? xq.data_ptr<int8_t>() : nullptr, dxp, sxp, K, KB};
  const float* xf = vnni ? nullptr : xq.data_ptr<float>();
  auto tile = [&](auto mr, auto nt, int64_t i, int64_t t) {
    constexpr int MR = decltype(mr)::value, NR = decltype(nt)::value;
    if (vnni) tile_vnni<MR, NR, BITS, S, T>(a, w, i, t, N, bias, yp);
    else tile_fma<MR, NR, BITS, S, T>(xf, a, w, i, t, N, bias, yp);
  };
  // A row or two read each tile's codes as one stream (tiles one after the other); more rows share each tile's
  // unpacked codes across up to 3 tiles.
  if (M <= 2) for_each_tile<2, 1>(M, NT, kChunkRows, tile);
  else for_each_tile<kMaxRows, kMaxTiles>(M, NT, kChunkRows, tile);
}

}  // namespace

bool qblock_linear_supported() { return cpu_has_avx512(); }

bool qblock_vnni_supported() { return vnni_supported(); }

// x [M, K] fp32 or bf16 (K = the weight's columns) @ the block-quantized weight [n, K] ^T (+ bias) -> [M, n] in x's
// dtype. vnni: 1 int8 activations (needs qblock_vnni_supported()), 0 fp32 FMAs, < 0 the former where VNNI is.
torch::Tensor qblock_linear(torch::Tensor x, const QBlockWeight& qw, c10::optional<torch::Tensor> bias, int64_t vnni) {
  TORCH_CHECK(qblock_linear_supported(), "qblock_linear needs a CPU with AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "qblock_linear: x must be [M, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qblock_linear: x fp32 or bf16");
  TORCH_CHECK(x.size(1) == qw.k, "qblock_linear: x has ", x.size(1), " columns, the weight ", qw.k);
  const bool use_vnni = vnni < 0 ? vnni_supported() : vnni > 0;
  TORCH_CHECK(!use_vnni || vnni_supported(), "qblock_linear: vnni=1 needs AVX512-VNNI");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == qw.n, "qblock_linear: bias [n]");
  }
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const auto xc = x.contiguous();
  auto y = torch::empty({x.size(0), qw.n}, x.options());
  const Weight w{qw.codes.data_ptr<uint8_t>(), qw.scales.data_ptr(), qw.mins.has_value() ? qw.mins->data_ptr() : nullptr,
                 qw.k / kBlock, qw.scales.size(1), qw.group / kBlock, qw.bits * 64, qw.zero};
  const bool half = qw.scales.scalar_type() == at::kHalf;
  auto go = [&](auto t) {
    using T = decltype(t);
    T* yp = y.data_ptr<T>();
    if (half) {
      if (qw.bits == 4) run<T, c10::Half, 4>(xc, qw, w, bp, use_vnni, yp);
      else run<T, c10::Half, 8>(xc, qw, w, bp, use_vnni, yp);
    } else {
      if (qw.bits == 4) run<T, float, 4>(xc, qw, w, bp, use_vnni, yp);
      else run<T, float, 8>(xc, qw, w, bp, use_vnni, yp);
    }
  };
  if (xc.scalar_type() == at::kBFloat16) go(c10::BFloat16{});
  else go(float{});
  return y;
}

QBlockWeight::QBlockWeight(torch::Tensor codes_, torch::Tensor scales_, c10::optional<torch::Tensor> mins_, int64_t n_,
                           int64_t k_, int64_t bits_, int64_t group_, int64_t zero_)
    : codes(std::move(codes_)), scales(std::move(scales_)), mins(std::move(mins_)), n(n_), k(k_), bits(bits_),
      group(group_), zero(zero_) {
  const int64_t NT = (n + kTileRows - 1) / kTileRows;
  TORCH_CHECK(bits == 4 || bits == 8, "QBlockWeight: 4- or 8-bit codes, got ", bits);
  TORCH_CHECK(k > 0 && k % kBlock == 0 && group > 0 && group % kBlock == 0 && k % group == 0,
              "QBlockWeight: columns (", k, ") and group (", group, ") must be multiples of 32, the group dividing k");
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.dim() == 3 && codes.size(0) == NT && codes.size(1) == k / kBlock && codes.size(2) == bits * 64,
              "QBlockWeight: codes must be contiguous uint8 [", NT, ", ", k / kBlock, ", ", bits * 64, "]");
  auto check = [&](const torch::Tensor& s, const char* what) {
    TORCH_CHECK(s.device().is_cpu() && (s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat) &&
                    s.is_contiguous() && s.dim() == 3 && s.size(0) == NT && s.size(1) == k / group && s.size(2) == 16,
                "QBlockWeight: ", what, " must be contiguous fp16 or fp32 [", NT, ", ", k / group, ", 16]");
    TORCH_CHECK(s.scalar_type() == scales.scalar_type(), "QBlockWeight: scales and mins of one dtype");
  };
  check(scales, "scales");
  if (mins.has_value()) check(*mins, "mins");
}

// codes uint8 [n, k] (one per byte, < 2^bits) -> the packed layout [ceil(n / 16), k / 32, bits * 64] (zero past n),
// as llmserve/layers/quant_blocks.py's pack_codes (its torch reference) lays it out; one pass at load.
torch::Tensor qblock_pack(torch::Tensor codes, int64_t bits) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.device().is_cpu() && codes.size(1) % kBlock == 0,
              "qblock_pack: codes must be uint8 [n, k] on the CPU, k a multiple of 32");
  TORCH_CHECK(bits == 4 || bits == 8, "qblock_pack: 4 or 8 bits");
  const auto c = codes.contiguous();
  const int64_t n = c.size(0), k = c.size(1), NT = (n + kTileRows - 1) / kTileRows, KB = k / kBlock, bytes = bits * 64;
  auto out = torch::zeros({NT, KB, bytes}, c.options());
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
              if (bits == 8) o[64 * v + i] = q[4 * v + i];
              else o[64 * (v / 2) + i] |= static_cast<uint8_t>((q[4 * v + i] & 15) << (4 * (v % 2)));
            }
        }
      }
  });
  return out;
}

// GGUF blocks of 32 columns holding 16 bytes of nibbles at `offset` in each `size`-byte block (Q4_0, Q4_1: byte j
// has column j low, j + 16 high): raw uint8 [rows, blocks * size] -> codes uint8 [rows, blocks * 32].
torch::Tensor gguf_nibbles(torch::Tensor raw, int64_t offset, int64_t size) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.device().is_cpu() && raw.size(1) % size == 0 &&
                  offset + 16 <= size,
              "gguf_nibbles: raw must be uint8 [rows, blocks * size] on the CPU");
  const auto r = raw.contiguous();
  const int64_t rows = r.size(0), KB = r.size(1) / size;
  auto out = torch::empty({rows, KB * kBlock}, r.options());
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

void bind_qblocks(pybind11::module_& m) {
  m.def("qblock_pack", &qblock_pack, "uint8 codes [n, k] -> qblock_linear's packed layout", py::arg("codes"),
        py::arg("bits"));
  m.def("gguf_nibbles", &gguf_nibbles, "the nibbles of GGUF Q4_0/Q4_1 blocks as one code per byte", py::arg("raw"),
        py::arg("offset"), py::arg("size"));
  py::class_<QBlockWeight>(m, "QBlockWeight", "a block-quantized weight in qblock_gemm.cpp's layout")
      .def(py::init<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, int64_t,
                    int64_t>(),
           py::arg("codes"), py::arg("scales"), py::arg("mins"), py::arg("n"), py::arg("k"), py::arg("bits"),
           py::arg("group"), py::arg("zero"));
  m.def("qblock_linear", &qblock_linear, "x @ W^T (+ bias) over a QBlockWeight (CPU, AVX-512; VNNI: int8 activations "
        "per block of 32)", py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("vnni") = -1);
  m.def("qblock_linear_supported", &qblock_linear_supported, "whether qblock_linear runs here (AVX-512)");
  m.def("qblock_vnni_supported", &qblock_vnni_supported, "whether qblock_linear's int8 path runs here (AVX512-VNNI)");
}
