// Weight-only int8 linear for few rows (decode batches) on CPU: y[M, N] = (x[M, K] @ Wq[N, K]^T) * scale[N]
// (+ bias), Wq int8 with one fp32 scale per output row. Why: a decode step at small batch is memory-
// bound on streaming the weights (~21 GB/s on the machine measured), and int8 weights are half of
// bf16's bytes and a quarter of fp32's. torch's own int8 kernel (_weight_int8pack_mm) reached only
// 9 GB/s there, compute-bound.
//
// Each 16 weights are loaded once, widened to fp32 in registers and used for every row of x; sums
// are fp32. The kernel is compiled for AVX-512 through a target attribute (the extension itself is
// built for generic x86-64) and the caller checks the CPU at run time.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <vector>

namespace {

constexpr int kRows = 8;  // output rows per block (8 independent FMA chains at M = 1)
constexpr int kMaxM = 2;  // x rows per pass: kRows * kMaxM accumulators stay in registers

__attribute__((target("avx512f,avx512bw,avx512vl"))) void int8_block(const float* x, int64_t m, const int8_t* w,
                                                           int64_t n_rows, int64_t K, float* out) {
  // x: [m <= kMaxM, K] fp32; w: [n_rows <= kRows, K]; out: [m, kRows] dot products.
  __m512 acc[kMaxM][kRows];
  for (int i = 0; i < kMaxM; ++i)
    for (int r = 0; r < kRows; ++r) acc[i][r] = _mm512_setzero_ps();
  // Main body without masks (K is a multiple of 16 in every model served so far), then a masked tail.
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 xv[kMaxM];
    for (int i = 0; i < m; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);
    for (int r = 0; r < n_rows; ++r) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + r * K + k))));
      for (int i = 0; i < m; ++i) acc[i][r] = _mm512_fmadd_ps(xv[i], wv, acc[i][r]);
    }
  }
  if (K16 < K) {
    const __mmask16 mask = __mmask16((1u << (K - K16)) - 1);
    __m512 xv[kMaxM];
    for (int i = 0; i < m; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * K + K16);
    for (int r = 0; r < n_rows; ++r) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + r * K + K16)));
      for (int i = 0; i < m; ++i) acc[i][r] = _mm512_fmadd_ps(xv[i], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < m; ++i)
    for (int r = 0; r < n_rows; ++r) out[i * kRows + r] = _mm512_reduce_add_ps(acc[i][r]);
}

}  // namespace

bool int8_linear_supported() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"); }

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(int8_linear_supported(), "int8_linear needs a CPU with AVX-512 (F, BW and VL)");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "int8_linear: qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == qweight.size(1), "int8_linear: x [M, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == qweight.size(0), "int8_linear: fp32 scale [N]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const auto xf = x.to(at::kFloat).contiguous();  // [M, K]: widened once, read for every row block
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
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    float dots[kMaxM * kRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min<int64_t>(kRows, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const int64_t m = std::min<int64_t>(kMaxM, M - m0);
        int8_block(xp + m0 * K, m, wp + n0 * K, rows, K, dots);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t r = 0; r < rows; ++r)
            yp[(m0 + i) * N + n0 + r] = dots[i * kRows + r] * sp[n0 + r] + (bp ? bp[n0 + r] : 0.f);
      }
    }
  });
  return y.to(x.scalar_type());
}
