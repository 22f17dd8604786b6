// The floating-point tensor dtypes the kernels take, dispatched to their C++ types (one switch for every kernel;
// no intrinsics here, so files built without AVX include it too).
#pragma once

#include <ATen/ATen.h>

// f(T{}) with T float, c10::BFloat16 or c10::Half for a float32, bfloat16 or float16 dtype t; any other dtype is
// refused with a message naming `what` (e.g. "paged_decode (q)") and the accepted dtypes.
template <typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, what, " supports float32, bfloat16 and float16, not ", t);
  }
}
