// bf16 linear for a few rows of x (decode batches) on CPUs with AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), fp32 sums rounded once to bf16. Why: at one row the product is memory-bound on streaming the
// weights, and oneDNN's bf16 matmul on the blocked weight streamed SmolLM2's decoder and LM head at
// ~16 GB/s where this kernel, on the plain row-major weight, reaches ~21-25 (15.1-23.0 ms against
// 10.9-14.1 per token, interleaved on one machine; 10% less at 4 rows, see BF16_GEMV_MAX_ROWS in linear.py).
//
// vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 sums per instruction (products exact, sums in fp32, as a
// bf16 GEMM; only the summation order differs from oneDNN's). Threads split the output rows, each streaming
// its own contiguous slice of the weights, 16 rows at a time with a software prefetch (kGemvPrefetchBytes,
// for_each_gemv_block).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "avx512_math.h"  // storeu16, tail_mask16, sum_lanes16, for_each_gemv_block, kGemvPrefetchBytes

#include <algorithm>
#include <cstdint>

#define LLMSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

namespace {

// y[i, 0:rows] for M (1 or 2) rows of x and rows <= 16 rows of w (past the end: the last row again, not stored).
template <int M>
LLMSERVE_AVX512_BF16 void gemv_block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t rows, const float* bias,
                                     c10::BFloat16* y, int64_t ld_y) {
  const uint16_t* row[16];
  for (int r = 0; r < 16; ++r) row[r] = w + std::min<int64_t>(r, rows - 1) * K;
  __m512 sums[M][16];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < 16; ++r) sums[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;  // masked-off pairs are 0
    __m512bh xv[M];
    for (int i = 0; i < M; ++i) xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * K + k);
    for (int r = 0; r < 16; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(row[r] + k) + kGemvPrefetchBytes, _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, row[r] + k);
      for (int i = 0; i < M; ++i) sums[i][r] = _mm512_dpbf16_ps(sums[i][r], xv[i], wv);
    }
  }
  const __mmask16 keep = tail_mask16(rows);
  for (int i = 0; i < M; ++i) {
    __m512i lanes[16];
    for (int r = 0; r < 16; ++r) lanes[r] = _mm512_castps_si512(sums[i][r]);
    __m512 v = _mm512_castsi512_ps(sum_lanes16(lanes, AddPs{}));
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias));
    storeu16(y + i * ld_y, v, keep);
  }
}

}  // namespace

bool bf16_linear_supported() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

// x [M, K] bf16, weight [N, K] bf16 (contiguous), bias [N] (any float dtype) or None -> [M, N] bf16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(bf16_linear_supported(), "bf16_linear needs a CPU with AVX-512 and AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_linear: x must be bf16 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
              weight.size(1) == x.size(1), "bf16_linear: weight must be contiguous bf16 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bf16_linear: bias [N]");
  }
  const auto xc = x.contiguous();
  auto y = torch::empty({M, N}, xc.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  for_each_gemv_block(M, N, [&](bool pair, int64_t i, int64_t n0, int64_t rows) {
    const float* bb = bp ? bp + n0 : nullptr;
    if (pair)
      gemv_block<2>(xp + i * K, K, wp + n0 * K, rows, bb, yp + i * N + n0, N);
    else
      gemv_block<1>(xp + i * K, K, wp + n0 * K, rows, bb, yp + i * N + n0, N);
  });
  return y;
}
