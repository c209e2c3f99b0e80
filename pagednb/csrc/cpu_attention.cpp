// Paged attention on the CPU, reading each K/V page where it lies (notebook 04a_cpu_attention).
#include "cpu_vector.h"
#include <type_traits>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float hmax(v8 x) {
  float a = std::max(std::max(x[0], x[4]), std::max(x[1], x[5])),
        b = std::max(std::max(x[2], x[6]), std::max(x[3], x[7]));
  return std::max(a, b);
}

// Sum-reduce tokens: lane i of s[i] summed. Two levels give, for 4 vectors, [t0 t1 t2 t3 | t0 t1 t2 t3]
// halves; the third folds them.
static inline v8 half4(v8 s0, v8 s1, v8 s2, v8 s3) {
  const v8 a = __builtin_shufflevector(s0, s1, 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(s0, s1, 1, 9, 3, 11, 5, 13, 7, 15);
  const v8 b = __builtin_shufflevector(s2, s3, 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(s2, s3, 1, 9, 3, 11, 5, 13, 7, 15);
  return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
         __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
static inline v8 fold(v8 lo, v8 hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// A vector of V's width from any float address, and back: ld and st, named by type for softmax_page
template <class V>
static inline V load(const float* p);
template <>
inline v8 load<v8>(const float* p) { return ld(p); }
static inline void store(float* p, v8 x) { st(p, x); }
static inline v8 vexp(v8 x) { return exp_neg<v8, i8>(x); }

// The formats a cache may hold, each a storage type S and `load<V>(p)`: W = sizeof(V) / 4 elements at p as
// floats, converted in registers. float32 is loaded as it is; bfloat16 is a float's top half (a shift); float16
// has an instruction on x86 (F16C's vcvtph2ps); the two fp8 formats have none on a CPU, so their bits are moved
// into a float16's place and converted by that same instruction (or, without F16C, by to_float's integer ops).
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t u8x8 __attribute__((vector_size(8), aligned(1)));
typedef int16_t s16x8 __attribute__((vector_size(16), aligned(1)));
typedef int8_t s8x8 __attribute__((vector_size(8), aligned(1)));
template <class V>
struct Lanes;
template <>
struct Lanes<v8> {
  typedef i8 I;
  typedef u16x8 U16;
  typedef u8x8 U8;
  typedef s16x8 S16;
  typedef s8x8 S8;
};

// W unsigned elements (U: W of them) at p, each zero-extended to a 32-bit int
template <class U, class I, class S>
static inline I widen(const S* p) {
  U u;
  std::memcpy(&u, p, sizeof u);
  return __builtin_convertvector(u, I);
}

// N-bit floats (sign, exponent, M mantissa bits, exponent bias B) held in the low bits of x, as float32. A
// normal number keeps its mantissa, shifted to a float's place, and its exponent is rebiased by adding
// (127 - B) << 23; a subnormal (exponent 0) is its mantissa times 2^(1 - B - M); an all-ones exponent is inf or
// NaN, except in e4m3fn (FN: no inf), whose only NaN is all ones. Integer and float vector ops only: no table,
// no denormal floats on the way.
template <class V, class I, int N, int M, int B, bool FN>
static inline V to_float(I x) {
  constexpr int E = N - 1 - M, ALL = (1 << (N - 1)) - 1, TOP = FN ? ALL : ((1 << E) - 1) << M;
  const I em = x & ALL;
  I f = (em << (23 - M)) + ((127 - B) << 23);
  const V sub = __builtin_convertvector(em, V) * (1.f / (1 << (B + M - 1)));
  I sb, nan = I{} + 0x7fc00000;
  std::memcpy(&sb, &sub, sizeof sb);
  f = em < (1 << M) ? sb : f;
  f = FN ? (em == TOP ? nan : f) : (em >= TOP ? (em << (23 - M)) | 0x7f800000 : f);
  f |= (x >> (N - 1)) << 31;
  V out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}

// W float16 bit patterns as floats: one instruction with F16C (AVX-512 has its own 16-lane form), else to_float
template <class V>
static inline V halves(typename Lanes<V>::U16 h) {
  typedef typename Lanes<V>::I I;
  return to_float<V, I, 16, 10, 15, false>(__builtin_convertvector(h, I));
}
#if defined(__F16C__)
template <>
inline v8 halves<v8>(u16x8 h) {
  __m128i x;
  std::memcpy(&x, &h, sizeof x);
  const __m256 f = _mm256_cvtph_ps(x);
  v8 out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}
#endif

struct F32 {
  static constexpr float unit = 1.f;
  typedef float S;
  template <class V>
  static V load(const S* p) { return ::load<V>(p); }
};
struct BF16 {
  static constexpr float unit = 1.f;
  typedef uint16_t S;
  template <class V>
  static V load(const S* p) {
    typedef typename Lanes<V>::I I;
    const I f = widen<typename Lanes<V>::U16, I>(p) << 16;
    V out;
    std::memcpy(&out, &f, sizeof out);
    return out;
  }
};
struct F16 {
  static constexpr float unit = 1.f;
  typedef uint16_t S;
  template <class V>
  static V load(const S* p) {
    typename Lanes<V>::U16 h;
    std::memcpy(&h, p, sizeof h);
    return halves<V>(h);
  }
};
// W bytes at p, each widened to 16 bits
template <class V>
static inline typename Lanes<V>::U16 bytes(const uint8_t* p) {
  typename Lanes<V>::U8 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, typename Lanes<V>::U16);
}
// e5m2 is a float16's top byte: shifted there, it is that float16
struct E5M2 {
  static constexpr float unit = 1.f;
  typedef uint8_t S;
  template <class V>
  static V load(const S* p) { return halves<V>(bytes<V>(p) << 8); }
};
// e4m3fn: each byte sign-extended to 16 bits and shifted left by 7 puts its exponent and mantissa in bits 7-13 and
// its sign in bits 14 and 15; bit 14 cleared, that is a float16 of the same bits whose exponent is biased by 15
// instead of 7 (subnormals included): the value / 2^8. `unit` says so, and the kernels fold the 2^8 into the
// query's scale (K) and the output's (V). e4m3fn's NaN (S.1111.111), which the store never writes (it saturates),
// would read as +-480.
struct E4M3 {
  typedef uint8_t S;
  static constexpr float unit = 256.f;
  template <class V>
  static V load(const S* p) {
    typedef typename Lanes<V>::U16 U16;
    typename Lanes<V>::S8 b;
    std::memcpy(&b, p, sizeof b);
    const typename Lanes<V>::S16 h = __builtin_convertvector(b, typename Lanes<V>::S16) << 7;
    return halves<V>(__builtin_convertvector(h, U16) & 0xbfff);
  }
};
// 8 (kv8) or 16 (kv16) elements of a cache in format T as floats (/ T::unit); PF<T>: elements in a 64-byte
// cache line
template <class T>
static inline v8 kv8(const typename T::S* p) { return T::template load<v8>(p); }
template <class T>
constexpr int PF = 64 / sizeof(typename T::S);

#if defined(__AVX512F__)
// 16 floats, one AVX-512 register (the 16-lane decode below): its reductions and exp
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // the same, loaded from any float address
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 ld16(const float* p) { return *(const v16u*)p; }
static inline void st16(float* p, v16 x) { *(v16u*)p = x; }
template <>
inline v16 load<v16>(const float* p) { return ld16(p); }
static inline void store(float* p, v16 x) { st16(p, x); }

static inline v8 lo8(v16 x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8 hi8(v16 x) { return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline float hsum(v16 x) { return hsum(lo8(x) + hi8(x)); }
static inline float hmax(v16 x) {
  const v8 a = lo8(x), b = hi8(x);
  return hmax(a > b ? a : b);
}

static inline v16 vexp(v16 x) { return exp_neg<v16, i16>(x); }

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(1)));
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int16_t s16x16 __attribute__((vector_size(32), aligned(1)));
typedef int8_t s8x16 __attribute__((vector_size(16), aligned(1)));
template <>
struct Lanes<v16> {
  typedef i16 I;
  typedef u16x16 U16;
  typedef u8x16 U8;
  typedef s16x16 S16;
  typedef s8x16 S8;
};
template <>
inline v16 halves<v16>(u16x16 h) {
  __m256i x;
  std::memcpy(&x, &h, sizeof x);
  const __m512 f = _mm512_cvtph_ps(x);
  v16 out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}
template <class T>
static inline v16 kv16(const typename T::S* p) { return T::template load<v16>(p); }
#endif

// The online softmax of one head over one page's scores pg[0, n) (padded with -inf to whole vectors of V): pg
// becomes e^(score - max), and the running max m, sum l and accumulator acc[0, D) are brought up to date.
template <class V, int D>
static inline void softmax_page(float* __restrict pg, int n, float* m, float* l, float* __restrict acc) {
  constexpr int W = sizeof(V) / sizeof(float);
  const int nw = (n + W - 1) / W * W;
  for (int u = n; u < nw; u++) pg[u] = -INFINITY;
  V mv = V{} + *m;
  for (int u = 0; u < nw; u += W) {
    const V x = load<V>(pg + u);
    mv = mv > x ? mv : x;
  }
  const float mx = hmax(mv);
  V sum = {};
  for (int u = 0; u < nw; u += W) {
    const V e = vexp(load<V>(pg + u) - mx);
    store(pg + u, e);
    sum += e;
  }
  // a new maximum: rescale what was summed so far
  if (mx != *m) {
    const float c = std::exp(*m - mx);
    *l *= c;
    for (int d = 0; d < D; d += W) store(acc + d, load<V>(acc + d) * c);
    *m = mx;
  }
  *l += hsum(sum);
}

// A layer's window and soft cap on one page's scores pg[0, n): each becomes cap * tanh(score / cap) (Gemma 2) when
// cap > 0, and those before `start` (left of the sliding window) -inf.
static inline void cap_and_mask(float* pg, int start, int n, float cap) {
  if (cap > 0.f)
    for (int u = start; u < n; u++) pg[u] = cap * std::tanh(pg[u] / cap);
  for (int u = 0; u < start; u++) pg[u] = -INFINITY;
}

// Scores of NG query heads (scaled, qs[g*D..]) against 8 tokens of one page slice starting at kp (rows `row`
// apart) into p[g*PS + t0..].
template <class T, int NG, int D>
static inline void score8(float* __restrict p, int PS, const float* __restrict qs,
                          const typename T::S* __restrict kp, int64_t row, const typename T::S* kn) {
  constexpr int V = D / 8;
  v8 half[2][NG];
#pragma GCC unroll 16
  for (int hh = 0; hh < 2; hh++) {
    v8 s[NG][4];
#pragma GCC unroll 16
    for (int g = 0; g < NG; g++)
      for (int i = 0; i < 4; i++) s[g][i] = v8{};
    const typename T::S* k = kp + 4 * hh * row;
    if (kn)
      for (int i = 0; i < 4; i++)
        for (int d = 0; d < D; d += PF<T>) __builtin_prefetch(kn + (4 * hh + i) * row + d, 0, 1);
#pragma GCC unroll 16
    for (int c = 0; c < V; c++) {
      const v8 k0 = kv8<T>(k + 8 * c), k1 = kv8<T>(k + row + 8 * c), k2 = kv8<T>(k + 2 * row + 8 * c),
               k3 = kv8<T>(k + 3 * row + 8 * c);
#pragma GCC unroll 16
      for (int g = 0; g < NG; g++) {
        const v8 qv = ld(qs + g * D + 8 * c);
        s[g][0] += qv * k0;
        s[g][1] += qv * k1;
        s[g][2] += qv * k2;
        s[g][3] += qv * k3;
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < NG; g++) half[hh][g] = half4(s[g][0], s[g][1], s[g][2], s[g][3]);
  }
#pragma GCC unroll 16
  for (int g = 0; g < NG; g++) st(p + g * PS, fold(half[0][g], half[1][g]));
}

// acc rows of NG heads += p[g][u] * V[u] for u < lim; one head at a time, its accumulator row in registers (V
// re-read from L1).
template <class T, int NG, int D>
static inline void accumulate(float* __restrict acc, const float* __restrict p, int PS,
                              const typename T::S* __restrict vp, int64_t row, int lim, const typename T::S* vn,
                              int BS) {
  constexpr int V = D / 8;
  if (vn)
    for (int u = 0; u < BS; u++)
      for (int d = 0; d < D; d += PF<T>) __builtin_prefetch(vn + u * row + d, 0, 1);
  for (int g = 0; g < NG; g++) {
    v8 a[V];
#pragma GCC unroll 16
    for (int c = 0; c < V; c++) a[c] = ld(acc + g * D + 8 * c);
    for (int u = 0; u < lim; u++) {
      const v8 e = splat(p[g * PS + u]);
      const typename T::S* v = vp + u * row;
#pragma GCC unroll 16
      for (int c = 0; c < V; c++) a[c] += e * kv8<T>(v + 8 * c);
    }
#pragma GCC unroll 16
    for (int c = 0; c < V; c++) st(acc + g * D + 8 * c, a[c]);
  }
}

// One page slice for NG heads of one query token: scores, online softmax, V.
template <class T, int NG, int D>
static inline void page_block(float* __restrict acc, float* __restrict m, float* __restrict l,
                              float* __restrict p, int PS, const float* __restrict qs,
                              const typename T::S* __restrict kp, const typename T::S* __restrict vp, int64_t row,
                              int lim, int BS, const typename T::S* kn, const typename T::S* vn, int start,
                              float cap) {
  constexpr int V = D / 8;
  int t = 0;
  for (; t < lim && t + 8 <= BS; t += 8)
    score8<T, NG, D>(p + t, PS, qs, kp + t * row, row, kn ? kn + t * row : nullptr);
  for (; t < lim; t++)
    for (int g = 0; g < NG; g++) {
      v8 s0 = {};
      for (int c = 0; c < V; c++) s0 += ld(qs + g * D + 8 * c) * kv8<T>(kp + t * row + 8 * c);
      p[g * PS + t] = hsum(s0);
    }
  for (int g = 0; g < NG; g++) {
    cap_and_mask(p + g * PS, start, lim, cap);
    softmax_page<v8, D>(p + g * PS, lim, m + g, l + g, acc + g * D);
  }
  accumulate<T, NG, D>(acc, p, PS, vp, row, lim, vn, BS);
}

template <class T, int NG, int D>
static inline void page_blocks(float* acc, float* m, float* l, float* p, int PS, const float* qs,
                               const typename T::S* kp, const typename T::S* vp, int64_t row, int lim, int BS,
                               int G, const typename T::S* kn, const typename T::S* vn, int start, float cap) {
  // heads in blocks of up to NG (4), so that the scores' and V's accumulators stay in registers
  int g = 0;
  for (; g + NG <= G; g += NG, kn = vn = nullptr)
    page_block<T, NG, D>(acc + g * D, m + g, l + g, p, PS, qs + g * D, kp, vp, row, lim, BS, kn, vn, start, cap);
  switch (G - g) {
    case 1:
      page_block<T, 1, D>(acc + g * D, m + g, l + g, p, PS, qs + g * D, kp, vp, row, lim, BS, kn, vn, start,
                         cap);
      break;
    case 2:
      page_block<T, 2, D>(acc + g * D, m + g, l + g, p, PS, qs + g * D, kp, vp, row, lim, BS, kn, vn, start,
                         cap);
      break;
    case 3:
      page_block<T, 3, D>(acc + g * D, m + g, l + g, p, PS, qs + g * D, kp, vp, row, lim, BS, kn, vn, start,
                         cap);
      break;
  }
}

// The first n rows (D elements each, `row` apart) of a page slice in format T as floats (/ T::unit) at dst, D
// apart; rows n to BS - 1, which the scores read past a page's last token and then mask, as zeros.
template <class T, int D>
static inline void widen_rows(float* __restrict dst, const typename T::S* __restrict src, int64_t row, int n,
                              int BS) {
  for (int u = 0; u < n; u++)
#pragma GCC unroll 16
    for (int c = 0; c < D; c += 8) st(dst + u * D + c, kv8<T>(src + u * row + c));
  std::memset(dst + n * D, 0, sizeof(float) * (BS - n) * D);
}

// One sequence, kv heads [h0, h1): the G = H / KVH query heads of each, at each of its nq query tokens, page
// by page, from the first page holding a key of the first query's window (W: window, 0 for none; cap: soft cap,
// 0 for none), in a cache of format T; the output is multiplied by vscale. G is an argument, not a template
// parameter: heads go in blocks of 4 and the rest (page_blocks), so one function per format and head_dim serves
// every G.
template <class T, int D>
static void attend(float* __restrict out, const float* __restrict q, const void* kv, const void* vv,
                   const int32_t* __restrict bt, int L, int nq, int h0, int h1, int H, int KVH, int BS,
                   float scale, float* __restrict buf, int W, float cap, float vscale, int G) {
  typedef typename T::S S;
  const S *__restrict kc = (const S*)kv, *__restrict vc = (const S*)vv;
  scale *= T::unit;
  vscale *= T::unit;
  const int R = nq * G * (h1 - h0), PS = (BS + 15) & ~7;
  // acc, scaled q [R, D]; max m, sum l [R]; scores [G, PS]
  float *acc = buf, *qs = acc + R * D, *m = qs + R * D, *l = m + R, *p = l + R;
  std::memset(acc, 0, sizeof(float) * R * D);
  for (int r = 0; r < R; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  for (int h = h0; h < h1; h++)
    for (int j = 0; j < nq; j++)
      for (int g = 0; g < G; g++) {
        const float* src = q + ((int64_t)j * H + h * G + g) * D;
        float* dst = qs + (((h - h0) * nq + j) * G + g) * D;
        for (int d = 0; d < D; d++) dst[d] = src[d] * scale;
      }
  const int64_t row = (int64_t)KVH * D, page = BS * row;
  const int pages = (L + BS - 1) / BS;
  constexpr int NG = 4;
  // the first visible key of the first query: pages before its page are not read
  const int first = W > 0 ? std::max(0, L - nq - W + 1) : 0;
  // a cache in fewer bits than float32 is widened once per page slice for all of the tile's query tokens (into kw
  // and vw, BS rows of D floats each), not once for each of them
  const bool widen = nq > 1 && !std::is_same<T, F32>::value;
  float *kw = p + G * PS, *vw = kw + BS * D;
  for (int b = first / BS; b < pages; b++) {
    const int n = std::min(BS, L - b * BS);
    for (int h = h0; h < h1; h++) {
      const S* kp = kc + bt[b] * page + (int64_t)h * D;
      const S* vp = vc + bt[b] * page + (int64_t)h * D;
      // this head's slice of the next page, asked for row by row as the first query scores and sums this page
      const S* kn = b + 1 < pages ? kc + bt[b + 1] * page + (int64_t)h * D : nullptr;
      const S* vn = b + 1 < pages ? vc + bt[b + 1] * page + (int64_t)h * D : nullptr;
      // the tile's query tokens against this page slice, read as format F (T, or float32 once widened)
      auto queries = [&](auto fmt, const auto* k, const auto* v, int64_t stride, const auto* k_next,
                         const auto* v_next) {
        typedef decltype(fmt) F;
        for (int j = 0; j < nq; j++) {
          // causal: keys up to query token j's position
          const int lim = std::min(n, L - nq + j + 1 - b * BS);
          // window: keys after position (L - nq + j) - W
          const int start = W > 0 ? std::max(0, L - nq + j - W + 1 - b * BS) : 0;
          if (lim <= 0 || start >= lim) continue;
          const int r0 = ((h - h0) * nq + j) * G;
          page_blocks<F, NG, D>(acc + r0 * D, m + r0, l + r0, p, PS, qs + r0 * D, k, v, stride, lim, BS, G,
                                j ? nullptr : k_next, j ? nullptr : v_next, start, cap);
        }
      };
      if (!widen) {
        queries(T{}, kp, vp, row, kn, vn);
        continue;
      }
      widen_rows<T, D>(kw, kp, row, n, BS);
      widen_rows<T, D>(vw, vp, row, n, BS);
      queries(F32{}, (const float*)kw, (const float*)vw, (int64_t)D, (const float*)nullptr, (const float*)nullptr);
    }
  }
  for (int h = h0; h < h1; h++)
    for (int j = 0; j < nq; j++)
      for (int g = 0; g < G; g++) {
        const int r = ((h - h0) * nq + j) * G + g;
        float* dst = out + ((int64_t)j * H + h * G + g) * D;
        const float inv = l[r] > 0.f ? vscale / l[r] : 0.f;
        for (int d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
      }
}

#if defined(__AVX512F__)
// Decodes (one query token) with 16 floats to a vector, for CPUs with AVX-512. The kernel above scores 8 tokens
// against 8-lane vectors and sums V once per query head; here a head_dim-64 row is 4 vectors, the scores of 16
// tokens are reduced together, and each V row is loaded once for all of a kv head's query heads.

// Four tokens' products (a vector each) -> one vector whose 128-bit lane j holds, for each token in turn, the sum
// of its lane j.
static inline v16 sum4(v16 a, v16 b, v16 c, v16 d) {
  // within each lane: [a0+a2, b0+b2, a1+a3, b1+b3]
  const v16 ab = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                 __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  const v16 cd = __builtin_shufflevector(c, d, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                 __builtin_shufflevector(c, d, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  return __builtin_shufflevector(ab, cd, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(ab, cd, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
// Four sum4 results (tokens 0-3, 4-7, 8-11, 12-15) -> the 16 tokens' totals in order: lane k of the result adds
// up the four 128-bit lanes of u_k.
#define LANES(a, b, c, d) 4 * a, 4 * a + 1, 4 * a + 2, 4 * a + 3, 4 * b, 4 * b + 1, 4 * b + 2, 4 * b + 3, \
                          4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3, 4 * d, 4 * d + 1, 4 * d + 2, 4 * d + 3
static inline v16 sum_lanes(v16 u0, v16 u1, v16 u2, v16 u3) {
  const v16 a = __builtin_shufflevector(u0, u1, LANES(0, 2, 4, 6)) +
                __builtin_shufflevector(u0, u1, LANES(1, 3, 5, 7));
  const v16 b = __builtin_shufflevector(u2, u3, LANES(0, 2, 4, 6)) +
                __builtin_shufflevector(u2, u3, LANES(1, 3, 5, 7));
  return __builtin_shufflevector(a, b, LANES(0, 2, 4, 6)) + __builtin_shufflevector(a, b, LANES(1, 3, 5, 7));
}
#undef LANES

// Scores of NG heads (scaled, qs[g*D..]) against the n tokens of one page slice at kp, 16 at a time, into
// p[g*PS..]; tokens past n read row n - 1 (inside the page) and are masked by the caller.
template <class T, int NG, int D>
static inline void scores16(float* __restrict p, int PS, const float* __restrict qs,
                            const typename T::S* __restrict kp, int64_t row, int n, const typename T::S* kn) {
  constexpr int C = D / 16;
  v16 q[NG][C];
#pragma GCC unroll 16
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < C; c++) q[g][c] = ld16(qs + g * D + 16 * c);
  for (int t0 = 0; t0 < n; t0 += 16) {
    alignas(64) float u[NG][4][16];
#pragma GCC unroll 4
    for (int qd = 0; qd < 4; qd++) {
      const typename T::S* k[4];
      for (int i = 0; i < 4; i++) k[i] = kp + std::min(t0 + 4 * qd + i, n - 1) * row;
      if (kn)
        for (int i = 0; i < 4; i++)
          for (int d = 0; d < D; d += PF<T>) __builtin_prefetch(kn + (t0 + 4 * qd + i) * row + d, 0, 1);
      v16 s[NG][4];
#pragma GCC unroll 16
      for (int i = 0; i < 4; i++) {
        const v16 kv = kv16<T>(k[i]);
        for (int g = 0; g < NG; g++) s[g][i] = q[g][0] * kv;
      }
#pragma GCC unroll 16
      for (int c = 1; c < C; c++)
        for (int i = 0; i < 4; i++) {
          const v16 kv = kv16<T>(k[i] + 16 * c);
          for (int g = 0; g < NG; g++) s[g][i] += q[g][c] * kv;
        }
#pragma GCC unroll 16
      for (int g = 0; g < NG; g++) st16(u[g][qd], sum4(s[g][0], s[g][1], s[g][2], s[g][3]));
    }
#pragma GCC unroll 16
    for (int g = 0; g < NG; g++)
      st16(p + g * PS + t0, sum_lanes(ld16(u[g][0]), ld16(u[g][1]), ld16(u[g][2]), ld16(u[g][3])));
  }
}

// One page slice for NG heads of one kv head: scores, online softmax, then each V row once for all NG heads.
template <class T, int NG, int D>
static inline void page16(float* __restrict acc, float* __restrict m, float* __restrict l, float* __restrict p,
                          int PS, const float* __restrict qs, const typename T::S* __restrict kp,
                          const typename T::S* __restrict vp, int64_t row, int n, int BS, const typename T::S* kn,
                          const typename T::S* vn, int start, float cap) {
  constexpr int C = D / 16;
  scores16<T, NG, D>(p, PS, qs, kp, row, n, kn);
  for (int g = 0; g < NG; g++) {
    cap_and_mask(p + g * PS, start, n, cap);
    softmax_page<v16, D>(p + g * PS, n, m + g, l + g, acc + g * D);
  }
  v16 a[NG][C];
#pragma GCC unroll 16
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < C; c++) a[g][c] = ld16(acc + g * D + 16 * c);
  for (int u = 0; u < n; u++) {
    if (vn)
      for (int d = 0; d < D; d += PF<T>) __builtin_prefetch(vn + u * row + d, 0, 1);
    v16 v[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) v[c] = kv16<T>(vp + u * row + 16 * c);
#pragma GCC unroll 16
    for (int g = 0; g < NG; g++) {
      const float e = p[g * PS + u];
      for (int c = 0; c < C; c++) a[g][c] += e * v[c];
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < NG; g++)
    for (int c = 0; c < C; c++) st16(acc + g * D + 16 * c, a[g][c]);
}

// The G query heads of one kv head in blocks of up to NG, so that their q and V sums stay in registers.
template <class T, int NG, int D>
static inline void heads16(float* acc, float* m, float* l, float* p, int PS, const float* qs,
                           const typename T::S* kp, const typename T::S* vp, int64_t row, int n, int BS, int G,
                           const typename T::S* kn, const typename T::S* vn, int start, float cap) {
  int g = 0;
  for (; g + NG <= G; g += NG, kn = vn = nullptr)
    page16<T, NG, D>(acc + g * D, m + g, l + g, p, PS, qs + g * D, kp, vp, row, n, BS, kn, vn, start, cap);
  const int rest = G - g;
  float *a = acc + g * D, *mg = m + g, *lg = l + g;
  const float* q = qs + g * D;
  switch (rest) {
    case 1: page16<T, 1, D>(a, mg, lg, p, PS, q, kp, vp, row, n, BS, kn, vn, start, cap); break;
    case 2: page16<T, 2, D>(a, mg, lg, p, PS, q, kp, vp, row, n, BS, kn, vn, start, cap); break;
    case 3: page16<T, 3, D>(a, mg, lg, p, PS, q, kp, vp, row, n, BS, kn, vn, start, cap); break;
  }
}

// attend for a single query token (nq = 1), 16 floats to a vector; the same arguments.
template <class T, int D>
static void decode16(float* __restrict out, const float* __restrict q, const void* kv, const void* vv,
                     const int32_t* __restrict bt, int L, int nq, int h0, int h1, int H, int KVH, int BS,
                     float scale, float* __restrict buf, int W, float cap, float vscale, int G) {
  typedef typename T::S S;
  const S *__restrict kc = (const S*)kv, *__restrict vc = (const S*)vv;
  scale *= T::unit;
  vscale *= T::unit;
  const int R = G * (h1 - h0), PS = (BS + 15) & ~15;
  // acc, scaled q [R, D]; max m, sum l [R]; scores [NG, PS]
  float *acc = buf, *qs = acc + R * D, *m = qs + R * D, *l = m + R, *p = l + R;
  std::memset(acc, 0, sizeof(float) * R * D);
  for (int r = 0; r < R; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  for (int r = 0; r < R; r++)
    for (int d = 0; d < D; d++) qs[r * D + d] = q[(int64_t)(h0 * G + r) * D + d] * scale;
  const int64_t row = (int64_t)KVH * D, page = BS * row;
  const int pages = (L + BS - 1) / BS;
  // up to 4 heads a block at head_dim <= 64, 2 above
  constexpr int NG = D <= 64 ? 4 : 2;
  // the query is position L - 1: with a window it sees keys from L - W, and pages before that one are not read
  const int first = W > 0 ? std::max(0, L - W) : 0;
  for (int b = first / BS; b < pages; b++) {
    const int n = std::min(BS, L - b * BS), start = std::max(0, first - b * BS);
    for (int h = h0; h < h1; h++) {
      const int64_t off = (int64_t)h * D;
      const bool next = b + 1 < pages;
      const int r0 = (h - h0) * G;
      heads16<T, NG, D>(acc + r0 * D, m + r0, l + r0, p, PS, qs + r0 * D, kc + bt[b] * page + off,
                     vc + bt[b] * page + off, row, n, BS, G, next ? kc + bt[b + 1] * page + off : nullptr,
                     next ? vc + bt[b + 1] * page + off : nullptr, start, cap);
    }
  }
  for (int r = 0; r < R; r++) {
    float* dst = out + (int64_t)(h0 * G + r) * D;
    const float inv = l[r] > 0.f ? vscale / l[r] : 0.f;
    for (int d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
  }
}
#define DECODE16(T, D) decode16<T, D>
#else
#define DECODE16(T, D) nullptr
#endif

typedef void (*attend_fn)(float*, const float*, const void*, const void*, const int32_t*, int, int, int, int,
                          int, int, int, float, float*, int, float, float, int);
// The kernel for a cache of format T and head_dim D: attend, or with `decode` the 16-lane decode16 (none without
// AVX-512).
template <class T>
static attend_fn pick_d(int D, bool decode) {
  switch (D) {
    case 16: return decode ? DECODE16(T, 16) : attend<T, 16>;
    case 32: return decode ? DECODE16(T, 32) : attend<T, 32>;
    case 64: return decode ? DECODE16(T, 64) : attend<T, 64>;
    case 128: return decode ? DECODE16(T, 128) : attend<T, 128>;
  }
  return nullptr;
}
// The kernel for a cache of format `dtype` (0 float32, 1 float16, 2 bfloat16, 3 fp8 e4m3fn, 4 fp8 e5m2)
// for G = H / KVH query heads per kv head, 1 to 8
static attend_fn pick(int G, int D, bool decode = false, int dtype = 0) {
  if (G < 1 || G > 8) return nullptr;
  switch (dtype) {
    case 0: return pick_d<F32>(D, decode);
    case 1: return pick_d<F16>(D, decode);
    case 2: return pick_d<BF16>(D, decode);
    case 3: return pick_d<E4M3>(D, decode);
    case 4: return pick_d<E5M2>(D, decode);
  }
  return nullptr;
}

// Was the 16-lane decode kernel compiled for G = H / KVH and D? (only where the compiler targets AVX-512)
extern "C" int pagednb_wide_decode(int H, int KVH, int D) {
  return KVH > 0 && H % KVH == 0 && pick(H / KVH, D, true) != nullptr;
}

extern "C" int pagednb_supports(int H, int KVH, int D) {
  return KVH > 0 && H % KVH == 0 && pick(H / KVH, D) != nullptr;
}

// The caches hold `dtype` (see pick), each element x / k_scale (K) or x / v_scale (V): the scores take k_scale
// with the query's scale, the output v_scale with the softmax's sum, so no element is multiplied.
extern "C" int pagednb_paged_attention(float* out, const float* query, const void* k_cache, const void* v_cache,
                                       const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
                                       const int32_t* qsl, const int32_t* seqs, int64_t n_seqs, int H, int KVH,
                                       int D, int BS, float scale, int num_threads, int wide, int window,
                                       float softcap, int dtype, float k_scale, float v_scale) {
  attend_fn fn = pagednb_supports(H, KVH, D) ? pick(H / KVH, D, false, dtype) : nullptr;
  if (!fn) return 2;
  scale *= k_scale;
  // single query tokens (decodes) on the 16-lane kernel where it was compiled and `wide` asks for it
  const attend_fn wide_fn = wide ? pick(H / KVH, D, true, dtype) : nullptr, one = wide_fn ? wide_fn : fn;
  // work items: tiles of up to QT query tokens of one sequence (each page is then read once per tile, not per
  // token), by whole sequences' kv heads when there are plenty of tiles, else one kv head each so that every
  // thread has work
  constexpr int QT = 16;
  // (index into seqs) * 2^20 + first query token
  std::vector<int64_t> tiles;
  for (int64_t i = 0; i < n_seqs; i++) {
    const int nq = qsl[seqs[i] + 1] - qsl[seqs[i]];
    // the costliest (last) tiles first
    for (int j0 = ((nq - 1) / QT) * QT; j0 >= 0; j0 -= QT) tiles.push_back(i * (1 << 20) + j0);
  }
  const int64_t n_tiles = tiles.size();
  const int split = n_tiles >= 4 * num_threads ? 1 : KVH, per_item = KVH / split;
  // per thread: acc and scaled q, m and l of R rows; the scores; a widened K and V page slice (attend)
  const int64_t R = (int64_t)QT * (H / KVH) * per_item;
  const int64_t per = R * (2 * D + 2) + (H / KVH) * (BS + 16) + 2 * BS * D + 16;
  const int64_t work = n_tiles * split;
  int err = 0;
#pragma omp parallel num_threads(num_threads)
  {
    float* buf = (float*)std::malloc(sizeof(float) * per);
    if (!buf) {
#pragma omp atomic write
      err = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; w++) {
      if (!buf) continue;
      const int64_t tile = tiles[w / split];
      const int s = seqs[tile >> 20], j0 = tile & ((1 << 20) - 1), h0 = (w % split) * per_item;
      const int nq = qsl[s + 1] - qsl[s], j1 = std::min(nq, j0 + QT);
      const int64_t off = ((int64_t)qsl[s] + j0) * H * D;
      // the tile's queries are the last j1 - j0 of a sequence cut after its (j1 - 1)-th query token
      const attend_fn f = j1 - j0 == 1 ? one : fn;
      f(out + off, query + off, k_cache, v_cache, block_tables + s * bt_stride, seq_lens[s] - (nq - j1), j1 - j0,
        h0, h0 + per_item, H, KVH, BS, scale, buf, window, softcap, v_scale, H / KVH);
    }
    std::free(buf);
  }
  return err;
}

// The slot-mapping store (vLLM's reshape_and_cache): token t's K and V rows go to slot slots[t] of the caches
// (slot -1: padding, skipped), each element x / scale rounded to the cache's format in registers, 8 at a time, as
// torch's `(x / scale).clamp(-largest, largest).to(dtype)` rounds it, bit for bit: to nearest, ties to even,
// saturated at the format's largest finite value (a finite x never becomes inf; NaN stays NaN).
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline u32x8 bits_of(v8 x) {
  u32x8 u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// |x| as float32 bits a (at most the format's largest value, or NaN) -> the bits of an N-bit float with M mantissa
// bits and exponent bias B (FN: e4m3fn, whose only NaN is all ones), rounded to nearest even, in integer ops only.
// A normal result drops 23 - M mantissa bits with a rounding add and rebiases the exponent; a subnormal one (below
// the smallest normal, 2^(1 - B)) is the mantissa with its leading 1 shifted right so that its unit is
// 2^(1 - B - M), rounded the same way: no denormal float on the way.
template <int N, int M, int B, bool FN>
static inline u32x8 from_float(u32x8 a) {
  constexpr int S = 23 - M;
  const u32x8 one = u32x8{} + 1, normal = ((a + ((1u << (S - 1)) - 1) + ((a >> S) & 1)) >> S) - ((127 - B) << M);
  const u32x8 e = a >> 23, m = (a & 0x7fffff) | (e > 0 ? u32x8{} + 0x800000 : u32x8{});
  u32x8 sh = (u32x8{} + (151 - B - M)) - (e > 0 ? e : one);  // m * 2^(e - 150) in units of 2^(1 - B - M): m >> sh
  sh = sh > 30 ? u32x8{} + 30 : sh;                                 // beyond 30: m < 2^24 rounds to 0 anyway
  const u32x8 q = m >> sh, rem = m & ((one << sh) - 1), half = one << (sh - 1);
  const u32x8 up = (rem > half) | ((rem == half) & ((q & 1) == 1));  // -1 where rounding goes up
  const u32x8 sub = q - up;
  constexpr unsigned NAN_BITS = FN ? (1u << (N - 1)) - 1 : ((1u << (N - 1 - M)) - 1) << M | 1u << (M - 1);
  const u32x8 r = a < ((128u - B) << 23) ? sub : normal;
  return a > 0x7f800000u ? u32x8{} + NAN_BITS : r;
}

// x saturated at +-largest (NaN passes through: both comparisons are false)
static inline v8 saturate(v8 x, float largest) {
  x = x > largest ? splat(largest) : x;
  return x < -largest ? splat(-largest) : x;
}

// Each format's `put`: 8 floats (x / scale, not yet saturated) stored at p, rounded to the format
template <int N, int M, int B, bool FN, class S>
static inline void put_small(S* p, v8 x, float largest) {
  const u32x8 u = bits_of(saturate(x, largest));
  const u32x8 r = from_float<N, M, B, FN>(u & 0x7fffffff) | ((u >> 31) << (N - 1));
  typedef S out_t __attribute__((vector_size(8 * sizeof(S)), aligned(1)));
  const out_t o = __builtin_convertvector(r, out_t);
  std::memcpy(p, &o, sizeof o);
}
struct PutF32 {
  typedef float S;
  static void put(S* p, v8 x) { st(p, saturate(x, 3.40282347e38f)); }
};
struct PutBF16 {
  typedef uint16_t S;
  static void put(S* p, v8 x) {
    const u32x8 u = bits_of(saturate(x, 3.38953139e38f)), a = u & 0x7fffffff;
    const u32x8 r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;       // to nearest even: the dropped half rounds up
    const u32x8 out = a > 0x7f800000u ? ((u >> 16) & 0x8000) | 0x7fc0 : r;
    const u16x8 o = __builtin_convertvector(out, u16x8);
    std::memcpy(p, &o, sizeof o);
  }
};
struct PutF16 {
  typedef uint16_t S;
#if defined(__F16C__)
  static void put(S* p, v8 x) {
    __m256 f;
    const v8 y = saturate(x, 65504.f);
    std::memcpy(&f, &y, sizeof f);
    const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(p, &h, sizeof h);
  }
#else
  static void put(S* p, v8 x) { put_small<16, 10, 15, false>(p, x, 65504.f); }
#endif
};
struct PutE5M2 {
  typedef uint8_t S;
  static void put(S* p, v8 x) { put_small<8, 2, 15, false>(p, x, 57344.f); }
};
struct PutE4M3 {
  typedef uint8_t S;
  static void put(S* p, v8 x) { put_small<8, 3, 7, true>(p, x, 448.f); }
};

// One cache's rows: token t's row (row elements of format In) / scale into slot slots[t] of a cache of format Out.
template <class In, class Out>
static void store_rows(typename Out::S* cache, const typename In::S* x, const int64_t* slots, int64_t T,
                       int64_t row, float scale) {
  for (int64_t t = 0; t < T; t++) {
    if (slots[t] < 0) continue;
    typename Out::S* dst = cache + slots[t] * row;
    const typename In::S* src = x + t * row;
    int64_t i = 0;
    for (; i + 8 <= row; i += 8) Out::put(dst + i, In::template load<v8>(src + i) / scale);
    if (i < row) {                                 // the last row % 8 elements, through a zero-padded vector
      typename In::S pad[8] = {};
      typename Out::S res[8];
      std::memcpy(pad, src + i, sizeof(pad[0]) * (row - i));
      Out::put(res, In::template load<v8>(pad) / scale);
      std::memcpy(dst + i, res, sizeof(res[0]) * (row - i));
    }
  }
}

// Rows of `bytes` bytes copied as they are: a row already in the cache's format and unscaled (as torch's store, which
// keeps even an inf there)
static void copy_rows(char* cache, const char* x, const int64_t* slots, int64_t T, int64_t bytes) {
  for (int64_t t = 0; t < T; t++)
    if (slots[t] >= 0) std::memcpy(cache + slots[t] * bytes, x + t * bytes, bytes);
}

// Rows of format In into a cache of format `out` (as in pick: 0 float32, 1 float16, 2 bfloat16, 3 e4m3fn, 4 e5m2)
template <class In>
static int store_from(void* cache, const void* x, const int64_t* slots, int64_t T, int64_t row, int out, float s) {
  const typename In::S* src = (const typename In::S*)x;
  switch (out) {
    case 0: store_rows<In, PutF32>((float*)cache, src, slots, T, row, s); return 0;
    case 1: store_rows<In, PutF16>((uint16_t*)cache, src, slots, T, row, s); return 0;
    case 2: store_rows<In, PutBF16>((uint16_t*)cache, src, slots, T, row, s); return 0;
    case 3: store_rows<In, PutE4M3>((uint8_t*)cache, src, slots, T, row, s); return 0;
    case 4: store_rows<In, PutE5M2>((uint8_t*)cache, src, slots, T, row, s); return 0;
  }
  return 2;
}

static int store_cache(void* cache, const void* x, const int64_t* slots, int64_t T, int64_t row, int in, int out,
                       float scale) {
  static const int64_t size[] = {4, 2, 2, 1, 1};
  if (in == out && scale == 1.f && in >= 0 && in < 5) {
    copy_rows((char*)cache, (const char*)x, slots, T, row * size[in]);
    return 0;
  }
  switch (in) {
    case 0: return store_from<F32>(cache, x, slots, T, row, out, scale);
    case 1: return store_from<F16>(cache, x, slots, T, row, out, scale);
    case 2: return store_from<BF16>(cache, x, slots, T, row, out, scale);
  }
  return 2;
}

// store_kv: token t's K and V rows (row elements of format `in`: 0 float32, 1 float16, 2 bfloat16) into slot
// slots[t] of caches of format `out` (see pick), K as key / k_scale and V as value / v_scale; slot -1 is skipped.
// 0: done; 2: no such pair of formats (nothing written).
extern "C" int pagednb_store_kv(void* k_cache, void* v_cache, const void* key, const void* value,
                                const int64_t* slots, int64_t T, int64_t row, int in, int out, float k_scale,
                                float v_scale) {
  if (in < 0 || in > 2 || out < 0 || out > 4) return 2;
  store_cache(k_cache, key, slots, T, row, in, out, k_scale);
  return store_cache(v_cache, value, slots, T, row, in, out, v_scale);
}
