// Writing K/V into an int8 KV cache (EngineConfig.kv_cache_dtype="int8", LMDeploy's quant_policy=8):
// each row of head_dim values of one token and KV head is quantized symmetrically,
//   scale = max|x| / 127,  q = round_half_even(x / scale) clamped to [-127, 127]  (all zero: scale 0, q 0)
// and dequantized as q * scale. The arithmetic is exactly torch's (torch_backend.quantize_int8: fp32 amax, an
// IEEE division, round half to even), so both writers store the same bytes. write_kv_int4 (kv_cache_dtype="int4",
// quant_policy=4) quantizes asymmetrically into [0, 15], two values a byte, with an fp16 scale and zero point per
// row (quantize_row_int4: torch_backend.quantize_int4's arithmetic).
//
// Layouts:
//   k, v              [T, KVH, D]       fp32, bf16 or fp16; rows of a token may be strided (a view of QKV)
//   k/v cache         [NB, BS, KVH, D]  int8, contiguous; slot s = block * BS + offset is row s of [NB * BS]
//   k/v scales        [NB, BS, KVH]     fp32, contiguous
//   slots             [T] int64
// One call writes both K and V: a decode step would otherwise spend ~10 torch ops per layer on it.
// write_kv, at the end, does the same for 16- and 32-bit caches (a copy, converted as torch's .to()).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "float_types.h"  // dispatch_float

#include <algorithm>
#include <limits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <cstdint>

#if defined(__AVX2__)
#include "avx512_math.h"
#define LLMSERVE_KV_INT8_AVX512 1
#endif

namespace {

template <typename T>
void quantize_row(const T* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float s = amax / 127.f;
  *scale = s;
  for (int64_t i = 0; i < D; ++i) {
    const float r = s > 0.f ? std::nearbyint(static_cast<float>(x[i]) / s) : 0.f;
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
}

#ifdef LLMSERVE_KV_INT8_AVX512
// D % 16 == 0. cvtps_epi32 rounds half to even (the default MXCSR mode), as nearbyint does.
template <typename T>
LLMSERVE_AVX512 void quantize_row_512(const T* x, int64_t D, int8_t* q, float* scale) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x + i)));
  const float s = _mm512_reduce_max_ps(mx) / 127.f;
  *scale = s;
  if (!(s > 0.f)) {
    std::fill(q, q + D, int8_t(0));
    return;
  }
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t i = 0; i < D; i += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(load16(x + i), sv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_min_epi32(hi, _mm512_max_epi32(lo, r))));
  }
}
#endif

// int4: zero = min x, scale = (max x - min x) / 15, both rounded to fp16 and stored as params[0..1]; then
// q = round_half_even((x - zero) / scale) clamped to [0, 15] (scale 0: q 0), element 2i in byte i's low nibble and
// 2i + 1 in its high one. q: D / 2 bytes.
template <typename T>
void quantize_row_int4(const T* x, int64_t D, uint8_t* q, at::Half* params) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (int64_t i = 0; i < D; ++i) {
    lo = std::min(lo, static_cast<float>(x[i]));
    hi = std::max(hi, static_cast<float>(x[i]));
  }
  params[0] = at::Half((hi - lo) / 15.f);
  params[1] = at::Half(lo);
  const float s = static_cast<float>(params[0]), z = static_cast<float>(params[1]);
  auto nib = [&](int64_t i) {
    const float r = s > 0.f ? std::nearbyint((static_cast<float>(x[i]) - z) / s) : 0.f;
    return static_cast<uint8_t>(std::min(15.f, std::max(0.f, r)));
  };
  for (int64_t i = 0; i < D / 2; ++i) q[i] = static_cast<uint8_t>(nib(2 * i) | (nib(2 * i + 1) << 4));
}

template <typename T>
void write_impl_int4(const at::Tensor& x, at::Tensor& cache, at::Tensor& params, const int64_t* slots) {
  const int64_t KVH = x.size(1), D = x.size(2);
  const T* xp = x.data_ptr<T>();
  uint8_t* cp = cache.data_ptr<uint8_t>();
  at::Half* pp = params.data_ptr<at::Half>();
  at::parallel_for(0, x.size(0) * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / KVH, h = w % KVH, row = slots[t] * KVH + h;
      quantize_row_int4(xp + t * x.stride(0) + h * x.stride(1), D, cp + row * (D / 2), pp + row * 2);
    }
  });
}

template <typename T>
void write_impl(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales, const int64_t* slots) {
  const int64_t T_ = x.size(0), KVH = x.size(1), D = x.size(2);
  const int64_t tok_stride = x.stride(0), head_stride = x.stride(1);
  const T* xp = x.data_ptr<T>();
  int8_t* cp = cache.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
#ifdef LLMSERVE_KV_INT8_AVX512
  const bool wide = D % 16 == 0 && cpu_has_avx512();
#endif
  at::parallel_for(0, T_ * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / KVH, h = w % KVH;
      const T* row = xp + t * tok_stride + h * head_stride;
      int8_t* q = cp + (slots[t] * KVH + h) * D;
      float* s = sp + slots[t] * KVH + h;
#ifdef LLMSERVE_KV_INT8_AVX512
      if (wide) {
        quantize_row_512(row, D, q, s);
        continue;
      }
#endif
      quantize_row(row, D, q, s);
    }
  });
}

// slots (contiguous): one int64 per token, each a row of the cache [NB, BS, ...]; refused otherwise.
const int64_t* checked_slots(const at::Tensor& slots, int64_t tokens, const at::Tensor& cache) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens,
              "one int64 slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " outside the cache (", num_slots, " slots)");
  return sp;
}

// int4: the cache is uint8 [num_blocks, block_size, kv_heads, head_dim / 2], the scales fp16 [..., kv_heads, 2].
void check_side(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales, bool int4 = false) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "K/V must be [T, kv_heads, head_dim] with unit stride in head_dim");
  TORCH_CHECK(!int4 || x.size(2) % 2 == 0, "int4 K/V need an even head_dim");
  TORCH_CHECK(cache.scalar_type() == (int4 ? at::kByte : at::kChar) && cache.is_contiguous() && cache.dim() == 4 &&
                  cache.size(2) == x.size(1) && cache.size(3) == (int4 ? x.size(2) / 2 : x.size(2)),
              int4 ? "cache must be contiguous uint8 [num_blocks, block_size, kv_heads, head_dim / 2]"
                   : "cache must be contiguous int8 [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(scales.scalar_type() == (int4 ? at::kHalf : at::kFloat) && scales.is_contiguous() &&
                  scales.dim() == (int4 ? 4 : 3) && scales.size(0) == cache.size(0) &&
                  scales.size(1) == cache.size(1) && scales.size(2) == x.size(1) && (!int4 || scales.size(3) == 2),
              int4 ? "scales must be contiguous float16 [num_blocks, block_size, kv_heads, 2]"
                   : "scales must be contiguous float32 [num_blocks, block_size, kv_heads]");
  TORCH_CHECK(x.device().is_cpu() && cache.device().is_cpu() && scales.device().is_cpu(), "write_kv_int8/int4 are CPU only");
}

// K and V of a step into an int8 (INT4 false) or int4 cache, each row with its scale(s).
template <bool INT4>
void write_kv_quantized(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                        at::Tensor& k_scales, at::Tensor& v_scales, at::Tensor slots) {
  check_side(k, k_cache, k_scales, INT4);
  check_side(v, v_cache, v_scales, INT4);
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "K and V differ in shape or dtype");
  slots = slots.contiguous();
  const int64_t* sp = checked_slots(slots, k.size(0), k_cache);
  dispatch_float(k.scalar_type(), INT4 ? "write_kv_int4 (K/V)" : "write_kv_int8 (K/V)", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (INT4) {
      write_impl_int4<T>(k, k_cache, k_scales, sp);
      write_impl_int4<T>(v, v_cache, v_scales, sp);
    } else {
      write_impl<T>(k, k_cache, k_scales, sp);
      write_impl<T>(v, v_cache, v_scales, sp);
    }
  });
}

}  // namespace

void write_kv_int8(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor k_scales, at::Tensor v_scales, at::Tensor slots) {
  write_kv_quantized<false>(k, v, k_cache, v_cache, k_scales, v_scales, slots);
}

void write_kv_int4(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                   at::Tensor k_scales, at::Tensor v_scales, at::Tensor slots) {
  write_kv_quantized<true>(k, v, k_cache, v_cache, k_scales, v_scales, slots);
}

// The 16- and 32-bit caches: K and V rows [T, kv_heads, head_dim] (heads contiguous, rows may be strided) copied into
// their slots, converted to the cache's dtype as torch's .to() does (round to nearest even). Why: two index_copy_
// calls per layer cost ~20 us each at a 36-token prompt and ~5 us at one token, most of it setup: 1.2 ms of a
// 25 ms TTFT over 30 layers.
namespace {

template <typename S, typename C>
void copy_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  const int64_t T_ = x.size(0), row = x.size(1) * x.size(2), tok_stride = x.stride(0);
  const S* xp = x.data_ptr<S>();
  C* cp = cache.data_ptr<C>();
  at::parallel_for(0, T_, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* src = xp + t * tok_stride;
      C* dst = cp + slots[t] * row;
      if constexpr (std::is_same_v<S, C>) {
        std::memcpy(dst, src, row * sizeof(C));
      } else {
        for (int64_t i = 0; i < row; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
      }
    }
  });
}

}  // namespace

void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2) && x->device().is_cpu(),
                "write_kv: K/V must be CPU [T, kv_heads, head_dim] with heads and head_dim contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "write_kv: K and V differ in shape or dtype");
  for (const auto* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->is_contiguous() && c->dim() == 4 && c->size(2) == k.size(1) && c->size(3) == k.size(2) &&
                    c->scalar_type() == k_cache.scalar_type() && c->device().is_cpu(),
                "write_kv: caches must be contiguous CPU [num_blocks, block_size, kv_heads, head_dim] of one dtype");
  slots = slots.contiguous();
  const int64_t* sp = checked_slots(slots, k.size(0), k_cache);
  dispatch_float(k.scalar_type(), "write_kv (K/V)", [&](auto s_tag) {
    dispatch_float(k_cache.scalar_type(), "write_kv (the cache)", [&](auto c_tag) {
      copy_rows<decltype(s_tag), decltype(c_tag)>(k, k_cache, sp);
      copy_rows<decltype(s_tag), decltype(c_tag)>(v, v_cache, sp);
    });
  });
}
