// RMSNorm, residual add + RMSNorm, SiLU-and-multiply and RoPE, one pass each (notebook 04b_cpu_ops), on rows of
// float32 or of bfloat16 (E = float or bf16: loaded as floats, computed in float32, rounded once per value where
// torch rounds, so that a bfloat16 model gives what its torch ops give).
#include "cpu_vector.h"

// Rows are split among threads only when there is enough work to pay for waking them (a few microseconds).
static inline bool worth_threads(int64_t elems, int nt) { return nt > 1 && elems >= 32768; }

// bfloat16 is the top half of a float32: read by a shift, written rounded to nearest even (as torch rounds), a
// NaN kept a NaN. Vector (8 values) and scalar forms; float32 rows go through the same names unchanged.
typedef uint16_t bf16;
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline u32x8 bf16_bits(v8 x) {
  u32x8 u;
  std::memcpy(&u, &x, sizeof u);
  const u32x8 r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  return (u & 0x7fffffff) > 0x7f800000u ? (u >> 16) | 0x40 : r;
}
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// A CPU with AVX512-BF16 rounds 8 floats to bfloat16 in one instruction (vcvtneps2bf16: nearest even, a NaN kept
// a quiet NaN), as torch's own vectorized kernels do there, where the integer rounding above takes ten.
#include <immintrin.h>
static inline __m128bh bf16x8(v8 x) { return _mm256_cvtneps_pbh((__m256)x); }
// 8 bfloat16 widened to 32 bits in one instruction (vpmovzxwd), then shifted into the top half
static inline v8 widen(__m128i h) { return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16); }
static inline v8 ld(const bf16* p) { return widen(_mm_loadu_si128((const __m128i*)p)); }
static inline void st(bf16* p, v8 x) {
  const __m128bh h = bf16x8(x);
  std::memcpy(p, &h, sizeof h);
}
#else
static inline v8 ld(const bf16* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const i8 b = __builtin_convertvector(h, i8) << 16;
  v8 f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
static inline void st(bf16* p, v8 x) {
  const u16x8 h = __builtin_convertvector(bf16_bits(x), u16x8);
  std::memcpy(p, &h, sizeof h);
}
#endif
static inline float get(const float* p, int64_t i) { return p[i]; }
static inline float get(const bf16* p, int64_t i) {
  const uint32_t b = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
static inline void put(float* p, int64_t i, float x) { p[i] = x; }
static inline void put(bf16* p, int64_t i, float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  p[i] = (u & 0x7fffffff) > 0x7f800000u ? (u >> 16) | 0x40 : (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}
// x as a value of E holds it: unchanged for float, rounded to bfloat16 for bf16 (torch's intermediate rounding)
template <class E>
static inline v8 held(v8 x) { return x; }
template <>
inline v8 held<bf16>(v8 x) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  return widen((__m128i)bf16x8(x));
#else
  const u32x8 b = bf16_bits(x) << 16;
  v8 f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}
template <class E>
static inline float held(float x) {
  E e[1];
  put(e, 0, x);
  return get(e, 0);
}

// exp(x) for every float x: 2^n * e^r, n = round(x / ln 2), |r| <= ln 2 / 2, degree-6 Taylor polynomial for
// e^r. 2^n is built as 2^(n/2) * 2^(n - n/2) so that n from -150 to 128 stays in normal floats: large x give
// inf, very negative x give 0 (through denormals, as std::exp does), NaN stays NaN.
template <class V, class I>
static inline V exp_all(V x) {
  x = x < -104.f ? V{} - 104.f : x;  // e^-104 is below the smallest denormal
  x = x > 89.f ? V{} + 89.f : x;     // e^89 overflows float: inf
  V nr;
  const V p = exp_reduced(x, &nr);
  const I n = __builtin_convertvector(nr, I), n1 = n >> 1, n2 = n - n1;
  // 2^n1 and 2^n2 as a float's exponent bits
  const I b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  V f1, f2;
  std::memcpy(&f1, &b1, sizeof b1);
  std::memcpy(&f2, &b2, sizeof b2);
  return p * f1 * f2;
}
static inline v8 exp8(v8 x) { return exp_all<v8, i8>(x); }

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// 16 floats in one AVX-512 register: the bfloat16 rows of the element-wise ops go 16 values a step where the CPU
// has them (the same operations per value as the 8-wide path, so the same results).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16x16 __attribute__((vector_size(64)));
static inline v16 widen16(__m256i h) { return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16); }
static inline v16 ld16(const bf16* p) { return widen16(_mm256_loadu_si256((const __m256i*)p)); }
static inline void st16(bf16* p, v16 x) {
  const __m256bh h = _mm512_cvtneps_pbh((__m512)x);
  std::memcpy(p, &h, sizeof h);
}
static inline v16 held16(v16 x) { return widen16((__m256i)_mm512_cvtneps_pbh((__m512)x)); }
#define PAGEDNB_V16 1
#endif

// x * w / rms(x) for one row of N values; `in` may be `out`. In bfloat16, x / rms(x) is rounded before the
// gain multiplies it, as the torch RMSNorm rounds.
template <class E>
static inline void norm_row(E* out, const E* in, const E* w, int N, float eps) {
  v8 s0 = {}, s1 = {};
  int i = 0;
  for (; i + 16 <= N; i += 16) {
    const v8 a = ld(in + i), b = ld(in + i + 8);
    s0 += a * a;
    s1 += b * b;
  }
  for (; i + 8 <= N; i += 8) {
    const v8 a = ld(in + i);
    s0 += a * a;
  }
  float ss = hsum(s0 + s1);
  for (; i < N; i++) ss += get(in, i) * get(in, i);
  const float r = 1.f / std::sqrt(ss / N + eps);
  const v8 rv = splat(r);
  i = 0;
  for (; i + 8 <= N; i += 8) st(out + i, held<E>(ld(in + i) * rv) * ld(w + i));
  for (; i < N; i++) put(out, i, held<E>(get(in, i) * r) * get(w, i));
}

template <class E>
static void rms_norm(E* out, const E* x, const E* w, int64_t T, int N, float eps, int nt) {
#pragma omp parallel for num_threads(nt) if (worth_threads(T * N, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) norm_row(out + t * N, x + t * N, w, N, eps);
}

// sum = x + r, then out = rmsnorm(sum) * w; sum may be x or r (in place), out may be x or r but not sum.
template <class E>
static void add_rms_norm(E* out, E* sum, const E* x, const E* r, const E* w, int64_t T, int N, float eps,
                         int nt) {
#pragma omp parallel for num_threads(nt) if (worth_threads(T * N, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const E *xr = x + t * N, *rr = r + t * N;
    E* s = sum + t * N;
    int i = 0;
    for (; i + 8 <= N; i += 8) st(s + i, ld(xr + i) + ld(rr + i));
    for (; i < N; i++) put(s, i, get(xr, i) + get(rr, i));
    // the row just written, read back from L1
    norm_row(out + t * N, s, w, N, eps);
  }
}

// out [T, I] = silu(gate) * up, where each row of gate_up [T, 2I] is gate then up (silu(gate) rounded to E
// before the product, as torch's two ops round).
template <class E>
static void silu_mul(E* out, const E* gate_up, int64_t T, int I, int nt) {
#pragma omp parallel for num_threads(nt) if (worth_threads(T * I, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const E *g = gate_up + t * 2 * I, *u = g + I;
    E* o = out + t * I;
    int i = 0;
#ifdef PAGEDNB_V16
    if constexpr (sizeof(E) == 2)
      for (; i + 16 <= I; i += 16) {
        const v16 a = ld16(g + i);
        st16(o + i, held16(a / (1.f + exp_all<v16, i16x16>(-a))) * ld16(u + i));
      }
#endif
    for (; i + 8 <= I; i += 8) {
      const v8 a = ld(g + i);
      st(o + i, held<E>(a / (splat(1.f) + exp8(-a))) * ld(u + i));
    }
    for (; i < I; i++) put(o, i, held<E>(get(g, i) / (1.f + std::exp(-get(g, i)))) * get(u, i));
  }
}

// Rotate `nh` heads of D values (halves x1, x2: x1 cos - x2 sin, x2 cos + x1 sin) from `in` to `out` (which
// may be `in`). With a gain `w` of D values, each head is first RMS-normed over its D values (Qwen3's q_norm,
// k_norm) into `out`. cos and sin are float32 in every case.
template <class E>
static inline void rope_heads(E* out, const E* in, int nh, int D, const float* c, const float* s, const E* w,
                              float eps) {
  const int h2 = D / 2;
  for (int h = 0; h < nh; h++) {
    const E* a = in + h * D;
    E* o = out + h * D;
    if (w) {
      // normed into `out`, then rotated there
      norm_row(o, a, w, D, eps);
      a = o;
    }
    int i = 0;
    for (; i + 8 <= h2; i += 8) {
      const v8 x1 = ld(a + i), x2 = ld(a + h2 + i), cv = ld(c + i), sv = ld(s + i);
      st(o + i, x1 * cv - x2 * sv);
      st(o + h2 + i, x2 * cv + x1 * sv);
    }
    for (; i < h2; i++) {
      const float x1 = get(a, i), x2 = get(a, h2 + i);
      put(o, i, x1 * c[i] - x2 * s[i]);
      put(o, h2 + i, x2 * c[i] + x1 * s[i]);
    }
  }
}

// RoPE on q [T, H, D] and k [T, KVH, D] (rows `*_stride` values apart, heads contiguous), from `*_in` to
// `*_out` (the same pointer: in place); v [T, KVH, D] is copied from v_in to v_out when v_out is given.
// cos/sin: [max_pos, D/2] float32. q_w, k_w: the gains of a per-head RMSNorm (with `eps`) applied to q and k
// before RoPE, or null for none. Returns 0, or t + 1 for the first token t whose position is outside
// [0, max_pos) (then nothing is written).
template <class E>
static int64_t rope(E* q_out, int64_t qo_stride, const E* q_in, int64_t qi_stride, int H, E* k_out,
                    int64_t ko_stride, const E* k_in, int64_t ki_stride, int KVH, E* v_out, int64_t vo_stride,
                    const E* v_in, int64_t vi_stride, int64_t T, int D, const int64_t* pos, const float* cos,
                    const float* sin, int64_t max_pos, const E* q_w, const E* k_w, float eps, int nt) {
  for (int64_t t = 0; t < T; t++)
    if (pos[t] < 0 || pos[t] >= max_pos) return t + 1;
  const int h2 = D / 2;
#pragma omp parallel for num_threads(nt) if (worth_threads(T * (H + 2 * KVH) * D, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos + pos[t] * h2, *s = sin + pos[t] * h2;
    rope_heads(q_out + t * qo_stride, q_in + t * qi_stride, H, D, c, s, q_w, eps);
    rope_heads(k_out + t * ko_stride, k_in + t * ki_stride, KVH, D, c, s, k_w, eps);
    if (v_out) std::memcpy(v_out + t * vo_stride, v_in + t * vi_stride, sizeof(E) * KVH * D);
  }
  return 0;
}

// The C entry points, one per op and element type: _f32 for float32 rows, _bf16 for bfloat16 rows.
#define PAGEDNB_OPS(S, E)                                                                                   \
  extern "C" void pagednb_rms_norm_##S(E* out, const E* x, const E* w, int64_t T, int N, float eps, int nt) { \
    rms_norm(out, x, w, T, N, eps, nt);                                                                     \
  }                                                                                                         \
  extern "C" void pagednb_add_rms_norm_##S(E* out, E* sum, const E* x, const E* r, const E* w, int64_t T,   \
                                           int N, float eps, int nt) {                                      \
    add_rms_norm(out, sum, x, r, w, T, N, eps, nt);                                                         \
  }                                                                                                         \
  extern "C" void pagednb_silu_mul_##S(E* out, const E* gate_up, int64_t T, int I, int nt) {                \
    silu_mul(out, gate_up, T, I, nt);                                                                       \
  }                                                                                                         \
  extern "C" int64_t pagednb_rope_##S(E* q_out, int64_t qo_stride, const E* q_in, int64_t qi_stride, int H, \
                                      E* k_out, int64_t ko_stride, const E* k_in, int64_t ki_stride, int KVH, \
                                      E* v_out, int64_t vo_stride, const E* v_in, int64_t vi_stride,        \
                                      int64_t T, int D, const int64_t* pos, const float* cos,               \
                                      const float* sin, int64_t max_pos, const E* q_w, const E* k_w,        \
                                      float eps, int nt) {                                                  \
    return rope(q_out, qo_stride, q_in, qi_stride, H, k_out, ko_stride, k_in, ki_stride, KVH, v_out,        \
                vo_stride, v_in, vi_stride, T, D, pos, cos, sin, max_pos, q_w, k_w, eps, nt);               \
  }

PAGEDNB_OPS(f32, float)
PAGEDNB_OPS(bf16, bf16)
