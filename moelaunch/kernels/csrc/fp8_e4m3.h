// The FP8 (e4m3fn) latent cache's codes: written from fp32 values as torch rounds them (the quantizing
// store, paged_store_cpu.cpp), and read back as fp32 or bf16 values, each token's two parts times their
// scales (kernels/kv_fp8.py), by the decode kernels that read an fp8 cache a block or a piece at a time
// (mla_decode_cpu.cpp, mla_decode_amx.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "cpu_isa.h"
#include "simd.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace moelaunch::fp8 {

// The bits of (the floats of `bits`) + addend; U holds the bits of F (uint32_t of float, u32x8 of vec8).
template <typename F, typename U>
inline U add_as_float(U bits, float addend) {
  static_assert(sizeof(F) == sizeof(U));
  F f;
  std::memcpy(&f, &bits, sizeof f);
  f += addend;
  std::memcpy(&bits, &f, sizeof f);
  return bits;
}

// fp32 -> e4m3fn as torch's conversion does it (c10's fp8e4m3fn_from_fp32_value), lane by lane without
// branches: nearest even; below 2^-6 a subnormal, rounded by adding 2^14 (whose ulp is e4m3's subnormal
// step, 2^-9: the float sum rounds to that step); finite values from 480 up saturate to 448, NaN stays
// NaN. F is float or vec8, U its bits.
template <typename F, typename U>
inline U from_float_bits(U bits) {
  constexpr uint32_t kFirstOutOfRange = 1087u << 20;  // 480.0f
  constexpr uint32_t kSubnormalMagic = 141u << 23;    // 2^14
  const U sign = bits & 0x80000000u;
  const U magnitude = bits ^ sign;
  // Normal: re-bias the exponent (127 -> 7), round the mantissa to 3 bits, nearest even.
  const U normal = (magnitude + ((7u - 127u) << 23) + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
  const U subnormal = add_as_float<F>(magnitude, 0x1p14f) - kSubnormalMagic;
  U code = magnitude < (121u << 23) ? subnormal : normal;
  code = magnitude >= kFirstOutOfRange ? (magnitude > 0x7f800000u ? U{} + 0x7fu : U{} + 0x7eu) : code;
  return code | (sign >> 24);
}

inline uint8_t from_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint8_t>(from_float_bits<float>(bits));
}

// Eight values at once into out[0..7].
inline void from_float8(vec8 x, uint8_t* out) {
  u32x8 bits;
  std::memcpy(&bits, &x, sizeof bits);
  const u32x8 codes = from_float_bits<vec8>(bits);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(codes[i]);
}

// e4m3fn -> fp32 without a table: a normal number moves its exponent and mantissa bits into place and
// re-biases (7 -> 127), a subnormal (exponent 0) is its mantissa times 2^-9. NaN (0x7f) reads as 480:
// a cache never holds NaN, its values are quantized from finite latents.
inline float to_float(uint8_t b) {
  const uint32_t magnitude = b & 0x7fu;
  const uint32_t normal_bits = (magnitude << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &normal_bits, sizeof normal);
  const float value = magnitude >= 8 ? normal : static_cast<float>(magnitude) * 0x1p-9f;
  return b & 0x80 ? -value : value;
}

#ifdef __AVX2__
// Eight codes at once, the same arithmetic: a scalar loop (its select and sign branch) cost 20 times
// this, and more than the attention over the block.
inline __m256 to_float8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
  const __m256 normal =
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(0x1p-9f));
  const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(7)));
  const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24));
  return _mm256_or_ps(_mm256_blendv_ps(subnormal, normal, is_normal), sign);
}
#endif

#ifdef MOELAUNCH_HAS_AVX512
// Sixteen codes at once, the same arithmetic at 16 lanes. (One template over GCC vector extensions for
// both widths compiled to scalar code here: the fp8 decode 3-5x slower.)
inline __m512 to_float16(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
  const __m512 normal =
      _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_normal = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(7));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(_mm512_mask_blend_ps(is_normal, subnormal, normal)), sign));
}
#endif

// n tokens of `width` codes -> out [n, width], the first c_dim values of token t times scales[2t] and
// the rest times scales[2t + 1], in fp32.
inline void dequantize_tokens(const uint8_t* codes, const float* scales, int64_t n, int64_t width, int64_t c_dim,
                              float* out) {
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* in = codes + t * width;
    float* row = out + t * width;
    int64_t i = 0;
    for (int part = 0; part < 2; ++part) {
      const int64_t end = part == 0 ? c_dim : width;
      const float s = scales[2 * t + part];
#ifdef MOELAUNCH_HAS_AVX512
      for (; i + 16 <= end; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(to_float16(in + i), _mm512_set1_ps(s)));
#endif
#ifdef __AVX2__
      for (; i + 8 <= end; i += 8) _mm256_storeu_ps(row + i, _mm256_mul_ps(to_float8(in + i), _mm256_set1_ps(s)));
#endif
      for (; i < end; ++i) row[i] = to_float(in[i]) * s;
    }
  }
}

// The same in bf16: each fp32 product rounded once (kv_fp8.dequantize_latent(..., torch.bfloat16)).
inline void dequantize_tokens(const uint8_t* codes, const float* scales, int64_t n, int64_t width, int64_t c_dim,
                              c10::BFloat16* out) {
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* in = codes + t * width;
    c10::BFloat16* row = out + t * width;
    int64_t i = 0;
    for (int part = 0; part < 2; ++part) {
      const int64_t end = part == 0 ? c_dim : width;
      const float s = scales[2 * t + part];
#ifdef MOELAUNCH_HAS_AVX512_BF16
      for (; i + 16 <= end; i += 16) {
        const __m512 v = _mm512_mul_ps(to_float16(in + i), _mm512_set1_ps(s));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i), (__m256i)_mm512_cvtneps_pbh(v));
      }
#endif
      for (; i < end; ++i) row[i] = c10::BFloat16(to_float(in[i]) * s);
    }
  }
}

}  // namespace moelaunch::fp8
