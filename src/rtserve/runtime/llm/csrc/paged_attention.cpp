// rtserve's CPU kernels for the generation engine (float32), one operation per call: decode
// attention that reads the paged KV pool in place, the fused RMSNorm and SiLU gate, RoPE with
// the key/value store, and the greedy LM head's screen. Their building blocks are in
// attention_kernels.h.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_kernels.h"

using namespace rt_attn;

namespace {


void check(const torch::Tensor& t, const char* name, int64_t dims, c10::ScalarType type) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(t.dim() == dims, name, ": expected ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == type, name, ": expected ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

}  // namespace


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
  const AttendFn attend_one = attend_for(dim);
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
    for (int64_t r = begin; r < end; ++r) rms_row(xs + r * n, w, os + r * n, n, feps);
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
    for (int64_t r = begin; r < end; ++r) silu_row(g + r * 2 * n, g + r * 2 * n + n, o + r * n, n);
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
  const int64_t width = qkv.size(1), row = kv_heads * dim;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xt = x + t * width;
      const float* c = cs + t * dim;
      const float* s = sn + t * dim;
      rope_heads(xt, c, s, heads + kv_heads, dim);
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

