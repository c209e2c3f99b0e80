// Prompt-chunk attention on AMX tiles (notebook 04c_amx_attention): the query tokens of one sequence against
// every key they see, read from the paged bfloat16 cache. The products run on the tile unit (TDPBF16PS: a
// 16 x 32 bfloat16 tile times a 32 x 16 one, summed in float32), the online softmax on AVX-512 between them.
#include "cpu_vector.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define PAGEDNB_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <memory>
#include <new>
#else
#define PAGEDNB_AMX 0
#endif

// Was the kernel compiled for tiles (the compiler targets a CPU with AMX-BF16)?
extern "C" int pagednb_amx_compiled() { return PAGEDNB_AMX; }

#if PAGEDNB_AMX
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

// Linux hands a process the tile registers' state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, Linux 5.16 and later); asked once
static bool tiles_granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// The eight tiles, each 16 rows of 64 bytes (palette 1), by number (GCC's tile intrinsics take literals only):
// 0 and 1 scores, 2 queries, 3 and 4 keys, 5 probabilities, 6 values, 7 a slice of P V
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; t++) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// A block of up to KB keys is scored, softmaxed and summed into the accumulators at once (32 at a time on the
// tiles): the accumulators are rescaled once per block
constexpr int KB = 128;

// The keys and values one kv head sees, repacked so that each B tile is 1 KB in a row. KT: [D / 32][LP / 16] tiles
// of K transposed by pairs of dimensions, 16 pairs x 16 keys of 32-bit words (a word: K[j][2r], K[j][2r + 1]). VV:
// [LP / 32][D / 16] tiles of V with pairs of keys interleaved, 16 key pairs x 16 dimensions x 2. LP: the keys
// rounded up to KB, the padding zero.
struct Packed {
  uint32_t* kt;
  uint16_t* vv;
  int lp;
};
static inline const uint32_t* k_tile(Packed p, int c, int u0) { return p.kt + ((int64_t)c * (p.lp / 16) + u0 / 16) * 256; }
static inline const uint16_t* v_tile(Packed p, int c, int u0, int D) {
  return p.vv + ((int64_t)(u0 / 32) * (D / 16) + c) * 512;
}

// The permutes of a 16 x 16 transpose of 32-bit words: round s (8, 4, 2, 1) swaps the s x s blocks off the
// diagonal between rows j and j + s (j without bit s): lane l of row j takes row j + s's lane l - s where l has
// bit s, and row j + s's lane l takes row j's lane l + s where it has not (indices >= 16: the second register)
struct TransposeIndex {
  alignas(64) int32_t lo[4][16], hi[4][16];
  TransposeIndex() {
    for (int k = 0, s = 8; s >= 1; k++, s /= 2)
      for (int l = 0; l < 16; l++) {
        lo[k][l] = (l & s) ? 16 + l - s : l;
        hi[k][l] = (l & s) ? 16 + l : l + s;
      }
  }
};

// 16 keys' 32-bit words [16 c, 16 c + 16) (key j's at k[j]) transposed into the K tile kt: word r of key j to
// kt[16 r + j]
static inline void transpose16(uint32_t* kt, const uint32_t* const* k, int c) {
  static const TransposeIndex ix;
  __m512i x[16];
  for (int j = 0; j < 16; j++) x[j] = _mm512_loadu_si512(k[j] + 16 * c);
  for (int r = 0, s = 8; s >= 1; r++, s /= 2) {
    const __m512i lo = _mm512_load_si512(ix.lo[r]), hi = _mm512_load_si512(ix.hi[r]);
    for (int j = 0; j < 16; j++) {
      if (j & s) continue;
      const __m512i a = x[j], b = x[j + s];
      x[j] = _mm512_permutex2var_epi32(a, lo, b);
      x[j + s] = _mm512_permutex2var_epi32(a, hi, b);
    }
  }
  for (int r = 0; r < 16; r++) _mm512_storeu_si512(kt + 16 * r, x[r]);
}

// 32 keys' values v[0..32) (D each), dimensions [16 c, 16 c + 16), into the V tile vv: pairs of keys interleaved
static inline void interleave32(uint16_t* vv, const uint16_t* const* v, int c) {
  alignas(64) static const int16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                              8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i perm = _mm512_load_si512(idx);
  for (int r = 0; r < 16; r++) {
    const __m256i a = _mm256_loadu_si256((const __m256i*)(v[2 * r] + 16 * c));
    const __m256i b = _mm256_loadu_si256((const __m256i*)(v[2 * r + 1] + 16 * c));
    const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    _mm512_storeu_si512(vv + 32 * r, _mm512_permutexvar_epi16(perm, ab));
  }
}

// Kv head h's keys and values [lo, L) read through the block table into p, 32 keys at a time (zeros past L)
static void pack_head(Packed p, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* block_table,
                      int lo, int L, int h, int KVH, int D, int BS) {
  alignas(64) static const uint16_t zero[256] = {};
  const uint16_t* k[32];
  const uint16_t* v[32];
  for (int u0 = 0; u0 < p.lp; u0 += 32) {
    for (int j = 0; j < 32; j++) {
      const int pos = lo + u0 + j;
      const int64_t at = pos < L ? (((int64_t)block_table[pos / BS] * BS + pos % BS) * KVH + h) * D : 0;
      k[j] = pos < L ? k_cache + at : zero;
      v[j] = pos < L ? v_cache + at : zero;
    }
    for (int c = 0; c < D / 32; c++) {
      transpose16((uint32_t*)k_tile(p, c, u0), (const uint32_t* const*)k, c);
      transpose16((uint32_t*)k_tile(p, c, u0 + 16), (const uint32_t* const*)(k + 16), c);
    }
    for (int c = 0; c < D / 16; c++) interleave32((uint16_t*)v_tile(p, c, u0, D), v, c);
  }
}

// One query tile's state: 16 rows (a row: a query token and one head of the kv head's group), each with its
// position, running max m and sum l (lane i: row i), and accumulator acc[16][D]
struct Rows {
  int pos[16];
  v16 m, l;
  float* acc;
};

static inline float vmax(v16 x) {
  __m512 a;
  std::memcpy(&a, &x, 64);
  return _mm512_reduce_max_ps(a);
}
static inline float vsum(v16 x) {
  __m512 a;
  std::memcpy(&a, &x, 64);
  return _mm512_reduce_add_ps(a);
}
// 32 floats as bfloat16 (rounded to nearest even), x0's first
static inline void to_bf16(uint16_t* dst, v16 x0, v16 x1) {
  const __m512bh b = _mm512_cvtne2ps_pbh(x1, x0);
  std::memcpy(dst, &b, 64);
}

// A score no row sees: finite, so that it needs no test on the way (-inf - -inf would be NaN), and so low that
// 2^(its scaled distance from any real score) is 0
constexpr float UNSEEN = -1e30f;

// 2^y for 16 finite floats y <= 0: 2^n * 2^f with n = round(y), |f| <= 1/2, 2^f = e^(f ln 2) by its Taylor
// polynomial of degree 5 (relative error below 3e-6), and AVX-512's scalef for 2^n (0 for y below -150)
static inline v16 exp2v(v16 y) {
  const __m512 x = y;
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The largest of row i's raw scores s[0, nk) (keys from position k0); on an edge block (some row does not see
// some key) the unseen ones become UNSEEN first
static inline float row_max(float* s, int nk, int pos, int k0, int window, bool edge) {
  const i16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int before = window > 0 ? pos - window : INT32_MIN;
  v16 mx = v16{} + UNSEEN;
  for (int u = 0; u < nk; u += 16) {
    v16 x = *(const v16u*)(s + u);
    if (edge) {
      const i16 k = iota + (k0 + u);
      x = (k > pos) | (k <= before) ? v16{} + UNSEEN : x;
      *(v16u*)(s + u) = x;
    }
    mx = mx > x ? mx : x;
  }
  return vmax(mx);
}

// The block's raw scores s[16][KB] (nk of them) -> probabilities e^(scale (s - m)) as bfloat16 tiles
// pb[nk / 32][16][32]; m (raw) and l brought up to date; returns the factor each row's accumulator is to be
// rescaled by (0 before anything was seen). Exponentials in base 2, the scale and log2(e) folded into one factor.
static inline v16 softmax_block(Rows& t, float* s, uint16_t* pb, int nk, float scale, int k0, int window, bool edge) {
  const float c = scale * 1.44269504f;
  v16 mx;
  for (int i = 0; i < 16; i++) mx[i] = row_max(s + KB * i, nk, t.pos[i], k0, window, edge);
  mx = t.m > mx ? t.m : mx;
  const v16 safe = mx == UNSEEN ? v16{} : mx;  // a row that saw nothing yet: 2^(UNSEEN c) = 0
  const v16 alpha = exp2v((t.m - safe) * c);
  v16 sums;
  for (int i = 0; i < 16; i++) {
    v16 sum = {};
    const v16 shift = v16{} - safe[i] * c;
    for (int u = 0; u < nk; u += 32) {
      const v16 e0 = exp2v(*(const v16u*)(s + KB * i + u) * c + shift);
      const v16 e1 = exp2v(*(const v16u*)(s + KB * i + u + 16) * c + shift);
      sum += e0 + e1;
      to_bf16(pb + (u / 32) * 512 + 32 * i, e0, e1);
    }
    sums[i] = vsum(sum);
  }
  t.l = t.l * alpha + sums;
  t.m = mx;
  return alpha;
}

// S = Q K^T for the tile's 16 rows (qb: [16][D] bfloat16) and the nk keys from u0, into s[16][KB]
static inline void scores(float* s, const uint16_t* qb, Packed p, int u0, int nk, int D) {
  for (int u = 0; u < nk; u += 32) {
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < D / 32; c++) {
      _tile_loadd(2, qb + 32 * c, D * 2);
      _tile_loadd(3, k_tile(p, c, u0 + u), 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(4, k_tile(p, c, u0 + u + 16), 64);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, s + u, KB * 4);
    _tile_stored(1, s + u + 16, KB * 4);
  }
}

// acc = acc * alpha + P V for the tile's 16 rows (pb: tiles of 16 x 32 probabilities) and the nk keys from u0,
// 32 dimensions (two tiles) at a time; pv: scratch [16][D]
static inline void accumulate(Rows& t, v16 alpha, const uint16_t* pb, float* pv, Packed p, int u0, int nk, int D) {
  for (int c = 0; c < D / 16; c += 2) {
    _tile_zero(0);
    _tile_zero(1);
    for (int u = 0; u < nk; u += 32) {
      _tile_loadd(2, pb + (u / 32) * 512, 64);
      _tile_loadd(3, v_tile(p, c, u0 + u, D), 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(4, v_tile(p, c + 1, u0 + u, D), 64);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, pv + 16 * c, D * 4);
    _tile_stored(1, pv + 16 * c + 16, D * 4);
  }
  for (int i = 0; i < 16; i++) {
    const v16 a = v16{} + alpha[i];
    for (int d = 0; d < D; d += 16)
      *(v16u*)(t.acc + i * D + d) = *(v16u*)(t.acc + i * D + d) * a + *(v16u*)(pv + i * D + d);
  }
}

// The keys that some row of the tile sees, [u_begin, u_end) of u = position - lo, u_begin a whole block
static inline void key_range(const Rows& t, int lo, int window, int* u_begin, int* u_end) {
  const int first = window > 0 ? std::max(lo, t.pos[0] - window + 1) : lo;
  *u_begin = (first - lo) / KB * KB;
  *u_end = t.pos[15] - lo + 1;
}

// Does some row of the tile see only part of the nk keys from position k0 (causal edge or window edge)?
static inline bool at_edge(const Rows& t, int k0, int nk, int window) {
  return k0 + nk - 1 > t.pos[0] || (window > 0 && k0 <= t.pos[15] - window);
}

// Row i of a tile, normalized, into o: D float32, or D bfloat16 rounded to nearest even (as torch rounds)
static inline void store_row(void* o, bool out_bf16, const float* acc, float inv, int D) {
  if (!out_bf16) {
    for (int d = 0; d < D; d++) ((float*)o)[d] = acc[d] * inv;
    return;
  }
  for (int d = 0; d < D; d += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(inv)));
    std::memcpy((uint16_t*)o + d, &h, sizeof h);
  }
}

// One tile: rows r0.. of kv head h's rows (row r: token r / G, head h * G + r % G); out[n][H][D] float32 or bfloat16
static void attend_tile(void* out, bool out_bf16, const uint16_t* q, Packed p, int r0, int n, int L, int lo, int h, int H,
                        int G, int D, float scale, int window, float* buf) {
  alignas(64) uint16_t qb[16 * 256], pb[16 * KB];
  alignas(64) float s[16 * KB];
  Rows t;
  t.acc = buf;
  float* pv = buf + 16 * D;
  const int R = n * G;
  for (int i = 0; i < 16; i++) {
    const int r = std::min(r0 + i, R - 1);  // padding rows repeat the last row, their output dropped
    t.pos[i] = L - n + r / G;
    std::memcpy(qb + i * D, q + ((int64_t)(r / G) * H + h * G + r % G) * D, D * 2);
  }
  t.m = v16{} + UNSEEN;
  t.l = v16{};
  std::memset(t.acc, 0, sizeof(float) * 16 * D);
  int u_begin, u_end;
  key_range(t, lo, window, &u_begin, &u_end);
  for (int u0 = u_begin; u0 < u_end; u0 += KB) {
    const int nk = std::min(KB, (u_end - u0 + 31) / 32 * 32);
    scores(s, qb, p, u0, nk, D);
    const v16 alpha = softmax_block(t, s, pb, nk, scale, lo + u0, window, at_edge(t, lo + u0, nk, window));
    accumulate(t, alpha, pb, pv, p, u0, nk, D);
  }
  for (int i = 0; i < 16 && r0 + i < R; i++) {
    const int r = r0 + i;
    const int64_t at = ((int64_t)(r / G) * H + h * G + r % G) * D;
    store_row(out_bf16 ? (void*)((uint16_t*)out + at) : (void*)((float*)out + at), out_bf16, t.acc + i * D,
              1.f / t.l[i], D);
  }
}
#endif

// Can the kernel run here: compiled for tiles, the OS grants them, head_dim a multiple of 32 up to 256, whole groups?
extern "C" int pagednb_amx_supports(int H, int KVH, int D) {
#if PAGEDNB_AMX
  return tiles_granted() && KVH > 0 && H % KVH == 0 && D % 32 == 0 && D <= 256;
#else
  return 0;
#endif
}

// The last n of a sequence's L tokens attend to keys [lo, L) (lo: the first the window can show, else 0), read
// through block_table from bfloat16 caches [blocks][BS][KVH][D]: q [n][H][D] bfloat16 -> out [n][H][D] float32
// (out_bf16 = 0) or bfloat16 (out_bf16 = 1, each value rounded once).
// A key is seen when it is at or before the query and, with window > 0, within the last `window`. Returns 0, or
// 2 where the kernel does not support the shape (see pagednb_amx_supports), 1 out of memory.
extern "C" int pagednb_amx_chunk_attention(void* out, int out_bf16, const uint16_t* q, const uint16_t* k_cache,
                                          const uint16_t* v_cache, const int32_t* block_table, int n, int L,
                                          int lo, int H, int KVH, int D, int BS, float scale, int window,
                                          int num_threads) {
#if PAGEDNB_AMX
  if (!pagednb_amx_supports(H, KVH, D) || n <= 0 || n > L || lo < 0 || lo >= L) return 2;
  const int G = H / KVH, lp = (L - lo + KB - 1) / KB * KB, tiles = (n * G + 15) / 16;
  std::unique_ptr<uint32_t[]> kt(new (std::nothrow) uint32_t[(size_t)KVH * (D / 2) * lp]);
  std::unique_ptr<uint16_t[]> vv(new (std::nothrow) uint16_t[(size_t)KVH * lp * D]);
  if (!kt || !vv) return 1;
  int err = 0;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int h = 0; h < KVH; h++) {
      const Packed p{kt.get() + (size_t)h * (D / 2) * lp, vv.get() + (size_t)h * lp * D, lp};
      pack_head(p, k_cache, v_cache, block_table, lo, L, h, KVH, D, BS);
    }
    float* buf = (float*)std::aligned_alloc(64, sizeof(float) * 32 * D);
    if (!buf) {
#pragma omp atomic write
      err = 1;
    }
    configure_tiles();
    // the costliest (last) tiles first
#pragma omp for schedule(dynamic, 1)
    for (int w = 0; w < KVH * tiles; w++) {
      if (!buf) continue;
      const int h = w % KVH, r0 = (tiles - 1 - w / KVH) * 16;
      const Packed p{kt.get() + (size_t)h * (D / 2) * lp, vv.get() + (size_t)h * lp * D, lp};
      attend_tile(out, out_bf16, q, p, r0, n, L, lo, h, H, G, D, scale, window, buf);
    }
    _tile_release();
    std::free(buf);
  }
  return err;
#else
  return 2;
#endif
}
