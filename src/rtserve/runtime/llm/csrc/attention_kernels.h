// rtserve's CPU attention building blocks (float32), shared by paged_attention.cpp (one
// operation per call) and quant_linear.cpp's decode stack (a whole decode step in one call):
// the same inline code in both, so both give the same bits.
//
// Decode attention: each decoding sequence has one new query token per head. Its keys and
// values stay in the pool's blocks: no gathered copy, no padding to the longest context in
// the step. Each token's key and value rows are read once, in block order, the next block
// fetched ahead (blocks are scattered over the pool, which the hardware prefetcher cannot
// guess). With AVX-512 the query heads that share a kv head stay in registers: 16 tokens'
// dot products are summed together, the weighted values accumulate in registers over the
// whole context.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rt_attn {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// exp(x) in a form the compiler vectorizes (libm's expf is a scalar call): 2^n * e^r with
// |r| <= ln2 / 2 and a degree-6 polynomial for e^r (Cephes' coefficients), a few ulp; x is
// clamped to [-87, 88] (e^-87 ~ 1.6e-38: nothing next to a softmax's largest term).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}



// Calls f(t, row) for each of a sequence's ``len`` cached tokens, in block order, where
// ``row`` is token t's row (all kv heads) in ``pool``; the next block's same row is fetched
// ahead, one cache line at a time.
template <class F>
inline void for_each_row(const float* pool, const int64_t* blocks_of, int64_t len,
                         int64_t block_size, int64_t row, F&& f, bool fetch_ahead = true) {
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
    const int64_t n_in = std::min(block_size, len - t0);
    const float* here = pool + blocks_of[b] * block_size * row;
    const float* next = fetch_ahead && t0 + block_size < len
                            ? pool + blocks_of[b + 1] * block_size * row
                            : nullptr;
    for (int64_t i = 0; i < n_in; ++i) {
      if (next != nullptr)
        for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(next + i * row + c);
      f(t0 + i, here + i * row);
    }
  }
}

// One sequence's decode attention: query qn [H, DIM] against its ``len`` cached tokens,
// found through ``blocks_of``; out on [H, DIM]. ``DIM`` > 0 is the head size known at
// compile time (the dot products and sums unroll into registers); 0 reads ``dim``.
template <int DIM>
void attend(const float* qn, float* on, const float* kc, const float* vc, const int64_t* blocks_of,
            int64_t len, int64_t heads, int64_t groups, int64_t dim_rt, int64_t block_size,
            int64_t row, float fscale, std::vector<float>& scores) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  scores.resize(heads * len);
  float* s = scores.data();
  for_each_row(kc, blocks_of, len, block_size, row, [&](int64_t t, const float* k) {
    for (int64_t hq = 0; hq < heads; ++hq)
      s[hq * len + t] = dot(qn + hq * dim, k + (hq / groups) * dim, dim) * fscale;
  });
  for (int64_t hq = 0; hq < heads; ++hq) {
    float* sh = s + hq * len;
    const float top = *std::max_element(sh, sh + len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = fast_exp(sh[t] - top);
      total += sh[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
  }
  std::fill(on, on + heads * dim, 0.f);
  for_each_row(vc, blocks_of, len, block_size, row, [&](int64_t t, const float* v) {
    for (int64_t hq = 0; hq < heads; ++hq)
      axpy(on + hq * dim, s[hq * len + t], v + (hq / groups) * dim, dim);
  });
}

#if defined(__AVX512F__)
// fast_exp on 16 lanes.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// Lane j of the result: the sum of v[j]'s 16 lanes (16 horizontal sums in 45 operations
// instead of 16 reductions of 8 each).
inline __m512 sum16(const __m512* v) {
  __m512 a[8];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [x, y, x, y] partial sums of a pair
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  __m512 c[4];
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: 4 vectors' partial sums
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xDD));
}

inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// Scores of GC query heads (rows of q, DIM apart) sharing one kv head (at ``koff`` in a
// token's row) against ``len`` cached tokens: s[g * len + t], scaled. The queries stay in
// registers; each token's 16-lane products are summed 16 tokens at a time.
template <int DIM, int GC>
void scores16(const float* q, const float* kc, const int64_t* blocks_of, int64_t len,
              int64_t block_size, int64_t row, int64_t koff, float scale, float* s,
              bool fetch_ahead) {
  constexpr int V = DIM / 16;
  __m512 qr[GC][V];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < V; ++v) qr[g][v] = _mm512_loadu_ps(q + g * DIM + v * 16);
  __m512 part[GC][16];
  int c = 0;
  int64_t t0 = 0;
  const __m512 vscale = _mm512_set1_ps(scale);
  auto flush = [&](int n) {
    for (int g = 0; g < GC; ++g) {
      for (int j = n; j < 16; ++j) part[g][j] = _mm512_setzero_ps();
      _mm512_mask_storeu_ps(s + g * len + t0, first(n), _mm512_mul_ps(sum16(part[g]), vscale));
    }
  };
  for_each_row(
      kc, blocks_of, len, block_size, row,
      [&](int64_t, const float* token) {
        const float* k = token + koff;
        __m512 kv[V];
        for (int v = 0; v < V; ++v) kv[v] = _mm512_loadu_ps(k + v * 16);
        for (int g = 0; g < GC; ++g) {
          __m512 a = _mm512_mul_ps(qr[g][0], kv[0]);
          for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qr[g][v], kv[v], a);
          part[g][c] = a;
        }
        if (++c == 16) {
          flush(16);
          t0 += 16;
          c = 0;
        }
      },
      fetch_ahead);
  if (c > 0) flush(c);
}

// o[g * DIM ..] = inv[g] * sum_t p[g * len + t] * v_t for GC heads sharing one kv head; the
// sums stay in registers over the whole context.
template <int DIM, int GC>
void values16(const float* p, const float* vc, const int64_t* blocks_of, int64_t len,
              int64_t block_size, int64_t row, int64_t voff, const float* inv, float* o,
              bool fetch_ahead) {
  constexpr int V = DIM / 16;
  __m512 acc[GC][V];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
  for_each_row(
      vc, blocks_of, len, block_size, row,
      [&](int64_t t, const float* token) {
        const float* vr = token + voff;
        __m512 vv[V];
        for (int v = 0; v < V; ++v) vv[v] = _mm512_loadu_ps(vr + v * 16);
        for (int g = 0; g < GC; ++g) {
          const __m512 w = _mm512_set1_ps(p[g * len + t]);
          for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(w, vv[v], acc[g][v]);
        }
      },
      fetch_ahead);
  for (int g = 0; g < GC; ++g) {
    const __m512 w = _mm512_set1_ps(inv[g]);
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + g * DIM + v * 16, _mm512_mul_ps(acc[g][v], w));
  }
}

// In place: s[t] = exp(s[t] - max); returns 1 / sum.
inline float softmax_terms(float* s, int64_t len) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
  if (t < len) top = _mm512_mask_max_ps(top, first(len - t), top, _mm512_maskz_loadu_ps(first(len - t), s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (t = 0; t + 16 <= len; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    total = _mm512_add_ps(total, e);
  }
  if (t < len) {
    const __mmask16 k = first(len - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    _mm512_mask_storeu_ps(s + t, k, e);
    total = _mm512_mask_add_ps(total, k, total, e);
  }
  return 1.f / _mm512_reduce_add_ps(total);
}

template <int DIM>
constexpr int max_group() { return 24 / (DIM / 16) < 8 ? 24 / (DIM / 16) : 8; }

template <int DIM, int GC>
void attend_heads(const float* qn, float* on, const float* kc, const float* vc,
                  const int64_t* blocks_of, int64_t len, int64_t block_size, int64_t row,
                  int64_t kv_off, float fscale, float* s, float* inv, bool fetch_ahead) {
  scores16<DIM, GC>(qn, kc, blocks_of, len, block_size, row, kv_off, fscale, s, fetch_ahead);
  for (int g = 0; g < GC; ++g) inv[g] = softmax_terms(s + g * len, len);
  values16<DIM, GC>(s, vc, blocks_of, len, block_size, row, kv_off, inv, on, fetch_ahead);
}

// One sequence's decode attention with AVX-512, DIM a multiple of 16: per kv head, its
// query heads in register-sized groups.
template <int DIM>
void attend_simd(const float* qn, float* on, const float* kc, const float* vc,
                 const int64_t* blocks_of, int64_t len, int64_t heads, int64_t groups,
                 int64_t /* dim: DIM */, int64_t block_size, int64_t row, float fscale,
                 std::vector<float>& scores) {
  constexpr int GMAX = max_group<DIM>();
  scores.resize(heads * len + heads);
  float* s = scores.data();
  float* inv = s + heads * len;
  const int64_t kv_heads = heads / groups;
  for (int64_t kh = 0; kh < kv_heads; ++kh) {
    for (int64_t g0 = 0; g0 < groups; g0 += GMAX) {
      const int gc = static_cast<int>(std::min<int64_t>(GMAX, groups - g0));
      const int64_t h = kh * groups + g0;
      const bool ahead = kh == 0 && g0 == 0;  // later passes find the rows in cache
#define RTSERVE_HEADS(N)                                                                      \
  case N:                                                                                     \
    if constexpr (N <= GMAX)                                                                  \
      attend_heads<DIM, N>(qn + h * DIM, on + h * DIM, kc, vc, blocks_of, len, block_size,    \
                           row, kh * DIM, fscale, s + h * len, inv + h, ahead);               \
    break;
      switch (gc) {
        RTSERVE_HEADS(1)
        RTSERVE_HEADS(2)
        RTSERVE_HEADS(3)
        RTSERVE_HEADS(4)
        RTSERVE_HEADS(5)
        RTSERVE_HEADS(6)
        RTSERVE_HEADS(7)
        RTSERVE_HEADS(8)
        default:
          break;
      }
#undef RTSERVE_HEADS
    }
  }
}
#endif  // __AVX512F__


#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// fast_exp on 8 lanes (the same steps).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y =
      _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// In place over s[0 .. len): the softmax (exp8 of each minus the largest, over their sum).
inline void softmax8(float* s, int64_t len) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float m = *std::max_element(lanes, lanes + 8);
  for (int64_t i = t; i < len; ++i) m = std::max(m, s[i]);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  _mm256_store_ps(lanes, total);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; t < len; ++t) {
    s[t] = fast_exp(s[t] - m);
    sum += s[t];
  }
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
  for (; t < len; ++t) s[t] *= 1.f / sum;
}

// o[0 .. 8W) = sum_t p[t] * (the row at pool + at[t]); W <= 8 vectors in registers.
template <int W>
inline void values_avx2(const float* p, const float* pool, const int64_t* at, int64_t len,
                        float* o) {
  static_assert(W >= 1 && W <= 8, "one to eight vectors");
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t t = 0; t < len; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const float* r = pool + at[t];
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
    if constexpr (W > 1) a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
    if constexpr (W > 2) a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
    if constexpr (W > 3) a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
    if constexpr (W > 4) a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), a4);
    if constexpr (W > 5) a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), a5);
    if constexpr (W > 6) a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), a6);
    if constexpr (W > 7) a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), a7);
  }
  _mm256_storeu_ps(o, a0);
  if constexpr (W > 1) _mm256_storeu_ps(o + 8, a1);
  if constexpr (W > 2) _mm256_storeu_ps(o + 16, a2);
  if constexpr (W > 3) _mm256_storeu_ps(o + 24, a3);
  if constexpr (W > 4) _mm256_storeu_ps(o + 32, a4);
  if constexpr (W > 5) _mm256_storeu_ps(o + 40, a5);
  if constexpr (W > 6) _mm256_storeu_ps(o + 48, a6);
  if constexpr (W > 7) _mm256_storeu_ps(o + 56, a7);
}

// One sequence's decode attention with AVX2 + FMA, DIM a multiple of 8 (32, 64, 128), head
// by head. Scores: eight cached tokens at a time, eight independent FMA chains (one per
// token) then one transposing sum, instead of a dependent chain and a horizontal sum per
// token. Values: the head's weighted sum stays in registers (up to 64 floats a pass) over
// the whole context. Each token's key and value rows are found once per head (a group's
// heads re-read them from cache).
template <int DIM>
void attend_avx2(const float* qn, float* on, const float* kc, const float* vc,
                 const int64_t* blocks_of, int64_t len, int64_t heads, int64_t groups,
                 int64_t /* dim: DIM */, int64_t block_size, int64_t row, float fscale,
                 std::vector<float>& scores) {
  constexpr int V = DIM / 8;
  static_assert(DIM % 8 == 0 && V <= 16, "head sizes 8 to 128");
  scores.resize(heads * len);
  float* s = scores.data();
  thread_local std::vector<int64_t> offsets;  // each token's row in the pool
  offsets.resize(len);
  int64_t* at = offsets.data();
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b)
    for (int64_t i = 0, first = blocks_of[b] * block_size * row; i < block_size && t0 + i < len; ++i)
      at[t0 + i] = first + i * row;
  auto token = [&](const float* pool, int64_t t) { return pool + at[t]; };
  for (int64_t hq = 0; hq < heads; ++hq) {
    const float* q = qn + hq * DIM;
    const int64_t off = (hq / groups) * DIM;
    float* sh = s + hq * len;
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, len - t0));
      const float* k[8];
      for (int j = 0; j < 8; ++j) k[j] = token(kc, t0 + (j < n ? j : 0)) + off;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
             a7 = a0;
      for (int v = 0; v < V; ++v) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * v);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + 8 * v), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + 8 * v), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + 8 * v), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + 8 * v), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + 8 * v), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + 8 * v), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + 8 * v), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + 8 * v), a7);
      }
      // lane j of the sum: token j's dot product
      const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
      const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                        _mm256_permute2f128_ps(h0, h1, 0x31));
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_mul_ps(dots, _mm256_set1_ps(fscale)));
      for (int j = 0; j < n; ++j) sh[t0 + j] = out[j];
    }
    softmax8(sh, len);
    // up to 64 floats of the output in registers a pass
    values_avx2<(V < 8 ? V : 8)>(sh, vc + off, at, len, on + hq * DIM);
    if constexpr (V > 8) values_avx2<V - 8>(sh, vc + off + 64, at, len, on + hq * DIM + 64);
  }
}
#endif

// One sequence's decode attention (the signature of ``attend`` and ``attend_simd``).
using AttendFn = void (*)(const float*, float*, const float*, const float*, const int64_t*,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          std::vector<float>&);

// The attention for head size ``dim``: unrolled for 32, 64 and 128 (explicit 16-lane code
// with AVX-512), the generic loop otherwise.
inline AttendFn attend_for(int64_t dim) {
#if defined(__AVX512F__)
#define RTSERVE_ATTEND(D) attend_simd<D>
#elif defined(__AVX2__) && defined(__FMA__)
#define RTSERVE_ATTEND(D) attend_avx2<D>
#else
#define RTSERVE_ATTEND(D) attend<D>
#endif
  return dim == 64    ? RTSERVE_ATTEND(64)
         : dim == 128 ? RTSERVE_ATTEND(128)
         : dim == 32  ? RTSERVE_ATTEND(32)
                      : attend<0>;
#undef RTSERVE_ATTEND
}

// RMSNorm of one row: out = w * x / sqrt(mean(x^2) + eps).
inline void rms_row(const float* xr, const float* w, float* orow, int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) sq += xr[i] * xr[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) orow[i] = w[i] * (xr[i] * inv);
}

// silu(gate) * up over one row of n.
inline void silu_row(const float* gr, const float* ur, float* orow, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(gr + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
    const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_storeu_ps(orow + i, _mm512_mul_ps(silu, _mm512_loadu_ps(ur + i)));
  }
#endif
  const int64_t done = i;
#pragma omp simd
  for (int64_t j = done; j < n; ++j) {
    const float a = gr[j];
    orow[j] = a / (1.f + fast_exp(-a)) * ur[j];
  }
}

// Rotate-half RoPE in place on ``count`` heads of size dim at xt (cos c, sin s: [dim]).
inline void rope_heads(float* xt, const float* c, const float* s, int64_t count, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < count; ++h) {
    float* a = xt + h * dim;
    float* b = a + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float lo = a[i], hi = b[i];
      a[i] = lo * c[i] - hi * s[i];
      b[i] = hi * c[half + i] + lo * s[half + i];
    }
  }
}

}  // namespace rt_attn
