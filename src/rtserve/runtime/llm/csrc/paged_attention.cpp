// rtserve's CPU kernels for the generation engine (float32): decode attention that reads the
// paged KV pool in place, the fused RMSNorm and SiLU gate, and RoPE with the key/value store.
//
// Decode attention: each decoding sequence has one new query token per head. Its keys and
// values stay in the pool's blocks: no gathered copy, no padding to the longest context in
// the step. Work is split over sequences in parts of about equal context; each token's key
// and value rows are read once, in block order, the next block fetched ahead (blocks are
// scattered over the pool, which the hardware prefetcher cannot guess). With AVX-512 the
// query heads that share a kv head stay in registers: 16 tokens' dot products are summed
// together, the weighted values accumulate in registers over the whole context.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

void check(const torch::Tensor& t, const char* name, int64_t dims, c10::ScalarType type) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(t.dim() == dims, name, ": expected ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == type, name, ": expected ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

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

}  // namespace

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
#include <immintrin.h>

namespace {

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

}  // namespace
#endif  // __AVX512F__

// query [nd, H, D]; k_cache, v_cache [blocks, block_size, KVH, D]; tables [nd, width] (block
// ids, padded); lengths [nd] (context tokens, the new one included). Returns [nd, H, D].
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == torch::kFloat && query.dim() == 3,
              "query: expected Float on CPU, [n, heads, head size]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: expected each token's heads contiguous");
  check(k_cache, "k_cache", 4, torch::kFloat);
  check(v_cache, "v_cache", 4, torch::kFloat);
  check(tables, "tables", 2, torch::kLong);
  check(lengths, "lengths", 1, torch::kLong);
  const int64_t nd = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t width = tables.size(1);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache: expected one shape");
  TORCH_CHECK(k_cache.size(3) == dim, "k_cache: head size ", k_cache.size(3), " != ", dim);
  TORCH_CHECK(heads % kv_heads == 0, "query heads ", heads, " not a multiple of ", kv_heads);
  TORCH_CHECK(tables.size(0) == nd && lengths.size(0) == nd, "tables, lengths: expected ", nd);
  const int64_t groups = heads / kv_heads;
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t n = 0; n < nd; ++n) {
    TORCH_CHECK(length[n] >= 1 && length[n] <= width * block_size, "lengths[", n, "] out of range");
    for (int64_t b = 0; b < (length[n] + block_size - 1) / block_size; ++b) {
      const int64_t id = table[n * width + b];
      TORCH_CHECK(id >= 0 && id < blocks, "tables[", n, ", ", b, "] = ", id, " out of range");
    }
    total += length[n];
  }
  auto out = torch::empty({nd, heads, dim}, query.options());
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = kv_heads * dim;  // one token's keys in a block

  // Sequences in contiguous parts of about equal context (the work is per cached token),
  // a few per thread; each sequence's key and value rows are read once, in block order.
  const int64_t parts = std::min<int64_t>(nd, 4 * at::get_num_threads());
  std::vector<int64_t> first(parts + 1, nd);
  first[0] = 0;
  for (int64_t n = 0, seen = 0, p = 1; n < nd && p < parts; ++n) {
    seen += length[n];
    while (p < parts && seen * parts >= total * p) first[p++] = n + 1;
  }
  // Head sizes known at compile time unroll into registers (explicit 16-lane code with
  // AVX-512); others run the generic loop.
#if defined(__AVX512F__)
#define RTSERVE_ATTEND(D) attend_simd<D>
#else
#define RTSERVE_ATTEND(D) attend<D>
#endif
  const auto attend_one = dim == 64    ? RTSERVE_ATTEND(64)
                          : dim == 128 ? RTSERVE_ATTEND(128)
                          : dim == 32  ? RTSERVE_ATTEND(32)
                                       : attend<0>;
#undef RTSERVE_ATTEND
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t n = first[begin]; n < first[end]; ++n) {
      const float* qn = q + n * query.stride(0);
      float* on = o + n * heads * dim;
      const int64_t* blocks_of = table + n * width;
      attend_one(qn, on, kc, vc, blocks_of, length[n], heads, groups, dim, block_size, row,
                 fscale, scores);
    }
  });
  return out;
}

// RMSNorm of each row of x [rows, n] (float32): w * x / sqrt(mean(x^2) + eps), one pass over
// the row for the sum of squares and one for the output, instead of five tensor operations.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat, "x: expected CPU float32");
  check(weight, "weight", 1, torch::kFloat);
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.size(0) == n, "weight: expected ", n, " values, got ", weight.size(0));
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t rows = xc.numel() / n;
  const float* xs = xc.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * n;
      float* orow = os + r * n;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < n; ++i) sq += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + feps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = w[i] * (xr[i] * inv);
    }
  });
  return out;
}

// silu(gate) * up for gate_up [rows, 2 * n] holding gate then up in each row (the fused
// gate/up projection's output): [rows, n].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, "gate_up", 2, torch::kFloat);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: expected an even number of columns");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = g + r * 2 * n;
      const float* ur = gr + n;
      float* orow = o + r * n;
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
  });
  return out;
}

// qkv [T, (heads + 2 * kv_heads) * D], each row a token's fused q/k/v projection: rotates its
// query and key heads in place (rotate-half RoPE as Llama and Qwen2 apply it: x * cos +
// rotate_half(x) * sin, with cos and sin [T, D]) and writes the token's key and value rows
// into the pool at slots[t] (slot = block * block_size + offset).
void rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                torch::Tensor v_cache, torch::Tensor slots, int64_t heads) {
  check(qkv, "qkv", 2, torch::kFloat);
  check(cos, "cos", 2, torch::kFloat);
  check(sin, "sin", 2, torch::kFloat);
  check(k_cache, "k_cache", 4, torch::kFloat);
  check(v_cache, "v_cache", 4, torch::kFloat);
  check(slots, "slots", 1, torch::kLong);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache: expected one shape");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(heads >= 1 && dim % 2 == 0, "heads: expected >= 1 and an even head size");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv: expected ",
              (heads + 2 * kv_heads) * dim, " columns, got ", qkv.size(1));
  TORCH_CHECK(cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "cos, sin: expected [", tokens, ", ", dim, "]");
  TORCH_CHECK(slots.size(0) == tokens, "slots: expected ", tokens, " values");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slots[", t, "] = ", slot[t], " out of range");
  float* x = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t width = qkv.size(1), half = dim / 2, row = kv_heads * dim;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xt = x + t * width;
      const float* c = cs + t * dim;
      const float* s = sn + t * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* a = xt + h * dim;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float lo = a[i], hi = b[i];
          a[i] = lo * c[i] - hi * s[i];
          b[i] = hi * c[half + i] + lo * s[half + i];
        }
      }
      std::memcpy(kc + slot[t] * row, xt + heads * dim, row * sizeof(float));
      std::memcpy(vc + slot[t] * row, xt + (heads + kv_heads) * dim, row * sizeof(float));
    }
  });
}

// The greedy LM head's screen. ``approx`` [R, V] (bfloat16) holds logits from a bfloat16 GEMM
// whose error on row r, column j is at most bound(r, j) = c * hnorm[r] * wnorm[j] + u * |a|
// (bfloat16 rounding of the inputs and the output; hnorm, wnorm: the exact rows' norms). A
// column whose bound cannot reach the row's lower bound on the true maximum (max over j of
// a - bound) cannot be the row's argmax. Returns the approximate logits as float32 and the
// columns that can be an argmax on any row; the caller recomputes those exactly.
namespace {

// The screen's bound on |logit - a| for an approximate logit a (see screen_logits): ch =
// c * hnorm[r], w = wnorm[j]. Both passes compute it with these same operations.
inline float screen_bound(float a, float ch, float w, float u) {
  return ch * w + u * std::fabs(a);
}

#if defined(__AVX512F__)
inline __m512 screen_bound16(__m512 a, __m512 ch, const float* w, __m512 u) {
  return _mm512_fmadd_ps(ch, _mm512_loadu_ps(w), _mm512_mul_ps(u, _mm512_abs_ps(a)));
}
#endif

}  // namespace

std::vector<torch::Tensor> screen_logits(torch::Tensor approx, torch::Tensor hnorm,
                                         torch::Tensor wnorm, double c, double u) {
  check(approx, "approx", 2, torch::kBFloat16);
  check(hnorm, "hnorm", 1, torch::kFloat);
  check(wnorm, "wnorm", 1, torch::kFloat);
  const int64_t rows = approx.size(0), cols = approx.size(1);
  TORCH_CHECK(hnorm.size(0) == rows && wnorm.size(0) == cols, "hnorm, wnorm: expected ", rows,
              " and ", cols, " values");
  auto logits = torch::empty({rows, cols}, hnorm.options());
  const uint16_t* a = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* hn = hnorm.data_ptr<float>();
  const float* wn = wnorm.data_ptr<float>();
  float* out = logits.data_ptr<float>();
  const float fc = static_cast<float>(c), fu = static_cast<float>(u);
  std::vector<float> floor_of(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* ar = a + r * cols;
      float* orow = out + r * cols;
      const float ch = fc * hn[r];
      float best = -INFINITY;
      int64_t j = 0;
#if defined(__AVX512F__)
      __m512 top = _mm512_set1_ps(-INFINITY);
      const __m512 vch = _mm512_set1_ps(ch), vfu = _mm512_set1_ps(fu);
      for (; j + 16 <= cols; j += 16) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar + j));
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        _mm512_storeu_ps(orow + j, v);
        top = _mm512_max_ps(top, _mm512_sub_ps(v, screen_bound16(v, vch, wn + j, vfu)));
      }
      best = _mm512_reduce_max_ps(top);
#endif
      for (; j < cols; ++j) {
        const uint32_t bits = static_cast<uint32_t>(ar[j]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof v);
        orow[j] = v;
        best = std::max(best, v - screen_bound(v, ch, wn[j], fu));
      }
      floor_of[r] = best;
    }
  });
  std::vector<uint8_t> keep(cols, 0);
  at::parallel_for(0, cols, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* orow = out + r * cols;
      const float ch = fc * hn[r], fl = floor_of[r];
      int64_t j = begin;
#if defined(__AVX512F__)
      const __m512 vch = _mm512_set1_ps(ch), vfu = _mm512_set1_ps(fu), vfl = _mm512_set1_ps(fl);
      for (; j + 16 <= end; j += 16) {
        const __m512 v = _mm512_loadu_ps(orow + j);
        const __m512 reach = _mm512_add_ps(v, screen_bound16(v, vch, wn + j, vfu));
        const __mmask16 hit = _mm512_cmp_ps_mask(reach, vfl, _CMP_GE_OQ);
        if (hit != 0)
          for (int b = 0; b < 16; ++b) keep[j + b] |= static_cast<uint8_t>((hit >> b) & 1u);
      }
#endif
      for (; j < end; ++j) {
        const float v = orow[j];
        keep[j] |= static_cast<uint8_t>(v + screen_bound(v, ch, wn[j], fu) >= fl);
      }
    }
  });
  std::vector<int64_t> picked;
  for (int64_t j = 0; j < cols; ++j)
    if (keep[j]) picked.push_back(j);
  auto candidates = torch::empty({static_cast<int64_t>(picked.size())}, torch::kLong);
  std::copy(picked.begin(), picked.end(), candidates.data_ptr<int64_t>());
  return {logits, candidates};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool (CPU, float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU, float32)");
  m.def("screen_logits", &screen_logits, "bfloat16 logits screened for a greedy argmax");
  m.def("rope_store", &rope_store, "RoPE on fused q/k/v rows, keys and values into the pool");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from a fused gate/up output (CPU, float32)");
}
