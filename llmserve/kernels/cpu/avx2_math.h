// 8-lane fp32 helpers for builds with AVX2 and FMA (native.py's flags add -mavx2 -mfma where torch finds AVX2, AVX-512
// CPUs included); LLMSERVE_AVX2 is defined where they exist.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLMSERVE_AVX2 1

// exp for x <= 0 (logits minus their running max), Cephes polynomial: ~2 ulp, 8 lanes at a time.
// Why: libm expf per score was a large share of the kernel's time.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below this exp underflows; result ~1e-38, harmless
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n*ln2, split for precision
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(x) = x / (1 + exp(-x)), 8 lanes, with exp taken of -|x| only (exp256 is for arguments <= 0): for x < 0 the
// same quotient is x exp(x) / (1 + exp(x)). avx512_math.h's silu16 in 8 lanes, but with an exact division (AVX2 has no
// vrcp14ps: its 12-bit vrcpps and one Newton step would be further off), so within a few ulp of torch's silu.
inline __m256 silu256(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = exp256(_mm256_or_ps(x, _mm256_set1_ps(-0.f)));  // exp(-|x|)
  const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_div_ps(num, _mm256_add_ps(one, e));
}

#endif
