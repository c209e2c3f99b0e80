// RMSNorm, residual add + RMSNorm, SiLU-and-multiply and RoPE, one pass each (notebook 04b_cpu_ops).
#include "cpu_vector.h"

// Rows are split among threads only when there is enough work to pay for waking them (a few microseconds).
static inline bool worth_threads(int64_t elems, int nt) { return nt > 1 && elems >= 32768; }

// exp(x) for every float x: 2^n * e^r, n = round(x / ln 2), |r| <= ln 2 / 2, degree-6 Taylor polynomial for
// e^r. 2^n is built as 2^(n/2) * 2^(n - n/2) so that n from -150 to 128 stays in normal floats: large x give
// inf, very negative x give 0 (through denormals, as std::exp does), NaN stays NaN.
static inline v8 exp8(v8 x) {
  x = x < splat(-104.f) ? splat(-104.f) : x;  // e^-104 is below the smallest denormal
  x = x > splat(89.f) ? splat(89.f) : x;      // e^89 overflows float: inf
  v8 nr;
  const v8 p = exp_reduced(x, &nr);
  const i8 n = __builtin_convertvector(nr, i8), n1 = n >> 1, n2 = n - n1;
  // 2^n1 and 2^n2 as a float's exponent bits
  const i8 b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  v8 f1, f2;
  std::memcpy(&f1, &b1, sizeof b1);
  std::memcpy(&f2, &b2, sizeof b2);
  return p * f1 * f2;
}

// x * w / rms(x) for one row of N floats; `in` may be `out`.
static inline void norm_row(float* out, const float* in, const float* w, int N, float eps) {
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
  for (; i < N; i++) ss += in[i] * in[i];
  const float r = 1.f / std::sqrt(ss / N + eps);
  const v8 rv = splat(r);
  i = 0;
  for (; i + 8 <= N; i += 8) st(out + i, ld(in + i) * rv * ld(w + i));
  for (; i < N; i++) out[i] = in[i] * r * w[i];
}

extern "C" void pagednb_rms_norm_f32(float* out, const float* x, const float* w, int64_t T, int N, float eps,
                                     int nt) {
#pragma omp parallel for num_threads(nt) if (worth_threads(T * N, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) norm_row(out + t * N, x + t * N, w, N, eps);
}

// sum = x + r, then out = rmsnorm(sum) * w; sum may be x or r (in place), out may be x or r but not sum.
extern "C" void pagednb_add_rms_norm_f32(float* out, float* sum, const float* x, const float* r,
                                         const float* w, int64_t T, int N, float eps, int nt) {
#pragma omp parallel for num_threads(nt) if (worth_threads(T * N, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float *xr = x + t * N, *rr = r + t * N;
    float* s = sum + t * N;
    int i = 0;
    for (; i + 8 <= N; i += 8) st(s + i, ld(xr + i) + ld(rr + i));
    for (; i < N; i++) s[i] = xr[i] + rr[i];
    // the row just written, read back from L1
    norm_row(out + t * N, s, w, N, eps);
  }
}

// out [T, I] = silu(gate) * up, where each row of gate_up [T, 2I] is gate then up.
extern "C" void pagednb_silu_mul_f32(float* out, const float* gate_up, int64_t T, int I, int nt) {
#pragma omp parallel for num_threads(nt) if (worth_threads(T * I, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float *g = gate_up + t * 2 * I, *u = g + I;
    float* o = out + t * I;
    int i = 0;
    for (; i + 8 <= I; i += 8) {
      const v8 a = ld(g + i);
      st(o + i, a / (splat(1.f) + exp8(-a)) * ld(u + i));
    }
    for (; i < I; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

// Rotate `nh` heads of D floats (halves x1, x2: x1 cos - x2 sin, x2 cos + x1 sin) from `in` to `out` (which
// may be `in`). With a gain `w` of D floats, each head is first RMS-normed over its D floats (Qwen3's q_norm,
// k_norm) into `out`.
static inline void rope_heads(float* out, const float* in, int nh, int D, const float* c, const float* s,
                              const float* w, float eps) {
  const int h2 = D / 2;
  for (int h = 0; h < nh; h++) {
    const float* a = in + h * D;
    float* o = out + h * D;
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
      const float x1 = a[i], x2 = a[h2 + i];
      o[i] = x1 * c[i] - x2 * s[i];
      o[h2 + i] = x2 * c[i] + x1 * s[i];
    }
  }
}

// RoPE on q [T, H, D] and k [T, KVH, D] (rows `*_stride` floats apart, heads contiguous), from `*_in` to
// `*_out` (the same pointer: in place); v [T, KVH, D] is copied from v_in to v_out when v_out is given.
// cos/sin: [max_pos, D/2]. q_w, k_w: the gains of a per-head RMSNorm (with `eps`) applied to q and k before
// RoPE, or null for none. Returns 0, or t + 1 for the first token t whose position is outside [0, max_pos)
// (then nothing is written).
extern "C" int64_t pagednb_rope_f32(float* q_out, int64_t qo_stride, const float* q_in, int64_t qi_stride,
                                    int H, float* k_out, int64_t ko_stride, const float* k_in,
                                    int64_t ki_stride, int KVH, float* v_out, int64_t vo_stride,
                                    const float* v_in, int64_t vi_stride, int64_t T, int D,
                                    const int64_t* pos, const float* cos, const float* sin, int64_t max_pos,
                                    const float* q_w, const float* k_w, float eps, int nt) {
  for (int64_t t = 0; t < T; t++)
    if (pos[t] < 0 || pos[t] >= max_pos) return t + 1;
  const int h2 = D / 2;
#pragma omp parallel for num_threads(nt) if (worth_threads(T * (H + 2 * KVH) * D, nt)) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos + pos[t] * h2, *s = sin + pos[t] * h2;
    rope_heads(q_out + t * qo_stride, q_in + t * qi_stride, H, D, c, s, q_w, eps);
    rope_heads(k_out + t * ko_stride, k_in + t * ki_stride, KVH, D, c, s, k_w, eps);
    if (v_out) std::memcpy(v_out + t * vo_stride, v_in + t * vi_stride, sizeof(float) * KVH * D);
  }
  return 0;
}
