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
//
// For a few rows of x (decode batches up to kGemvMaxRows) the product is this file's own kernel instead of
// _int_mm: a matrix-vector pass memory-bound on streaming the weights, which oneDNN's GEMM is not (SmolLM2's
// decoder linears at one row: 2.5-5.7 ms against 5.6-9.4 for _int_mm, measured back to back; see gemv_block).
// Both compute the same exact int32 products, so the result does not depend on which one ran.
// Asymmetric per-row activations keep SmolLM2-135M's perplexity within 0.4% of fp32 where symmetric
// ones lose 4% (the inputs of down_proj and of the q/k/v projection are far from centred).
//
// The quantization and the rescale are one pass each over x and over y, AVX-512 through target
// attributes (callers check the CPU at run time). Rounding is round-half-to-even on x * (1 / s) in fp32,
// and the rescale is evaluated in the order written above without fused multiply-adds, so torch ops in
// the same order give bit-identical results (the tests rely on it).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "avx512_math.h"  // LLMSERVE_AVX512, masked loads and stores, sum_lanes16

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

#define LLMSERVE_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// Rows of x up to which gemv_block runs instead of _int_mm. Measured over SmolLM2's decoder linears (2-core
// AVX512-VNNI Xeon, ms, gemv vs _int_mm, back to back): M = 1: 2.7 vs 5.6-9.4; 2: 2.9 vs 6.2-10.8;
// 4: 4.7-7.0 vs 6.9-10.5; 6: 7.0-8.8 vs 7.7-11.5; 8: 8.3-10.5 vs 8.3-11.4; 12: 11.3 vs 9.2.
constexpr int64_t kGemvMaxRows = 8;

// acc[i, 0:rows] = xq[i, :] . w[r, :] for M (1 or 2) rows of xq and rows <= 16 rows of w (exact int32).
// vpdpbusd multiplies unsigned by signed bytes, 64 pairs per instruction: xq is made unsigned by adding 128
// (xor 0x80), and 128 * wsum[r] is taken off the sums again. The int32 lanes wrap on overflow (the
// instruction does not saturate), so the difference is exact whenever the true sum fits in int32; it
// does for K <= kMaxColumns.
template <int M>
LLMSERVE_VNNI void gemv_block(const int8_t* xq, int64_t K, const int8_t* w, int64_t rows, const int32_t* wsum,
                              int32_t* acc, int64_t ld_acc) {
  const int8_t* row[16];
  for (int r = 0; r < 16; ++r) row[r] = w + std::min<int64_t>(r, rows - 1) * K;  // past the end: repeat, not stored
  __m512i sums[M][16];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < 16; ++r) sums[i][r] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 m = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    __m512i xv[M];  // masked-off lanes become 128, but meet zero weights
    for (int i = 0; i < M; ++i) xv[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, xq + i * K + k), flip);
    for (int r = 0; r < 16; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(row[r] + k) + kGemvPrefetchBytes, _MM_HINT_T0);
      const __m512i wv = _mm512_maskz_loadu_epi8(m, row[r] + k);
      for (int i = 0; i < M; ++i) sums[i][r] = _mm512_dpbusd_epi32(sums[i][r], xv[i], wv);
    }
  }
  const __mmask16 keep = tail_mask16(rows);
  const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(keep, wsum), 7);  // 128 * wsum
  for (int i = 0; i < M; ++i)
    _mm512_mask_storeu_epi32(acc + i * ld_acc, keep, _mm512_sub_epi32(sum_lanes16(sums[i], AddEpi32{}), offset));
}

// acc [M, N] = xq [M, K] @ qweight[N, K]^T, for M <= kGemvMaxRows (work split: for_each_gemv_block).
void gemv(const int8_t* xq, int64_t M, int64_t K, const int8_t* w, int64_t N, const int32_t* wsum, int32_t* acc) {
  for_each_gemv_block(M, N, [&](bool pair, int64_t i, int64_t n0, int64_t rows) {
    if (pair)
      gemv_block<2>(xq + i * K, K, w + n0 * K, rows, wsum + n0, acc + i * N + n0, N);
    else
      gemv_block<1>(xq + i * K, K, w + n0 * K, rows, wsum + n0, acc + i * N + n0, N);
  });
}

constexpr int64_t kMaxColumns = (int64_t{1} << 31) / (255 * 127);  // 66311, see w8a8_linear
constexpr int64_t kColBlock = 512;     // rescale work unit: one row, up to this many columns
constexpr int64_t kSerialElems = 32768;  // below this many elements a pass runs on one thread

template <typename T>
torch::Tensor w8a8_impl(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& w_scale,
                        const torch::Tensor& wsum, const float* bias, int64_t gemv_max_rows) {
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
  torch::Tensor acc;  // [M, N] int32
  if (M <= gemv_max_rows) {
    acc = torch::empty({M, N}, x.options().dtype(at::kInt));
    gemv(qp, M, K, qweight.data_ptr<int8_t>(), N, wsum.data_ptr<int32_t>(), acc.data_ptr<int32_t>());
  } else {
    acc = at::_int_mm(xq, qweight.t());
  }
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
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

// x [M, K] fp32 or bf16; qweight [N, K] int8; w_scale [N] fp32; wsum [N] int32 (row sums of qweight);
// bias [N] (any float dtype) or None. Returns [M, N] in x's dtype. gemv_max_rows: up to how many rows the
// matrix-vector kernel runs (-1: kGemvMaxRows; tests and A/B measurements set it).
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor w_scale, torch::Tensor wsum,
                          c10::optional<torch::Tensor> bias, int64_t gemv_max_rows) {
  TORCH_CHECK(w8a8_linear_supported(), "w8a8_linear needs a CPU with AVX-512 (F, BW, VL, DQ) and VNNI");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "w8a8_linear: qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == qweight.size(1), "w8a8_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w8a8_linear: x fp32 or bf16");
  const int64_t N = qweight.size(0);
  // acc - zp * wsum = sum_k (xq - zp) * w with 0 <= xq - zp <= 255, |w| <= 127: int32 holds it for K <= 66311.
  TORCH_CHECK(x.size(1) <= kMaxColumns, "w8a8_linear: rows of at most ", kMaxColumns, " columns (int32 sums); got ",
              x.size(1), ": quantize this model with int8 (weight-only) instead of w8a8");
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
  const int64_t gemv_rows = gemv_max_rows < 0 ? kGemvMaxRows : gemv_max_rows;
  if (xc.scalar_type() == at::kBFloat16) return w8a8_impl<at::BFloat16>(xc, qweight, w_scale, wsum, bp, gemv_rows);
  return w8a8_impl<float>(xc, qweight, w_scale, wsum, bp, gemv_rows);
}
