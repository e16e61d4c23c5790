// Weight-only quantized linear layers for decode steps (CPU, float32 activations):
// out[m, n] = sum_k x[m, k] * w[n, k] + bias[n], with w stored as
//   fmt 0  int8,  groups of 32 along k, one float32 scale each:       w = q * s
//   fmt 1  int4,  groups of 32, a float32 scale and minimum each:      w = q * s + min
//          (byte j of a group holds element j in its low nibble, j + 16 in its high one)
//   fmt 2  bfloat16 (the upper half of a float32), no groups.
// K is padded to a multiple of 32 with zero weights; x has the padded width.
//
// At one to a few rows a linear layer is a matrix-vector product that reads every weight
// once: it is bound by memory bandwidth, so the win is in the bytes. Each weight group is
// loaded and widened to float32 in registers once and multiplied (FMA) into up to four
// activation rows; its scale is applied once per group. Output rows are split over threads.
// With AVX2 + FMA the loops are explicit 8-lane code; elsewhere plain loops (the same sums,
// in another order).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RT_AVX2 1
#endif

namespace {

constexpr int64_t G = 32;  // group size along k
constexpr int64_t MB = 4;  // activation rows per pass over a weight row

// ---- plain loops -------------------------------------------------------------------------

void rows_plain(int fmt, const float* x, int64_t m, int64_t kp, const uint8_t* w,
                const float* scales, const float* mins, const float* bias, float* out,
                int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t groups = kp / G;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * kp;
      float acc = 0.f;
      if (fmt == 2) {
        const uint16_t* wr = reinterpret_cast<const uint16_t*>(w) + n * kp;
        for (int64_t k = 0; k < kp; ++k) {
          const uint32_t bits = static_cast<uint32_t>(wr[k]) << 16;
          float v;
          std::memcpy(&v, &bits, 4);
          acc += v * xr[k];
        }
      } else {
        for (int64_t g = 0; g < groups; ++g) {
          const float* xg = xr + g * G;
          float dotq = 0.f, sumx = 0.f;
          if (fmt == 0) {
            const int8_t* wg = reinterpret_cast<const int8_t*>(w) + n * kp + g * G;
            for (int64_t j = 0; j < G; ++j) dotq += static_cast<float>(wg[j]) * xg[j];
            acc += scales[n * groups + g] * dotq;
          } else {
            const uint8_t* wg = w + n * (kp / 2) + g * (G / 2);
            for (int64_t j = 0; j < G / 2; ++j) {
              dotq += static_cast<float>(wg[j] & 15) * xg[j];
              dotq += static_cast<float>(wg[j] >> 4) * xg[j + G / 2];
              sumx += xg[j] + xg[j + G / 2];
            }
            acc += scales[n * groups + g] * dotq + mins[n * groups + g] * sumx;
          }
        }
      }
      out[r * n_out + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

// ---- AVX2 + FMA --------------------------------------------------------------------------

#ifdef RT_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 u8x8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

// Output rows n0..n1 against the m activation rows in blocks of up to MB rows: row(R, r0, n,
// res) computes one weight row against rows r0..r0+R (R a compile-time constant) into res.
template <typename Row>
void rows_blocked(int64_t m, const float* bias, float* out, int64_t n_out, int64_t n0,
                  int64_t n1, Row row) {
  float res[MB];
  for (int64_t r0 = 0; r0 < m; r0 += MB) {
    const int64_t rows = std::min<int64_t>(MB, m - r0);
    for (int64_t n = n0; n < n1; ++n) {
      switch (rows) {
        case 1: row(std::integral_constant<int, 1>{}, r0, n, res); break;
        case 2: row(std::integral_constant<int, 2>{}, r0, n, res); break;
        case 3: row(std::integral_constant<int, 3>{}, r0, n, res); break;
        default: row(std::integral_constant<int, 4>{}, r0, n, res); break;
      }
      const float b = bias ? bias[n] : 0.f;
      for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n_out + n] = res[r] + b;
    }
  }
}

// One weight row against R activation rows (R <= MB).
template <int R>
void row_avx2(int fmt, const float* x, int64_t kp, const uint8_t* w, const float* scales,
              const float* mins, const float* sumx, int64_t n, float* res) {
  const int64_t groups = kp / G;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  if (fmt == 0) {
    const int8_t* wr = reinterpret_cast<const int8_t*>(w) + n * kp;
    const float* sr = scales + n * groups;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* wg = wr + g * G;
      const __m256 w0 = i8x8(wg), w1 = i8x8(wg + 8), w2 = i8x8(wg + 16), w3 = i8x8(wg + 24);
      const __m256 s = _mm256_broadcast_ss(sr + g);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * kp + g * G;
        __m256 d = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
        d = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), d);
        d = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), d);
        d = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), d);
        acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
  } else if (fmt == 1) {
    const uint8_t* wr = w + n * (kp / 2);
    const float* sr = scales + n * groups;
    const float* mr = mins + n * groups;
    const __m128i low = _mm_set1_epi8(15);
    float offs[R];
    for (int r = 0; r < R; ++r) offs[r] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * (G / 2)));
      const __m128i lo = _mm_and_si128(b, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      const __m256 w0 = u8x8(lo), w1 = u8x8(_mm_srli_si128(lo, 8));
      const __m256 w2 = u8x8(hi), w3 = u8x8(_mm_srli_si128(hi, 8));
      const __m256 s = _mm256_broadcast_ss(sr + g);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * kp + g * G;
        __m256 d = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
        d = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), d);
        d = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), d);
        d = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), d);
        acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
        offs[r] += mr[g] * sumx[r * groups + g];
      }
    }
    for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]) + offs[r];
  } else {
    const uint16_t* wr = reinterpret_cast<const uint16_t*>(w) + n * kp;
    for (int64_t k = 0; k < kp; k += 16) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), b));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), b));
      // unpack interleaves within 128-bit lanes: w0 holds k+0..3 and k+8..11, w1 the rest
      for (int r = 0; r < R; ++r) {
        const float* xk = x + r * kp + k;
        const __m256 xa = _mm256_loadu_ps(xk), xb = _mm256_loadu_ps(xk + 8);
        const __m256 x0 = _mm256_permute2f128_ps(xa, xb, 0x20);  // k+0..3, k+8..11
        const __m256 x1 = _mm256_permute2f128_ps(xa, xb, 0x31);  // k+4..7, k+12..15
        acc[r] = _mm256_fmadd_ps(w0, x0, acc[r]);
        acc[r] = _mm256_fmadd_ps(w1, x1, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
  }
}

// int8 / int4 weights against activation rows quantized to int8 per group of 32 (xq, with
// scale xs per group): integer dot products of 32 pairs in four instructions (maddubs, madd),
// as llama.cpp's Q8_0 x Q8_0 does; one float FMA per group.
template <int R>
void row_q8(int fmt, const int8_t* xq, const float* xs, int64_t kp, const uint8_t* w,
            const float* scales, const float* mins, const float* sumx, int64_t n, float* res) {
  const int64_t groups = kp / G;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float offs[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offs[r] = 0.f;
  const float* sr = scales + n * groups;
  if (fmt == 0) {
    const int8_t* wr = reinterpret_cast<const int8_t*>(w) + n * kp;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + g * G));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < R; ++r) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * kp + g * G));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sr[g] * xs[r * groups + g]),
                                 acc[r]);
      }
    }
  } else {
    const uint8_t* wr = w + n * (kp / 2);
    const float* mr = mins + n * groups;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * (G / 2)));
      const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low),
                                          _mm_and_si128(b, low));
      for (int r = 0; r < R; ++r) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * kp + g * G));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sr[g] * xs[r * groups + g]),
                                 acc[r]);
        offs[r] += mr[g] * sumx[r * groups + g];
      }
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]) + offs[r];
}

void rows_q8(int fmt, const int8_t* xq, const float* xs, int64_t m, int64_t kp,
             const uint8_t* w, const float* scales, const float* mins, const float* sumx,
             const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t groups = kp / G;
  rows_blocked(m, bias, out, n_out, n0, n1, [&](auto R, int64_t r0, int64_t n, float* res) {
    row_q8<decltype(R)::value>(fmt, xq + r0 * kp, xs + r0 * groups, kp, w, scales, mins,
                               sumx ? sumx + r0 * groups : nullptr, n, res);
  });
}

// int8 / int4 weights against activation rows quantized to int16 per group of 32 (a rounding
// error of 1 / 65534 of the group's largest value: float32's result to within ~1e-5):
// weights widened to int16 (one instruction for 16), multiplied and summed in pairs (madd),
// the group's sum in int32, one float FMA per group.
template <int R>
void row_q16(int fmt, const int16_t* xq, const float* xs, int64_t kp, const uint8_t* w,
             const float* scales, const float* mins, const float* sumx, int64_t n, float* res) {
  const int64_t groups = kp / G;
  __m256 acc[R];
  float offs[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offs[r] = 0.f;
  const float* sr = scales + n * groups;
  const float* mr = fmt == 1 ? mins + n * groups : nullptr;
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w0, w1;
    if (fmt == 0) {
      const int8_t* wg = reinterpret_cast<const int8_t*>(w) + n * kp + g * G;
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg)));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16)));
    } else {
      const __m128i b =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * (kp / 2) + g * (G / 2)));
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
    }
    for (int r = 0; r < R; ++r) {
      const int16_t* xg = xq + r * kp + g * G;
      const __m256i p = _mm256_add_epi32(
          _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg))),
          _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16))));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sr[g] * xs[r * groups + g]),
                               acc[r]);
      if (fmt == 1) offs[r] += mr[g] * sumx[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]) + offs[r];
}

void rows_q16(int fmt, const int16_t* xq, const float* xs, int64_t m, int64_t kp,
              const uint8_t* w, const float* scales, const float* mins, const float* sumx,
              const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t groups = kp / G;
  rows_blocked(m, bias, out, n_out, n0, n1, [&](auto R, int64_t r0, int64_t n, float* res) {
    row_q16<decltype(R)::value>(fmt, xq + r0 * kp, xs + r0 * groups, kp, w, scales, mins,
                                sumx ? sumx + r0 * groups : nullptr, n, res);
  });
}

void rows_avx2(int fmt, const float* x, int64_t m, int64_t kp, const uint8_t* w,
               const float* scales, const float* mins, const float* sumx, const float* bias,
               float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t groups = kp / G;
  rows_blocked(m, bias, out, n_out, n0, n1, [&](auto R, int64_t r0, int64_t n, float* res) {
    row_avx2<decltype(R)::value>(fmt, x + r0 * kp, kp, w, scales, mins,
                                 sumx ? sumx + r0 * groups : nullptr, n, res);
  });
}
#endif

// The same sums as row_q8 / row_q16 in plain loops (T: the activation rows' int8 / int16).
template <typename T>
void rows_int_plain(int fmt, const T* xq, const float* xs, int64_t m, int64_t kp,
                    const uint8_t* w, const float* scales, const float* mins, const float* sumx,
                    const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t groups = kp / G;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < m; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const T* xg = xq + r * kp + g * G;
        int32_t d = 0;
        if (fmt == 0) {
          const int8_t* wg = reinterpret_cast<const int8_t*>(w) + n * kp + g * G;
          for (int64_t j = 0; j < G; ++j) d += static_cast<int32_t>(wg[j]) * xg[j];
        } else {
          const uint8_t* wg = w + n * (kp / 2) + g * (G / 2);
          for (int64_t j = 0; j < G / 2; ++j)
            d += static_cast<int32_t>(wg[j] & 15) * xg[j] +
                 static_cast<int32_t>(wg[j] >> 4) * xg[j + G / 2];
          acc += mins[n * groups + g] * sumx[r * groups + g];
        }
        acc += static_cast<float>(d) * (scales[n * groups + g] * xs[r * groups + g]);
      }
      out[r * n_out + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

}  // namespace

bool has_avx2() {
#ifdef RT_AVX2
  return true;
#else
  return false;
#endif
}

// x [M, Kp] float32; weight int8 [N, Kp] (fmt 0), uint8 [N, Kp / 2] (fmt 1) or int16
// [N, Kp] holding bfloat16 bits (fmt 2); scales and mins [N, Kp / 32] float32 (empty when
// unused); bias [N] or empty. simd false: the plain loops even where AVX2 is compiled in.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                      torch::Tensor mins, torch::Tensor bias, int64_t fmt, bool simd,
                      int64_t act) {
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "fmt: expected 0 (int8), 1 (int4) or 2 (bfloat16)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x: expected a contiguous CPU float32 [M, K] tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 2, "weight: expected contiguous [N, *]");
  const int64_t m = x.size(0), kp = x.size(1), n_out = weight.size(0);
  TORCH_CHECK(kp % G == 0, "x: expected a width that is a multiple of 32, got ", kp);
  const int64_t wcols = fmt == 1 ? kp / 2 : kp;
  TORCH_CHECK(weight.size(1) == wcols, "weight: expected ", wcols, " columns, got ",
              weight.size(1));
  const auto wtype = fmt == 0 ? torch::kChar : fmt == 1 ? torch::kByte : torch::kShort;
  TORCH_CHECK(weight.scalar_type() == wtype, "weight: expected ", wtype);
  const int64_t groups = kp / G;
  if (fmt != 2) {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                    scales.numel() == n_out * groups,
                "scales: expected float32 [N, K / 32]");
  }
  if (fmt == 1) {
    TORCH_CHECK(mins.scalar_type() == torch::kFloat && mins.is_contiguous() &&
                    mins.numel() == n_out * groups,
                "mins: expected float32 [N, K / 32]");
  }
  const float* bp = nullptr;
  if (bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.is_contiguous() &&
                    bias.numel() == n_out,
                "bias: expected float32 [N]");
    bp = bias.data_ptr<float>();
  }
  auto out = torch::empty({m, n_out}, x.options());
  if (m == 0 || n_out == 0) return out;
  const float* xs = x.data_ptr<float>();
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  const float* sp = fmt != 2 ? scales.data_ptr<float>() : nullptr;
  const float* mp = fmt == 1 ? mins.data_ptr<float>() : nullptr;
  float* os = out.data_ptr<float>();
  // int4: the sum of each group of each activation row (for the minimum's term)
  std::vector<float> sumx;
  if (fmt == 1) {
    sumx.resize(m * groups);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t j = 0; j < G; ++j) s += xs[r * kp + g * G + j];
        sumx[r * groups + g] = s;
      }
  }
  const float* sx = fmt == 1 ? sumx.data() : nullptr;
  // act (int8 / int4 weights): 0 float32 activations; 1 each activation row quantized to
  // int8 per group of 32, 2 to int16 (symmetric, round to nearest; integer dot products)
  TORCH_CHECK(act >= 0 && act <= 2, "act: expected 0 (float32), 1 (int8) or 2 (int16)");
  std::vector<int8_t> xq;
  std::vector<int16_t> xq16;
  std::vector<float> xscale;
  const bool q8 = act == 1 && fmt != 2, q16 = act == 2 && fmt != 2;
  if (q8 || q16) {
    const float top = q8 ? 127.f : 32767.f;
    (q8 ? xq.resize(m * kp) : xq16.resize(m * kp));
    xscale.resize(m * groups);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = xs + r * kp + g * G;
        float amax = 0.f;
        for (int64_t j = 0; j < G; ++j) amax = std::max(amax, std::abs(xg[j]));
        const float scale = amax / top;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        for (int64_t j = 0; j < G; ++j) {
          const float v = std::nearbyint(xg[j] * inv);
          if (q8)
            xq[r * kp + g * G + j] = static_cast<int8_t>(v);
          else
            xq16[r * kp + g * G + j] = static_cast<int16_t>(v);
        }
        xscale[r * groups + g] = scale;
      }
  }
  // about 64 KB of weights per task: small enough to balance two threads on any layer
  const int64_t row_bytes = fmt == 1 ? kp / 2 : fmt == 0 ? kp : 2 * kp;
  const int64_t grain = std::max<int64_t>(8, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    if (q16) {
#ifdef RT_AVX2
      if (simd) {
        rows_q16(static_cast<int>(fmt), xq16.data(), xscale.data(), m, kp, w, sp, mp, sx, bp, os,
                 n_out, n0, n1);
        return;
      }
#endif
      rows_int_plain(static_cast<int>(fmt), xq16.data(), xscale.data(), m, kp, w, sp, mp, sx, bp,
                     os, n_out, n0, n1);
      return;
    }
    if (q8) {
#ifdef RT_AVX2
      if (simd) {
        rows_q8(static_cast<int>(fmt), xq.data(), xscale.data(), m, kp, w, sp, mp, sx, bp, os,
                n_out, n0, n1);
        return;
      }
#endif
      rows_int_plain(static_cast<int>(fmt), xq.data(), xscale.data(), m, kp, w, sp, mp, sx, bp,
                     os, n_out, n0, n1);
      return;
    }
#ifdef RT_AVX2
    if (simd) {
      rows_avx2(static_cast<int>(fmt), xs, m, kp, w, sp, mp, sx, bp, os, n_out, n0, n1);
      return;
    }
#endif
    rows_plain(static_cast<int>(fmt), xs, m, kp, w, sp, mp, bp, os, n_out, n0, n1);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "weight-only int8 / int4 / bfloat16 linear (CPU, float32 rows)");
  m.def("has_avx2", &has_avx2, "whether the AVX2 + FMA loops were compiled in");
}
