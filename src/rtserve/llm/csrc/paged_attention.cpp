// rtserve's CPU kernels for the generation engine (float32): decode attention that reads the
// paged KV pool in place, and the fused RMSNorm and SiLU gate.
//
// Decode attention: each decoding sequence has one new query token per head. Its keys and
// values stay in the pool's blocks: no gathered copy, no padding to the longest context in
// the step. Work is split over sequences in parts of about equal context; each token's key
// and value rows are read once, in block order, the next block fetched ahead (blocks are
// scattered over the pool, which the hardware prefetcher cannot guess).
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
                         int64_t block_size, int64_t row, F&& f) {
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
    const int64_t n_in = std::min(block_size, len - t0);
    const float* here = pool + blocks_of[b] * block_size * row;
    const float* next = t0 + block_size < len ? pool + blocks_of[b + 1] * block_size * row : nullptr;
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

// query [nd, H, D]; k_cache, v_cache [blocks, block_size, KVH, D]; tables [nd, width] (block
// ids, padded); lengths [nd] (context tokens, the new one included). Returns [nd, H, D].
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lengths, double scale) {
  check(query, "query", 3, torch::kFloat);
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
  auto out = torch::empty_like(query);
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
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t n = first[begin]; n < first[end]; ++n) {
      const float* qn = q + n * heads * dim;
      float* on = o + n * heads * dim;
      const int64_t* blocks_of = table + n * width;
      if (dim == 64)
        attend<64>(qn, on, kc, vc, blocks_of, length[n], heads, groups, dim, block_size, row,
                   fscale, scores);
      else if (dim == 128)
        attend<128>(qn, on, kc, vc, blocks_of, length[n], heads, groups, dim, block_size, row,
                    fscale, scores);
      else
        attend<0>(qn, on, kc, vc, blocks_of, length[n], heads, groups, dim, block_size, row,
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
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float a = gr[i];
        orow[i] = a / (1.f + fast_exp(-a)) * ur[i];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool (CPU, float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU, float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from a fused gate/up output (CPU, float32)");
}
