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
// From this many activation rows the few-row paths give way to float32 tiles: measured on
// SmolLM2's shapes (AVX2, 1 and 2 threads), the integer dot products of int8 weights stay
// ahead up to 24-32 rows, those of int4 (unpacking nibbles) up to about 12.
constexpr int64_t float_rows(int64_t fmt) { return fmt == 0 ? 32 : fmt == 1 ? 12 : 8; }

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

// One group's 32 weights (w0..w3, eight each) times 32 activations, in eight float lanes.
inline __m256 dot32(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float* xg) {
  __m256 d = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
  d = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), d);
  d = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), d);
  return _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), d);
}

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
        acc[r] = _mm256_fmadd_ps(dot32(w0, w1, w2, w3, xg), s, acc[r]);
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
        acc[r] = _mm256_fmadd_ps(dot32(w0, w1, w2, w3, xg), s, acc[r]);
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

// ---- few rows: integer dot products, NW weight rows at a time --------------------------
// int8 / int4 weights against activation rows quantized per group of 32 to int8 (T int8_t:
// maddubs + madd, llama.cpp's Q8_0 x Q8_0 on AVX2) or int16 (T int16_t: weights widened to
// int16, madd; float32's result to ~1e-5). NW weight rows share each activation load and keep
// NW x R independent accumulators (the FMA's latency hidden); one float FMA per group.
constexpr int NW = 4;

inline __m256i wide16(int fmt, const uint8_t* w, int64_t kp, int64_t n, int64_t g, int half) {
  if (fmt == 0) {
    const int8_t* wg = reinterpret_cast<const int8_t*>(w) + n * kp + g * G + half * 16;
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg)));
  }
  const __m128i b =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * (kp / 2) + g * (G / 2)));
  const __m128i low = _mm_set1_epi8(15);
  return _mm256_cvtepu8_epi16(half ? _mm_and_si128(_mm_srli_epi16(b, 4), low)
                                   : _mm_and_si128(b, low));
}

inline __m256i bytes32(int fmt, const uint8_t* w, int64_t kp, int64_t n, int64_t g) {
  if (fmt == 0)
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * kp + g * G));
  const __m128i b =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * (kp / 2) + g * (G / 2)));
  const __m128i low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// sum a[i] * b[i] (eight lanes at a time; a scalar chain would cost its latency per term)
inline float dot(const float* a, const float* b, int64_t len) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float tail = 0.f;
  for (; i < len; ++i) tail += a[i] * b[i];
  return hsum(acc) + tail;
}

// Four sums (one per __m256) in one __m128.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One group of weight row `row` against activation rows x0 (and x1 when R is 2): the
// group's int32 partial sums (eight lanes) in p0, p1.
template <typename T, int R>
inline void dot_group(int fmt, const uint8_t* w, int64_t kp, int64_t row, int64_t g,
                      const T* x0, const T* x1, __m256i& p0, __m256i& p1) {
  auto ld = [](const T* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (sizeof(T) == 2) {
    __m256i w0, w1;
    if (fmt == 0) {
      w0 = wide16(0, w, kp, row, g, 0), w1 = wide16(0, w, kp, row, g, 1);
    } else {  // one load: low nibbles (elements 0-15), high nibbles (16-31)
      const __m128i b =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + row * (kp / 2) + g * (G / 2)));
      const __m128i low = _mm_set1_epi8(15);
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
    }
    p0 = _mm256_add_epi32(_mm256_madd_epi16(w0, ld(x0)), _mm256_madd_epi16(w1, ld(x0 + 16)));
    if constexpr (R > 1)
      p1 = _mm256_add_epi32(_mm256_madd_epi16(w0, ld(x1)), _mm256_madd_epi16(w1, ld(x1 + 16)));
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i wv = bytes32(fmt, w, kp, row, g);
    // maddubs multiplies unsigned by signed bytes: int8 weights lend their sign to x
    const __m256i aw = fmt == 0 ? _mm256_sign_epi8(wv, wv) : wv;
    const __m256i a0 = fmt == 0 ? _mm256_sign_epi8(ld(x0), wv) : ld(x0);
    p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, a0), ones);
    if constexpr (R > 1) {
      const __m256i a1 = fmt == 0 ? _mm256_sign_epi8(ld(x1), wv) : ld(x1);
      p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, a1), ones);
    }
  }
}

// W (1 or NW) weight rows from n against R (1 or 2) activation rows: res[r][j].
// (Named registers, not arrays: GCC keeps arrays of vectors on the stack here.)
template <typename T, int R, int W>
void block_int(int fmt, const T* xq, const float* xs, int64_t kp, const uint8_t* w,
               const float* scales, const float* mins, const float* sumx, int64_t n,
               float res[][NW]) {
  const int64_t groups = kp / G;
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
  for (int64_t g = 0; g < groups; ++g) {
    const T* x0 = xq + g * G;
    const T* x1 = xq + kp + g * G;
    const float s0 = xs[g], s1 = R > 1 ? xs[groups + g] : 0.f;
#define RT_STEP(j)                                                                       \
  if constexpr (W > j) {                                                                 \
    __m256i p0, p1;                                                                      \
    dot_group<T, R>(fmt, w, kp, n + j, g, x0, x1, p0, p1);                               \
    const float sw = scales[(n + j) * groups + g];                                       \
    c0##j = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(sw * s0), c0##j);     \
    if constexpr (R > 1)                                                                 \
      c1##j = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(sw * s1), c1##j);   \
  }
    RT_STEP(0) RT_STEP(1) RT_STEP(2) RT_STEP(3)
#undef RT_STEP
    // Four int8 rows read side by side are four short streams to the hardware prefetcher
    // (the LM head from memory ran at half the speed of one row at a time): fetch the
    // block two ahead in order, a line per 64 bytes read. (int4 ran slower with it.)
    if (W == NW && fmt == 0) {
      const int64_t rb = fmt == 1 ? kp / 2 : kp;
      const int64_t ahead = 2 * NW * rb, done = g * (fmt == 1 ? G / 2 : G) * NW;
      const char* base = reinterpret_cast<const char*>(w) + n * rb + ahead;
      const int64_t step = fmt == 1 ? G / 2 * NW : G * NW;  // bytes of this group, all rows
      for (int64_t off = done - done % 64; off < done + step; off += 64)
        _mm_prefetch(base + off, _MM_HINT_T0);
    }
  }
  if constexpr (W == NW) {
    _mm_storeu_ps(res[0], hsum4(c00, c01, c02, c03));
    if constexpr (R > 1) _mm_storeu_ps(res[1], hsum4(c10, c11, c12, c13));
  } else {
    res[0][0] = hsum(c00);
    if constexpr (R > 1) res[1][0] = hsum(c10);
  }
  if (fmt == 1)  // the minimums' term: sum over groups of min * (the group's sum of x)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < W; ++j) res[r][j] += dot(mins + (n + j) * groups, sumx + r * groups, groups);
}

template <typename T>
void rows_int(int fmt, const T* xq, const float* xs, int64_t m, int64_t kp, const uint8_t* w,
              const float* scales, const float* mins, const float* sumx, const float* bias,
              float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t groups = kp / G;
  float res[2][NW];
  for (int64_t n = n0; n < n1;) {
    const int wn = n1 - n >= NW ? NW : 1;
    for (int64_t r0 = 0; r0 < m; r0 += 2) {  // the NW weight rows stay in L1 for every row
      const int rows = m - r0 >= 2 ? 2 : 1;
      const T* x = xq + r0 * kp;
      const float* s = xs + r0 * groups;
      const float* sx = sumx ? sumx + r0 * groups : nullptr;
      if (wn == NW) {
        if (rows == 2) block_int<T, 2, NW>(fmt, x, s, kp, w, scales, mins, sx, n, res);
        else block_int<T, 1, NW>(fmt, x, s, kp, w, scales, mins, sx, n, res);
      } else {
        if (rows == 2) block_int<T, 2, 1>(fmt, x, s, kp, w, scales, mins, sx, n, res);
        else block_int<T, 1, 1>(fmt, x, s, kp, w, scales, mins, sx, n, res);
      }
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < wn; ++j)
          out[(r0 + r) * n_out + n + j] = res[r][j] + (bias ? bias[n + j] : 0.f);
    }
    n += wn;
  }
}

// ---- many rows: weights dequantized to a float32 tile, then a 6 x 16 FMA microkernel ----
// A tile holds 16 output columns x KC inputs, k-major (tile[k][16]: the 16 weights of
// input k side by side), dequantized once and read by every activation row: the
// conversion is paid once per weight however many rows there are. The microkernel keeps
// 6 rows x 16 columns in 12 registers; per input it loads two weight vectors, broadcasts
// six activations and issues twelve FMAs (the layout of a float GEMM's inner kernel).
constexpr int64_t NT = 16;   // output columns per tile (threads split on these: 64 bytes)
constexpr int64_t KC = 256;  // inputs per tile (16 KB of float32)

// Eight consecutive weights k..k+7 (k a multiple of 8) of output row `row`, as float32.
template <int fmt>
inline __m256 load8(const uint8_t* w, const float* scales, const float* mins,
                    int64_t kp, int64_t row, int64_t k) {
  const int64_t groups = kp / G, g = k / G;
  if constexpr (fmt == 2) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w) + row * kp + k;
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  const __m256 s = _mm256_broadcast_ss(scales + row * groups + g);
  if constexpr (fmt == 0)
    return _mm256_mul_ps(i8x8(reinterpret_cast<const int8_t*>(w) + row * kp + k), s);
  const int c = static_cast<int>((k % G) / 8);  // 0, 1: low nibbles of bytes 0-7, 8-15; 2, 3: high
  const __m128i b =
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + row * (kp / 2) + g * (G / 2) + (c & 1) * 8));
  const __m128i q = _mm_and_si128(c >= 2 ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
  return _mm256_fmadd_ps(u8x8(q), s, _mm256_broadcast_ss(mins + row * groups + g));
}

// Rows n..n+wn (wn <= 16; the rest zero), inputs k0..k0+kc, into tile[kc][16].
template <int fmt>
void dequant_tile(const uint8_t* w, const float* scales, const float* mins,
                  int64_t kp, int64_t n, int64_t wn, int64_t k0, int64_t kc, float* tile) {
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t k = 0; k < kc; k += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) {
        const int64_t col = half * 8 + j;
        r[j] = col < wn ? load8<fmt>(w, scales, mins, kp, n + col, k0 + k) : _mm256_setzero_ps();
      }
      // 8 x 8 transpose: r[j] holds row j's inputs k..k+7; out[i] input k+i's 8 rows
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = tile + k * NT + half * 8;
      _mm256_storeu_ps(o + 0 * NT, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * NT, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * NT, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * NT, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * NT, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * NT, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * NT, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * NT, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
}

// R rows x 16 columns over kc inputs: acc (R x 16 floats, row stride NT) += x . tile.
// (Named registers, not arrays: GCC keeps arrays of vectors on the stack here.)
template <int R>
void micro(const float* x, int64_t kp, const float* tile, int64_t kc, float* acc) {
#define RT_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5)
#define RT_DECL(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps(); \
  if constexpr (R > i) a##i##0 = _mm256_loadu_ps(acc + i * NT), a##i##1 = _mm256_loadu_ps(acc + i * NT + 8);
#define RT_FMA(i) if constexpr (R > i) { const __m256 v = _mm256_broadcast_ss(x + i * kp + k); \
  a##i##0 = _mm256_fmadd_ps(v, b0, a##i##0); a##i##1 = _mm256_fmadd_ps(v, b1, a##i##1); }
#define RT_STORE(i) if constexpr (R > i) { _mm256_storeu_ps(acc + i * NT, a##i##0); \
  _mm256_storeu_ps(acc + i * NT + 8, a##i##1); }
  RT_ROWS(RT_DECL)
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(tile + k * NT), b1 = _mm256_loadu_ps(tile + k * NT + 8);
    RT_ROWS(RT_FMA)
  }
  RT_ROWS(RT_STORE)
#undef RT_ROWS
#undef RT_DECL
#undef RT_FMA
#undef RT_STORE
}

void rows_tile(int fmt, const float* x, int64_t m, int64_t kp, const uint8_t* w,
               const float* scales, const float* mins, const float* bias, float* out,
               int64_t n_out, int64_t n0, int64_t n1) {
  thread_local std::vector<float> tile, acc;
  tile.resize(KC * NT);
  acc.resize(m * NT);
  for (int64_t n = n0; n < n1; n += NT) {
    const int64_t wn = std::min<int64_t>(NT, n1 - n);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < NT; ++j) acc[r * NT + j] = bias && j < wn ? bias[n + j] : 0.f;
    for (int64_t k0 = 0; k0 < kp; k0 += KC) {
      const int64_t kc = std::min<int64_t>(KC, kp - k0);
      if (fmt == 0) dequant_tile<0>(w, scales, mins, kp, n, wn, k0, kc, tile.data());
      else if (fmt == 1) dequant_tile<1>(w, scales, mins, kp, n, wn, k0, kc, tile.data());
      else dequant_tile<2>(w, scales, mins, kp, n, wn, k0, kc, tile.data());
      for (int64_t r0 = 0; r0 < m; r0 += 6) {
        const float* xr = x + r0 * kp + k0;
        float* a = acc.data() + r0 * NT;
        switch (std::min<int64_t>(6, m - r0)) {
          case 1: micro<1>(xr, kp, tile.data(), kc, a); break;
          case 2: micro<2>(xr, kp, tile.data(), kc, a); break;
          case 3: micro<3>(xr, kp, tile.data(), kc, a); break;
          case 4: micro<4>(xr, kp, tile.data(), kc, a); break;
          case 5: micro<5>(xr, kp, tile.data(), kc, a); break;
          default: micro<6>(xr, kp, tile.data(), kc, a); break;
        }
      }
    }
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(out + r * n_out + n, acc.data() + r * NT, wn * sizeof(float));
  }
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

// The sum of a group of 32 floats.
inline float group_sum(const float* x) {
#ifdef RT_AVX2
  const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
  const __m256 b = _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24));
  return hsum(_mm256_add_ps(a, b));
#else
  float s[4] = {0.f, 0.f, 0.f, 0.f};  // four chains, not one
  for (int j = 0; j < G; j += 4)
    for (int i = 0; i < 4; ++i) s[i] += x[j + i];
  return (s[0] + s[1]) + (s[2] + s[3]);
#endif
}

// One group of 32 activations to int8 / int16 (symmetric, round to nearest even); its scale.
template <typename T>
float quantize_group(const float* x, T* q) {
  const float top = sizeof(T) == 1 ? 127.f : 32767.f;
#ifdef RT_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float scale = _mm_cvtss_f32(h) / top;
  const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
  // packs interleave 128-bit lanes: permute back to element order
  const __m256i a = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xd8);
  const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xd8);
  if constexpr (sizeof(T) == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), b);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permute4x64_epi64(_mm256_packs_epi16(a, b), 0xd8));
  }
  return scale;
#else
  float amax = 0.f;
  for (int j = 0; j < G; ++j) amax = std::max(amax, std::abs(x[j]));
  const float scale = amax / top;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int j = 0; j < G; ++j) q[j] = static_cast<T>(std::nearbyint(x[j] * inv));
  return scale;
#endif
}

// Activation rows as the integer paths read them (qlinear's and the decode stack's): each
// group's sum of each row (int4's minimum term), and the rows quantized per group of 32 to
// int8 (act 1) or int16 (act 2) with their scales.
struct Activations {
  std::vector<int8_t> q8;
  std::vector<int16_t> q16;
  std::vector<float> scale, sumx;

  void sums(const float* x, int64_t m, int64_t kp) {
    const int64_t groups = kp / G;
    sumx.resize(m * groups);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) sumx[r * groups + g] = group_sum(x + r * kp + g * G);
  }

  void quantize(const float* x, int64_t m, int64_t kp, int act) {
    const int64_t groups = kp / G;
    (act == 1 ? q8.resize(m * kp) : q16.resize(m * kp));
    scale.resize(m * groups);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = r * kp + g * G;
        scale[r * groups + g] = act == 1 ? quantize_group(x + at, q8.data() + at)
                                         : quantize_group(x + at, q16.data() + at);
      }
  }

  // Output columns n0..n1 of the quantized rows times weights w (fmt 0 / 1) into out.
  void product(int fmt, int act, bool simd, int64_t m, int64_t kp, const uint8_t* w,
               const float* scales, const float* mins, const float* bias, float* out,
               int64_t n_out, int64_t n0, int64_t n1) const {
    const float* sx = fmt == 1 ? sumx.data() : nullptr;
#ifdef RT_AVX2
    if (simd) {
      if (act == 1)
        rows_int(fmt, q8.data(), scale.data(), m, kp, w, scales, mins, sx, bias, out, n_out, n0, n1);
      else
        rows_int(fmt, q16.data(), scale.data(), m, kp, w, scales, mins, sx, bias, out, n_out, n0, n1);
      return;
    }
#endif
    (void)simd;
    if (act == 1)
      rows_int_plain(fmt, q8.data(), scale.data(), m, kp, w, scales, mins, sx, bias, out, n_out, n0, n1);
    else
      rows_int_plain(fmt, q16.data(), scale.data(), m, kp, w, scales, mins, sx, bias, out, n_out, n0, n1);
  }
};

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
  TORCH_CHECK(act >= 0 && act <= 2, "act: expected 0 (float32), 1 (int8) or 2 (int16)");
  // Few rows of int8 / int4 weights (act 1, 2): each activation row quantized per group of 32
  // to int8 (1) or int16 (2), integer dot products. From float_rows(fmt) rows, bfloat16 weights,
  // or act 0: weights dequantized to float32 a few rows at a time (exact float32 sums).
  const bool few = m < float_rows(fmt);
  const bool ints = fmt != 2 && act != 0 && few;
  Activations rows;
  if (fmt == 1 && few) rows.sums(xs, m, kp);
  if (ints) rows.quantize(xs, m, kp, static_cast<int>(act));
  const float* sx = fmt == 1 && few ? rows.sumx.data() : nullptr;
  // Threads split the output columns in blocks of 16 (64 bytes of each output row: no two
  // threads write one cache line), about 64 KB of weights per task at least.
  const int64_t row_bytes = fmt == 1 ? kp / 2 : fmt == 0 ? kp : 2 * kp;
  const int64_t blocks = (n_out + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(16 * row_bytes, 1));
  const int f = static_cast<int>(fmt);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * 16, n1 = std::min(n_out, b1 * 16);
    if (ints) {
      rows.product(f, static_cast<int>(act), simd, m, kp, w, sp, mp, bp, os, n_out, n0, n1);
      return;
    }
#ifdef RT_AVX2
    if (simd) {
      if (few)
        rows_avx2(f, xs, m, kp, w, sp, mp, sx, bp, os, n_out, n0, n1);
      else
        rows_tile(f, xs, m, kp, w, sp, mp, bp, os, n_out, n0, n1);
      return;
    }
#endif
    else
      rows_plain(f, xs, m, kp, w, sp, mp, bp, os, n_out, n0, n1);
  });
  return out;
}

#include "decode_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "weight-only int8 / int4 / bfloat16 linear (CPU, float32 rows)");
  m.def("has_avx2", &has_avx2, "whether the AVX2 + FMA loops were compiled in");
  pybind11::class_<DecodeStack>(m, "DecodeStack", "a Llama / Qwen2 decode step in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, double, bool>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("max_rows", &DecodeStack::max_rows)
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
