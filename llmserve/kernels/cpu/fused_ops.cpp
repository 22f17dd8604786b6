// Fused elementwise ops of the decoder layer on CPU, each one pass over memory instead of five to
// eight torch ops with temporaries: rotary embedding in place on q and k together, the residual
// add fused with RMSNorm, and SiLU(gate) * up. Why: at batch 64 these were ~7,000 small torch ops per step
// (aten::mul alone 9% of a throughput run), and at batch 1 most of the non-matmul time of a decode step.
// SiLU * up: torch's bf16 silu and mul took 317 us per layer at 300 tokens (0.7 ns per element, 9.5 ms per
// 30-layer step) on this 2-core CPU.
//
// Numerics follow the torch path op by op: math in fp32, and for bf16/fp16 tensors every
// intermediate that torch would store in the tensor dtype is rounded to it here too (R below), so
// results are the ones the reference layers give, not merely close to them.
//
// fp32 and bf16 run 16 lanes at a time on AVX-512 CPUs (the same roundings, vectorised: the scalar loops
// below convert bf16 one element at a time and measured ~2 ns per element, so at 256 tokens one
// add+RMSNorm took 465 us and one rotary 604 us, ~3.3 s of a 64-request throughput run); fp16, and CPUs
// without AVX-512, take the scalar loops, but for fp32 SiLU * up on AVX2 (8 lanes: silu_mul_row8).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "float_types.h"  // dispatch_float

#include "avx512_math.h"  // LLMSERVE_AVX512, cpu_has_avx512, loadu16 / storeu16, bf16_bits, tail_mask16
#include "avx2_math.h"    // silu256 (LLMSERVE_AVX2: builds with AVX2 and FMA)

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

template <typename T>
inline float R(float x) {  // round to T's precision, as storing a torch intermediate in T would
  return static_cast<float>(static_cast<T>(x));
}

// R on 16 lanes, for fp32 (nothing to do) and bf16 (nearest even, as torch's cast).
template <typename T>
LLMSERVE_AVX512 inline __m512 R16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  }
}

template <typename T>
constexpr bool kVectorised = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// One token's heads, as rotary_impl's scalar loop.
template <typename T>
LLMSERVE_AVX512 void rotary_token16(T* x, int64_t heads, int64_t half, int64_t head_stride, const T* c, const T* s) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_stride;
    T* x2 = x1 + half;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = tail_mask16(half - i);
      const __m512 a = loadu16(x1 + i, m), b = loadu16(x2 + i, m), ci = loadu16(c + i, m), si = loadu16(s + i, m);
      storeu16(x1 + i, _mm512_sub_ps(R16<T>(_mm512_mul_ps(a, ci)), R16<T>(_mm512_mul_ps(b, si))), m);
      storeu16(x2 + i, _mm512_add_ps(R16<T>(_mm512_mul_ps(b, ci)), R16<T>(_mm512_mul_ps(a, si))), m);
    }
  }
}

// One row, as add_rms_norm_impl's scalar loop (the sum of squares in 16 lanes: another order).
template <typename T>
LLMSERVE_AVX512 void add_rms_norm_row16(T* xr, T* rr, const T* weight, int64_t E, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < E; i += 16) {
    const __mmask16 m = tail_mask16(E - i);
    const __m512 v = R16<T>(_mm512_add_ps(loadu16(xr + i, m), loadu16(rr + i, m)));
    storeu16(rr + i, v, m);
    ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));  // masked-off lanes are 0
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(E) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < E; i += 16) {
    const __mmask16 m = tail_mask16(E - i);
    storeu16(xr + i, _mm512_mul_ps(loadu16(weight + i, m), R16<T>(_mm512_mul_ps(loadu16(rr + i, m), vinv))), m);
  }
}

// The bf16 forms of rotary_token16 and add_rms_norm_row16 where the CPU has AVX512-BF16 and the rows come in whole
// vectors: each rounding of two vectors by bf16_pair's one vcvtne2ps2bf16 (the same bits), where bf16_bits' integer
// rounding and narrowing took ~9 instructions a vector and made these ops bound by them. Measured on the Xeon with
// AMX (model 167, 2026-12-06; SmolLM2's shapes, 2 threads, one process, alternated, medians of 7, a call): add+RMSNorm
// over 2,000 x 576 0.308 -> 0.188 ms, 64 rows 11.1 -> 7.1 us; rotary of 12 heads x 64 over 2,000 tokens 0.271 ->
// 0.182 ms, 64 tokens 13.0 -> 10.1 us (30 layers: ~10 ms of a 2,000-token prompt's ~550). Rotary: the token's
// cos/sin widened once for all its heads.
LLMSERVE_AVX512BF16 void rotary_token_pairs(c10::BFloat16* x, int64_t heads, int64_t half, int64_t head_stride,
                                            const c10::BFloat16* c, const c10::BFloat16* s) {
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 ci = load16(c + i), si = load16(s + i);
    for (int64_t h = 0; h < heads; ++h) {
      c10::BFloat16* x1 = x + h * head_stride + i;
      c10::BFloat16* x2 = x1 + half;
      const __m512 a = load16(x1), b = load16(x2);
      const __m512i p = bf16_pair(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si));
      const __m512i q = bf16_pair(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si));
      const __m512i o = bf16_pair(_mm512_sub_ps(bf16_first(p), bf16_last(p)), _mm512_add_ps(bf16_first(q), bf16_last(q)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x1), _mm512_castsi512_si256(o));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x2), _mm512_extracti64x4_epi64(o, 1));
    }
  }
}

LLMSERVE_AVX512BF16 void add_rms_norm_row_pairs(c10::BFloat16* xr, c10::BFloat16* rr, const c10::BFloat16* weight,
                                                int64_t E, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < E; i += 32) {
    const __m512i p = bf16_pair(_mm512_add_ps(load16(xr + i), load16(rr + i)),
                                _mm512_add_ps(load16(xr + i + 16), load16(rr + i + 16)));
    _mm512_storeu_si512(rr + i, p);
    const __m512 v0 = bf16_first(p), v1 = bf16_last(p);
    ss = _mm512_add_ps(ss, _mm512_mul_ps(v0, v0));
    ss = _mm512_add_ps(ss, _mm512_mul_ps(v1, v1));
  }
  const __m512 vinv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(E) + eps));
  for (int64_t i = 0; i < E; i += 32) {
    const __m512i n = bf16_pair(_mm512_mul_ps(load16(rr + i), vinv), _mm512_mul_ps(load16(rr + i + 16), vinv));
    _mm512_storeu_si512(xr + i, bf16_pair(_mm512_mul_ps(load16(weight + i), bf16_first(n)),
                                          _mm512_mul_ps(load16(weight + i + 16), bf16_last(n))));
  }
}

// One row of silu(gate) * up, as silu_mul_impl's scalar loop (silu16: avx512_math.h).
template <typename T>
LLMSERVE_AVX512 void silu_mul_row16(const T* gate, const T* up, T* out, int64_t I) {
  int64_t i = 0;
  // four vectors a pass: silu16's exp is a chain of ~15 dependent operations, and one vector at a time left most
  // of the core idle (the same operations on each element, so the same bits)
  for (; i + 64 <= I; i += 64) {
    __m512 g[4];
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) g[u] = silu16(load16(gate + i + 16 * u));
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u)
      storeu16(out + i + 16 * u, _mm512_mul_ps(R16<T>(g[u]), load16(up + i + 16 * u)), 0xFFFF);
  }
  for (; i < I; i += 16) {
    const __mmask16 m = tail_mask16(I - i);
    const __m512 s = R16<T>(silu16(loadu16(gate + i, m)));
    storeu16(out + i, _mm512_mul_ps(s, loadu16(up + i, m)), m);
  }
}

#ifdef LLMSERVE_AVX2
// One fp32 row of silu(gate) * up, 8 lanes at a time (silu256), for CPUs with AVX2 but not AVX-512; the tail through a
// zero-padded vector, so every element takes the same operations. Why: the scalar loop's libm expf took 4 us a row of
// SmolLM2's 1,536 (2.6 ns an element) on an AVX2-only Zen 3: 0.42 ms a layer at 64 rows, 12.7 ms of a 64-request
// decode step over 30 layers.
void silu_mul_row8(const float* gate, const float* up, float* out, int64_t I) {
  int64_t i = 0;
  for (; i + 32 <= I; i += 32) {  // four vectors a pass: exp256 is a chain of dependent operations
    __m256 g[4];
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u) g[u] = silu256(_mm256_loadu_ps(gate + i + 8 * u));
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; ++u)
      _mm256_storeu_ps(out + i + 8 * u, _mm256_mul_ps(g[u], _mm256_loadu_ps(up + i + 8 * u)));
  }
  for (; i < I; i += 8) {
    const int64_t n = std::min<int64_t>(8, I - i);
    alignas(32) float gv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, uv[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::copy(gate + i, gate + i + n, gv);
    std::copy(up + i, up + i + n, uv);
    alignas(32) float ov[8];
    _mm256_store_ps(ov, _mm256_mul_ps(silu256(_mm256_load_ps(gv)), _mm256_load_ps(uv)));
    std::copy(ov, ov + n, out + i);
  }
}
#endif

// out[t] = silu(x[t, :I]) * x[t, I:], per row: torch's F.silu(gate) * up, silu rounded to T before the product.
template <typename T>
void silu_mul_impl(const T* x, T* out, int64_t n_tok, int64_t I) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));  // rows per task: ~16K elements
  at::parallel_for(0, n_tok, grain, [&](int64_t begin, int64_t end) {
    if constexpr (kVectorised<T>) {
      if (cpu_has_avx512()) {
        for (int64_t t = begin; t < end; ++t) silu_mul_row16<T>(x + t * 2 * I, x + t * 2 * I + I, out + t * I, I);
        return;
      }
    }
#ifdef LLMSERVE_AVX2
    if constexpr (std::is_same_v<T, float>) {  // (AVX-512 CPUs took the 16-lane path above)
      for (int64_t t = begin; t < end; ++t) silu_mul_row8(x + t * 2 * I, x + t * 2 * I + I, out + t * I, I);
      return;
    }
#endif
    for (int64_t t = begin; t < end; ++t) {
      const T* g = x + t * 2 * I;
      const T* u = g + I;
      T* o = out + t * I;
      for (int64_t i = 0; i < I; ++i) {
        const float v = static_cast<float>(g[i]);
        o[i] = static_cast<T>(R<T>(v / (1.f + std::exp(-v))) * static_cast<float>(u[i]));
      }
    }
  });
}

// x: [T, heads, D] (rows may be strided: q and k are views of the fused qkv output), rotated in place
// by position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the halves. cos/sin: [T, D/2] in T.
template <typename T>
void rotary_impl(T* x, int64_t n_tok, int64_t heads, int64_t D, int64_t tok_stride, int64_t head_stride,
                 const T* cos, const T* sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, n_tok, 16, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (half % 16 == 0 && cpu_has_avx512_bf16()) {
        for (int64_t t = begin; t < end; ++t)
          rotary_token_pairs(x + t * tok_stride, heads, half, head_stride, cos + t * half, sin + t * half);
        return;
      }
    }
    if constexpr (kVectorised<T>) {
      if (cpu_has_avx512()) {
        for (int64_t t = begin; t < end; ++t)
          rotary_token16<T>(x + t * tok_stride, heads, half, head_stride, cos + t * half, sin + t * half);
        return;
      }
    }
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * tok_stride + h * head_stride;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i], ci = c[i], si = s[i];
          x1[i] = static_cast<T>(R<T>(a * ci) - R<T>(b * si));
          x2[i] = static_cast<T>(R<T>(b * ci) + R<T>(a * si));
        }
      }
    }
  });
}

// residual += x; x = weight * norm(residual), per row of E. As the reference: the sum is stored in
// T, normalised in fp32, rounded to T, then scaled by the weight in T.
template <typename T>
void add_rms_norm_impl(T* x, T* residual, const T* weight, int64_t n_tok, int64_t E, double eps) {
  at::parallel_for(0, n_tok, 16, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (E % 32 == 0 && cpu_has_avx512_bf16()) {
        for (int64_t t = begin; t < end; ++t)
          add_rms_norm_row_pairs(x + t * E, residual + t * E, weight, E, static_cast<float>(eps));
        return;
      }
    }
    if constexpr (kVectorised<T>) {
      if (cpu_has_avx512()) {
        for (int64_t t = begin; t < end; ++t)
          add_rms_norm_row16<T>(x + t * E, residual + t * E, weight, E, static_cast<float>(eps));
        return;
      }
    }
    for (int64_t t = begin; t < end; ++t) {
      T* xr = x + t * E;
      T* rr = residual + t * E;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < E; ++i) {
        const float v = R<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        rr[i] = static_cast<T>(v);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(E) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < E; ++i)
        xr[i] = static_cast<T>(static_cast<float>(weight[i]) * R<T>(static_cast<float>(rr[i]) * inv));
    }
  });
}

}  // namespace

void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary_: x must be [T, heads, D], D even, "
              "contiguous in D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              cos.size(0) == x.size(0) && cos.size(1) == x.size(2) / 2, "rotary_: cos/sin must be [T, D/2]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rotary_: dtypes differ");
  dispatch_float(x.scalar_type(), "rotary_", [&](auto tag) {
    using T = decltype(tag);
    rotary_impl<T>(x.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1), cos.data_ptr<T>(),
                   sin.data_ptr<T>());
  });
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm_: x and residual must be contiguous [T, E] of one shape");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1), "add_rms_norm_: weight [E]");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: dtypes differ");
  dispatch_float(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_impl<T>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
}

at::Tensor silu_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0 && x.device().is_cpu(),
              "silu_mul: x must be a contiguous CPU tensor [T, 2 * I] (gate, then up)");
  const int64_t I = x.size(1) / 2;
  auto out = at::empty({x.size(0), I}, x.options());
  dispatch_float(x.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_impl<T>(x.data_ptr<T>(), out.data_ptr<T>(), x.size(0), I);
  });
  return out;
}
