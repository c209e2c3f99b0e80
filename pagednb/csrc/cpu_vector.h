// The vector helpers every C++ source of pagednb starts with: 8 floats in one register (GCC/Clang vector
// types).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>

// 8 floats: AVX2 on x86, two NEON registers on ARM
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // the same, loaded from any float address
typedef int32_t i8 __attribute__((vector_size(32)));

static inline v8 ld(const float* p) { return *(const v8u*)p; }
static inline void st(float* p, v8 x) { *(v8u*)p = x; }
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// The core every exp shares: e^x = 2^n * e^r with n = round(x / ln 2) (returned in *n) and |r| <= ln 2 / 2;
// e^r from a degree-6 Taylor polynomial. Each caller builds 2^n for the range of x it takes. V: 8 or 16 floats.
template <class V>
static inline V exp_reduced(V x, V* n) {
  // round to nearest (1.5 * 2^23 trick)
  *n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  // ln 2 in two parts, so r stays exact
  const V r = x - *n * 0.693145752f - *n * 1.42860677e-6f;
  V p = V{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

// exp(x) for x <= 0, a vector V of floats at a time (I: ints of the same width): 2^n * e^r with
// n = round(x / ln 2), |r| <= ln 2 / 2, and a degree-6 Taylor polynomial for e^r
template <class V, class I>
static inline V exp_neg(V x) {
  // e^x < 2^-125 there: returned as 0 (2^n would underflow)
  const auto tiny = x < -87.f;
  x = tiny ? V{} - 87.f : x;
  V nr;
  const V p = exp_reduced(x, &nr);
  const I bits = (__builtin_convertvector(nr, I) + 127) << 23;  // 2^n as a float's exponent bits
  V two_n;
  std::memcpy(&two_n, &bits, sizeof bits);
  return tiny ? V{} : p * two_n;
}
