// What the kernel libraries share: the dtype dispatch of their entry points, and scalar float
// helpers their loops vectorise (each compiles to a few vector instructions per lane, where the C
// library's expf or c10's conversions are calls or branches per element).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace leanserve {

// Calls f(T{}) with T the C++ type of dtype, so a kernel is written once for both it takes;
// other dtypes are an error naming the op.
template <typename F>
void for_dtype(c10::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return f(float{});
    case c10::ScalarType::BFloat16:
      return f(c10::BFloat16{});
    default:
      TORCH_CHECK(false, op, ": float32 or bfloat16, got ", dtype);
  }
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  // bf16 is the upper half of a float32: a shift.
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> T, rounded to nearest even as c10 and every torch op round (NaN stays a NaN).
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(uint16_t((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded),
                       c10::BFloat16::from_bits());
}

// exp(x - k ln 2), the part of exp_nonpositive below its 2^k, for float or a vector of floats
// (the lane-wise exp_nonpositive below): r = x - k ln 2 with ln 2 in two parts, then the
// degree-6 Taylor polynomial of exp(r) by Horner's rule.
template <typename V>
inline V exp_reduced(V x, V k) {
  const V r = x - k * 0.693359375f + k * 2.12194440e-4f;
  V p = V{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

// exp(x) for x <= 0: x = k ln 2 + r with |r| <= ln 2 / 2, exp(r) by its degree-6 Taylor
// polynomial, times 2^k built in the exponent bits. Relative error below 2.5e-7, or ~4e-6 near
// x = -80 where -fassociative-math (the kernels' build) folds the two parts of ln 2 into one
// constant: far inside a bf16 step (4e-3) and below the float32 tests' 1e-5. Inputs below -87
// (exp underflows float32; -inf included) give 0, where expf would give denormals.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.f);
  const float k = std::floor(clamped * 1.44269504f + 0.5f);
  const float p = exp_reduced(clamped, k);
  const int32_t bits = (int32_t(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return x < -87.f ? 0.f : p * two_k;
}

// Keys lie in the cache dimension-major in groups of 32 bits (model/kv_layout.py says why): a
// (block, KV head)'s [head_dim / P][block_size][P], P elements of T in 32 bits, so that group p
// of consecutive keys is one run of 32-bit lanes. Key t's dimension d is element
// key_offset<T>(t, d, block_size) of the (block, head)'s run.
template <typename T>
constexpr int64_t kKeyGroup = 4 / int64_t(sizeof(T));

template <typename T>
inline int64_t key_offset(int64_t t, int64_t d, int64_t block_size) {
  return (d / kKeyGroup<T>) * block_size * kKeyGroup<T> + t * kKeyGroup<T> + d % kKeyGroup<T>;
}

// 16 floats (and 16 int32) as the compiler's own vector types: one AVX-512 register, two AVX2 or
// four NEON ones where the CPU's registers are narrower. The attention kernels' lanes.
typedef float vfloat16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t vint16 __attribute__((vector_size(16 * sizeof(int32_t))));

// 16 floats from p and to p, any alignment; the lane-wise maximum.
inline vfloat16 load(const float* p) {
  vfloat16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat16 v) { std::memcpy(p, &v, sizeof v); }

inline vfloat16 vmax(vfloat16 a, vfloat16 b) { return a > b ? a : b; }

// exp_nonpositive lane by lane (GCC vectorises no loop of the scalar one around the kernels' loads
// and stores): the same exp_reduced times 2^k in the exponent bits; k = round(x / ln 2) by
// truncating x / ln 2 - 1/2 (x <= 0), so |r| <= ln 2 / 2.
inline vfloat16 exp_nonpositive(vfloat16 x) {
  const vfloat16 floor = vfloat16{} - 87.f;
  const vfloat16 clamped = x < floor ? floor : x;
  const vint16 k = __builtin_convertvector(clamped * 1.44269504f - 0.5f, vint16);
  const vfloat16 p = exp_reduced(clamped, __builtin_convertvector(k, vfloat16));
  const vfloat16 two_k = (vfloat16)((k + 127) << 23);
  return x < floor ? vfloat16{} : p * two_k;
}

}  // namespace leanserve
