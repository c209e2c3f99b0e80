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
