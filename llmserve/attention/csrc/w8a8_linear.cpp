// W8A8 linear on CPU: int8 weights (one symmetric fp32 scale per output row) times int8 activations
// quantized per row of x on the fly (asymmetric: a scale and an integer zero point per row), multiplied by
// oneDNN's s8 x s8 -> s32 GEMM (torch._int_mm), then scaled back:
//
//   x[i, :] ~= s[i] * (xq[i, :] - zp[i])           xq, zp integers in [-128, 127]
//   y[i, n]  = float(acc[i, n] - zp[i] * wsum[n]) * (s[i] * w_scale[n]) (+ bias[n])
//   acc      = xq @ Wq^T (int32, exact),  wsum[n] = sum_k Wq[n, k]
//
// Why: on a CPU with AVX512-VNNI and no AMX, the int8 GEMM runs at 700-1000 GOP/s on 2 cores where bf16
// reaches ~150 GFLOP/s and fp32 ~250 (measured on SmolLM2's linears: 5x less time at 64 rows, 4.6x at 512).
// Asymmetric per-row activations keep SmolLM2-135M's perplexity within 0.4% of fp32 where symmetric
// ones lose 4% (the inputs of down_proj and of the q/k/v projection are far from centred).
//
// The quantization and the rescale are one pass each over x and over y, AVX-512 through target
// attributes (callers check the CPU at run time). Rounding is round-half-to-even on x * (1 / s) in fp32,
// and the rescale is evaluated in the order written above without fused multiply-adds, so torch ops in
// the same order give bit-identical results (the tests rely on it).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "avx512_math.h"  // LLMSERVE_AVX512, masked loads and stores

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// One row of x -> xq (int8), its scale and zero point. The range always includes 0, so 0 is exact.
template <typename T>
LLMSERVE_AVX512 void quantize_row(const T* x, int64_t K, int8_t* q, float* scale, int32_t* zero_point) {
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
  const __m512i vzp = _mm512_set1_epi32(zp);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask16(K - k);
    // cvtps rounds half to even (the default MXCSR mode); cvtsepi32 saturates to [-128, 127].
    const __m512i r = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(loadu16(x + k, m), vinv)), vzp);
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(r));
  }
  *scale = s;
  *zero_point = zp;
}

// y[i, n0:n1] from acc[i, n0:n1].
template <typename T>
LLMSERVE_AVX512 void rescale_row(const int32_t* acc, int64_t n0, int64_t n1, float s, int32_t zp, const int32_t* wsum,
                             const float* w_scale, const float* bias, T* y) {
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i vzp = _mm512_set1_epi32(zp);
  for (int64_t n = n0; n < n1; n += 16) {
    const __mmask16 m = tail_mask16(n1 - n);
    const __m512i a = _mm512_maskz_loadu_epi32(m, acc + n);
    const __m512i c = _mm512_sub_epi32(a, _mm512_mullo_epi32(vzp, _mm512_maskz_loadu_epi32(m, wsum + n)));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(vs, _mm512_maskz_loadu_ps(m, w_scale + n)));
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + n));
    storeu16(y + n, v, m);
  }
}

constexpr int64_t kColBlock = 512;     // rescale work unit: one row, up to this many columns
constexpr int64_t kSerialElems = 32768;  // below this many elements a pass runs on one thread

template <typename T>
torch::Tensor w8a8_impl(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& w_scale,
                        const torch::Tensor& wsum, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  auto xq = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto s = torch::empty({M}, x.options().dtype(at::kFloat));
  auto zp = torch::empty({M}, x.options().dtype(at::kInt));
  const T* xp = x.data_ptr<T>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  int32_t* zpp = zp.data_ptr<int32_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, kSerialElems / K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_row(xp + i * K, K, qp + i * K, sp + i, zpp + i);
  });
  const auto acc = at::_int_mm(xq, qweight.t());  // [M, N] int32
  auto y = torch::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const int32_t* wsp = wsum.data_ptr<int32_t>();
  const float* wscp = w_scale.data_ptr<float>();
  T* yp = y.data_ptr<T>();
  const int64_t col_blocks = (N + kColBlock - 1) / kColBlock;
  const int64_t grain = std::max<int64_t>(1, kSerialElems / std::min(N, kColBlock));
  at::parallel_for(0, M * col_blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / col_blocks, n0 = (t % col_blocks) * kColBlock;
      rescale_row(ap + i * N, n0, std::min(N, n0 + kColBlock), sp[i], zpp[i], wsp, wscp, bias, yp + i * N);
    }
  });
  return y;
}

}  // namespace

bool w8a8_linear_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

// x [M, K] fp32 or bf16; qweight [N, K] int8; w_scale [N] fp32; wsum [N] int32 (row sums of qweight);
// bias [N] (any float dtype) or None. Returns [M, N] in x's dtype.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor w_scale, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w8a8_linear_supported(), "w8a8_linear needs a CPU with AVX-512 (F, BW, VL, DQ) and VNNI");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "w8a8_linear: qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == qweight.size(1), "w8a8_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w8a8_linear: x fp32 or bf16");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && w_scale.is_contiguous(),
              "w8a8_linear: w_scale must be contiguous fp32 [N]");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.numel() == N && wsum.is_contiguous(),
              "w8a8_linear: wsum must be contiguous int32 [N]");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "w8a8_linear: bias [N]");
  }
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  const auto xc = x.contiguous();
  if (xc.scalar_type() == at::kBFloat16) return w8a8_impl<at::BFloat16>(xc, qweight, w_scale, wsum, bp);
  return w8a8_impl<float>(xc, qweight, w_scale, wsum, bp);
}
