// Weight-only int8 linear for few rows (decode batches) on CPU: y[M, N] = (x[M, K] @ Wq[N, K]^T) * scale[N]
// (+ bias), Wq int8 with one fp32 scale per output row. Why: a decode step at small batch is memory-
// bound on streaming the weights (~21 GB/s on the machine measured), and int8 weights are half of
// bf16's bytes and a quarter of fp32's. torch's own int8 kernel (_weight_int8pack_mm) reached only
// 9 GB/s there, compute-bound.
//
// Two kernels, compiled for AVX-512 through target attributes (the extension itself is built for
// generic x86-64); the caller checks the CPU at run time:
// - VNNI (preferred): each row of x is scaled to int16 (its largest |value| -> 32767: a relative error
//   of 1.5e-5 of that value, far below the int8 weights' own rounding), and vpdpwssd multiplies 32
//   int16 pairs into 16 int32 sums per instruction, so 32 weights cost one widening and one vpdpwssd.
//   int32 sums are flushed to fp32 every kChunk columns, so they cannot overflow. The weight rows are
//   prefetched kGemvPrefetchBytes ahead (SmolLM2's decoder and LM head at one row: 6.3-6.7 ms against
//   7.6-7.8 without; at four rows 9.2-9.6 against 11.6-12.0).
// - fp32: 16 weights widened to fp32 (two conversions) and one FMA per row of x: compute-bound at
//   about half the memory bandwidth, kept for AVX-512 CPUs without VNNI.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "avx512_math.h"  // tail_mask16, kGemvPrefetchBytes

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kRows = 8;  // output rows per block (8 independent accumulator chains at M = 1)
constexpr int kMaxM = 2;  // x rows per pass: kRows * kMaxM accumulators stay in registers
// Per lane, a chunk adds kChunk / 16 products of at most 32767 * 127 (< 2^22): 2^9 * 2^22 < 2^31.
constexpr int64_t kChunk = 8192;

// M rows of x and R rows of W as template parameters: the loops unroll and the M * R accumulators
// stay in registers (with run-time bounds they lived on the stack, 5x slower).
template <int M, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void block_vnni(const int16_t* x, const int8_t* w,
                                                                                int64_t K, float* out) {
  // x: [M, K] int16; w: [R, K]; out: [M, kRows] dot products (unscaled).
  for (int i = 0; i < M * kRows; ++i) out[i] = 0.f;
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    const int64_t c1 = std::min(K, c0 + kChunk);
    __m512i acc[M][R];
    for (int i = 0; i < M; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_si512();
    for (int64_t k = c0; k < c1; k += 32) {
      const __mmask32 mask = c1 - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (c1 - k)) - 1;
      __m512i xv[M];
      for (int i = 0; i < M; ++i) xv[i] = _mm512_maskz_loadu_epi16(mask, x + i * K + k);
      for (int r = 0; r < R; ++r) {
        if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kGemvPrefetchBytes, _MM_HINT_T0);
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + r * K + k));
        for (int i = 0; i < M; ++i) acc[i][r] = _mm512_dpwssd_epi32(acc[i][r], xv[i], wv);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int r = 0; r < R; ++r) out[i * kRows + r] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[i][r]));
  }
}

template <int M>
void block_vnni_rows(const int16_t* x, const int8_t* w, int64_t rows, int64_t K, float* out) {
  switch (rows) {
    case 8: return block_vnni<M, 8>(x, w, K, out);
    case 7: return block_vnni<M, 7>(x, w, K, out);
    case 6: return block_vnni<M, 6>(x, w, K, out);
    case 5: return block_vnni<M, 5>(x, w, K, out);
    case 4: return block_vnni<M, 4>(x, w, K, out);
    case 3: return block_vnni<M, 3>(x, w, K, out);
    case 2: return block_vnni<M, 2>(x, w, K, out);
    default: return block_vnni<M, 1>(x, w, K, out);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void block_fp32(const float* x, int64_t m, const int8_t* w,
                                                                     int64_t n_rows, int64_t K, float* out) {
  // x: [m <= kMaxM, K] fp32; w: [n_rows <= kRows, K]; out: [m, kRows] dot products.
  __m512 acc[kMaxM][kRows];
  for (int i = 0; i < kMaxM; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = tail_mask16(K - k);
    __m512 xv[kMaxM];
    for (int i = 0; i < m; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * K + k);
    for (int r = 0; r < n_rows; ++r) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + r * K + k)));
      for (int i = 0; i < m; ++i) acc[i][r] = _mm512_fmadd_ps(xv[i], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < m; ++i)
    for (int r = 0; r < n_rows; ++r) out[i * kRows + r] = _mm512_reduce_add_ps(acc[i][r]);
}

bool has_vnni() { return __builtin_cpu_supports("avx512vnni"); }

}  // namespace

bool int8_linear_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

// allow_vnni=false forces the fp32 kernel (tests; CPUs without VNNI take it anyway).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                          c10::optional<torch::Tensor> bias, bool allow_vnni) {
  TORCH_CHECK(int8_linear_supported(), "int8_linear needs a CPU with AVX-512 (F, BW and VL)");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "int8_linear: qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == qweight.size(1), "int8_linear: x [M, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == qweight.size(0), "int8_linear: fp32 scale [N]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const auto xf = x.to(at::kFloat).contiguous();  // [M, K]
  const bool vnni = allow_vnni && has_vnni();
  // VNNI: x as int16 with one scale per row (x ~= xq * x_scale[row]).
  std::vector<int16_t> xq(vnni ? M * K : 0);
  std::vector<float> x_scale(M, 1.f);
  if (vnni) {
    const float* xp = xf.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xp[i * K + k]));
      x_scale[i] = amax > 0.f ? amax / 32767.f : 1.f;
      const float inv = 1.f / x_scale[i];
      for (int64_t k = 0; k < K; ++k) xq[i * K + k] = static_cast<int16_t>(std::nearbyint(xp[i * K + k] * inv));
    }
  }
  const auto sc = scale.contiguous();
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "int8_linear: bias [N]");
  }
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kRows - 1) / kRows;
  // Split over output rows: each thread streams its own slice of the weights once.
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    float dots[kMaxM * kRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min<int64_t>(kRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const int64_t m = std::min<int64_t>(kMaxM, M - m0);
        if (vnni && m == 2)
          block_vnni_rows<2>(xq.data() + m0 * K, wp + n0 * K, rows, K, dots);
        else if (vnni)
          block_vnni_rows<1>(xq.data() + m0 * K, wp + n0 * K, rows, K, dots);
        else
          block_fp32(xp + m0 * K, m, wp + n0 * K, rows, K, dots);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t r = 0; r < rows; ++r)
            yp[(m0 + i) * N + n0 + r] =
                dots[i * kRows + r] * x_scale[m0 + i] * sp[n0 + r] + (bp ? bp[n0 + r] : 0.f);
      }
    }
  });
  return y.to(x.scalar_type());
}
