// Fused elementwise ops of the decoder layer on CPU, each one pass over memory instead of five to
// eight torch ops with temporaries: rotary embedding in place on q and k together, and the residual
// add fused with RMSNorm. Why: at batch 64 these were ~7,000 small torch ops per step (aten::mul
// alone 9% of a throughput run), and at batch 1 most of the non-matmul time of a decode step.
//
// Numerics follow the torch path op by op: math in fp32, and for bf16/fp16 tensors every
// intermediate that torch would store in the tensor dtype is rounded to it here too (R below), so
// results are the ones the reference layers give, not merely close to them.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

template <typename T>
inline float R(float x) {  // round to T's precision, as storing a torch intermediate in T would
  return static_cast<float>(static_cast<T>(x));
}

// x: [T, heads, D] (rows may be strided: q and k are views of the fused qkv output), rotated in place
// by position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the halves. cos/sin: [T, D/2] in T.
template <typename T>
void rotary_impl(T* x, int64_t n_tok, int64_t heads, int64_t D, int64_t tok_stride, int64_t head_stride,
                 const T* cos, const T* sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, n_tok, 16, [&](int64_t begin, int64_t end) {
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

template <typename F>
void dispatch(at::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, name, " supports float32, bfloat16 and float16, not ", t);
  }
}

}  // namespace

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary_: x must be [T, heads, D], D even, "
              "contiguous in D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              cos.size(0) == x.size(0) && cos.size(1) == x.size(2) / 2, "rotary_: cos/sin must be [T, D/2]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rotary_: dtypes differ");
  dispatch(x.scalar_type(), "rotary_", [&](auto tag) {
    using T = decltype(tag);
    rotary_impl<T>(x.data_ptr<T>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1), cos.data_ptr<T>(),
                   sin.data_ptr<T>());
  });
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm_: x and residual must be contiguous [T, E] of one shape");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1), "add_rms_norm_: weight [E]");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: dtypes differ");
  dispatch(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_impl<T>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
}
