// Dot products of expert-record weight rows with fp32 inputs, for the CPU lane kernel (lane_kernel.cpp):
// a portable scalar version and AVX-512 / AVX2 versions compiled for those targets only (chosen at run
// time). Weights are dequantized as the GPU kernels do: W' = bf16(float32(q) * float32(scale)).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define TM_X86 1
#endif

enum { KIND_BF16 = 0, KIND_INT4 = 1, KIND_INT8 = 2, ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3 };

namespace {

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float round_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16) (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// Column order of the int4 vector paths' inputs: inside each block of 32 (fp32 paths) or 64 (bf16
// dot products) columns the even columns come first, then the odd ones (a byte holds columns 2i and
// 2i+1), so unpacked nibbles meet their inputs without a shuffle.
inline int perm32(int c) { return (c & ~31) + ((c & 1) << 4) + ((c & 31) >> 1); }
inline int perm64(int c) { return (c & ~63) + ((c & 1) << 5) + ((c & 63) >> 1); }

inline uint16_t bf16_bits(float f) {  // f holds a bf16 value already (rounded): its upper half
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

// One weight matrix of a record: row r starts at q + r * row_bytes; scales at s + r * (K / G).
struct Mat {
  const uint8_t* q;
  const uint16_t* s;
  int64_t row_bytes;
  int K, G;
};

// R rows times NT input rows: res[r][t] = sum_k W'[row r, k] * x[t][k]. Scales are walked group by
// group (a division per weight, or per group, costs as much as the group's arithmetic).
template <int R, int NT>
void dot_scalar(const Mat& m, const int* rows, const float* const* x, int kind, bool rnd, float res[][4]) {
  for (int r = 0; r < R; ++r) {
    const uint8_t* q = m.q + rows[r] * m.row_bytes;
    float acc[NT] = {};
    if (kind == KIND_BF16) {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(q);
      for (int k = 0; k < m.K; ++k)
        for (int t = 0; t < NT; ++t) acc[t] += bf16_to_f32(w[k]) * x[t][k];
    } else {
      const uint16_t* s = m.s + int64_t(rows[r]) * (m.K / m.G);
      for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
        float sc = bf16_to_f32(s[g]), lut[16];
        for (int v = 0; v < 16; ++v) lut[v] = rnd ? round_bf16(float(v - 8) * sc) : float(v - 8) * sc;
        for (int k = k0; k < k0 + m.G; ++k) {
          float w;
          if (kind == KIND_INT4) {
            w = lut[(q[k >> 1] >> ((k & 1) * 4)) & 15];
          } else {
            w = float(int8_t(q[k])) * sc;
            if (rnd) w = round_bf16(w);
          }
          for (int t = 0; t < NT; ++t) acc[t] += w * x[t][k];
        }
      }
    }
    for (int t = 0; t < NT; ++t) res[r][t] = acc[t];
  }
}

}  // namespace

#if TM_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {

inline __m512 round16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// 16 weights of row r at column c, as fp32 (int8: times the group's scale, sv).
inline __m512 w_int8(const uint8_t* q, int c, __m512 sv, bool rnd) {
  __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c)));
  __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(v), sv);
  return rnd ? round16(w) : w;
}

inline __m512 w_bf16(const uint8_t* q, int c) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * c));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <int R, int NT>
void dot(const Mat& m, const int* rows, const float* const* x, int kind, bool rnd, float res[][4]) {
  __m512 a0[R][NT], a1[R][NT];  // two accumulators per (row, token): independent FMA chains
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a0[r][t] = a1[r][t] = _mm512_setzero_ps();
  const uint8_t* q[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes;
    s[r] = m.s ? m.s + int64_t(rows[r]) * (m.K / m.G) : nullptr;
  }
  if (kind == KIND_INT4) {  // inputs in perm32 order; a 16-entry table per row and group
    const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i low = _mm512_set1_epi32(15);
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m512 lut[R];
      for (int r = 0; r < R; ++r) {
        lut[r] = _mm512_mul_ps(levels, _mm512_set1_ps(bf16_to_f32(s[r][g])));
        if (rnd) lut[r] = round16(lut[r]);
      }
      for (int c = k0; c < k0 + m.G; c += 32) {
        for (int r = 0; r < R; ++r) {
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + c / 2)));
          __m512 we = _mm512_permutexvar_ps(_mm512_and_si512(v, low), lut[r]);
          __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[r]);
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = _mm512_fmadd_ps(we, _mm512_loadu_ps(x[t] + c), a0[r][t]);
            a1[r][t] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(x[t] + c + 16), a1[r][t]);
          }
        }
      }
    }
  } else if (kind == KIND_INT8) {  // G % 16 == 0
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m512 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm512_set1_ps(bf16_to_f32(s[r][g]));
      int c = k0;
      for (; c + 32 <= k0 + m.G; c += 32)
        for (int r = 0; r < R; ++r) {
          __m512 w0 = w_int8(q[r], c, sv[r], rnd), w1 = w_int8(q[r], c + 16, sv[r], rnd);
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[t] + c), a0[r][t]);
            a1[r][t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[t] + c + 16), a1[r][t]);
          }
        }
      if (c < k0 + m.G)
        for (int r = 0; r < R; ++r) {
          __m512 w0 = w_int8(q[r], c, sv[r], rnd);
          for (int t = 0; t < NT; ++t) a0[r][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[t] + c), a0[r][t]);
        }
    }
  } else {  // bf16, K % 16 == 0
    int c = 0;
    for (; c + 32 <= m.K; c += 32)
      for (int r = 0; r < R; ++r) {
        __m512 w0 = w_bf16(q[r], c), w1 = w_bf16(q[r], c + 16);
        for (int t = 0; t < NT; ++t) {
          a0[r][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[t] + c), a0[r][t]);
          a1[r][t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[t] + c + 16), a1[r][t]);
        }
      }
    if (c < m.K)
      for (int r = 0; r < R; ++r) {
        __m512 w0 = w_bf16(q[r], c);
        for (int t = 0; t < NT; ++t) a0[r][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[t] + c), a0[r][t]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r][t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
}

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

inline __m256 round8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xFFFF0000u))));
}

inline __m256 lookup(__m256 lo, __m256 hi, __m256i idx) {  // 16-entry table: entries 0-7 in lo, 8-15 in hi
  __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256 w_int8(const uint8_t* q, int c, __m256 sv, bool rnd) {
  __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c)));
  __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(v), sv);
  return rnd ? round8(w) : w;
}

inline __m256 w_bf16(const uint8_t* q, int c) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2 * c));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <int R, int NT>
void dot(const Mat& m, const int* rows, const float* const* x, int kind, bool rnd, float res[][4]) {
  __m256 a0[R][NT], a1[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a0[r][t] = a1[r][t] = _mm256_setzero_ps();
  const uint8_t* q[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes;
    s[r] = m.s ? m.s + int64_t(rows[r]) * (m.K / m.G) : nullptr;
  }
  if (kind == KIND_INT4) {  // inputs in perm32 order
    const __m256 lv_lo = _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1), lv_hi = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i low = _mm256_set1_epi32(15);
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m256 lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        __m256 sv = _mm256_set1_ps(bf16_to_f32(s[r][g]));
        lo[r] = _mm256_mul_ps(lv_lo, sv);
        hi[r] = _mm256_mul_ps(lv_hi, sv);
        if (rnd) lo[r] = round8(lo[r]), hi[r] = round8(hi[r]);
      }
      for (int c = k0; c < k0 + m.G; c += 32) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* p = q[r] + c / 2;
          __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
          __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
          __m256 e0 = lookup(lo[r], hi[r], _mm256_and_si256(v0, low));
          __m256 e1 = lookup(lo[r], hi[r], _mm256_and_si256(v1, low));
          __m256 o0 = lookup(lo[r], hi[r], _mm256_srli_epi32(v0, 4));
          __m256 o1 = lookup(lo[r], hi[r], _mm256_srli_epi32(v1, 4));
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(x[t] + c), a0[r][t]);
            a1[r][t] = _mm256_fmadd_ps(e1, _mm256_loadu_ps(x[t] + c + 8), a1[r][t]);
            a0[r][t] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(x[t] + c + 16), a0[r][t]);
            a1[r][t] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(x[t] + c + 24), a1[r][t]);
          }
        }
      }
    }
  } else if (kind == KIND_INT8) {  // G % 16 == 0
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m256 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm256_set1_ps(bf16_to_f32(s[r][g]));
      for (int c = k0; c < k0 + m.G; c += 16)
        for (int r = 0; r < R; ++r) {
          __m256 w0 = w_int8(q[r], c, sv[r], rnd), w1 = w_int8(q[r], c + 8, sv[r], rnd);
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + c), a0[r][t]);
            a1[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + c + 8), a1[r][t]);
          }
        }
    }
  } else {  // bf16, K % 16 == 0
    for (int c = 0; c < m.K; c += 16)
      for (int r = 0; r < R; ++r) {
        __m256 w0 = w_bf16(q[r], c), w1 = w_bf16(q[r], c + 8);
        for (int t = 0; t < NT; ++t) {
          a0[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + c), a0[r][t]);
          a1[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + c + 8), a1[r][t]);
        }
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r][t] = hsum(_mm256_add_ps(a0[r][t], a1[r][t]));
}

}  // namespace avx2
#pragma GCC pop_options

// bf16 numerics on CPUs with AVX512-BF16 (Sapphire Rapids, Zen 4): weights W' = bf16(q * scale)
// and inputs already bf16, so one vdpbf16ps multiplies 32 pairs exactly and sums them in fp32, half
// the instructions of the fp32 path per weight. Inputs: bf16 bits, int4 in perm64 order, else
// natural. int4 needs G % 64 == 0, int8 G % 32 == 0, bf16 K % 32 == 0.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {

inline __m512 dp(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

inline __m512i w_int8(const uint8_t* q, int c, __m512 sv) {  // 32 weights bf16(q * scale), in column order
  const __m128i* p = reinterpret_cast<const __m128i*>(q + c);
  __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), sv);
  __m512 f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), sv);
  return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);  // f0 in the low half
}

template <int R, int NT>
void dot(const Mat& m, const int* rows, const uint16_t* const* x, int kind, float res[][4]) {
  __m512 a0[R][NT], a1[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a0[r][t] = a1[r][t] = _mm512_setzero_ps();
  const uint8_t* q[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes;
    s[r] = m.s ? m.s + int64_t(rows[r]) * (m.K / m.G) : nullptr;
  }
  if (kind == KIND_INT4) {  // a 16-entry bf16 table per row and group, looked up 32 weights at a time
    const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i low = _mm512_set1_epi16(15);
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m512i lut[R];
      for (int r = 0; r < R; ++r) {
        __m256bh l = _mm512_cvtneps_pbh(_mm512_mul_ps(levels, _mm512_set1_ps(bf16_to_f32(s[r][g]))));
        lut[r] = _mm512_castsi256_si512((__m256i)l);
      }
      for (int c = k0; c < k0 + m.G; c += 64)
        for (int r = 0; r < R; ++r) {
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + c / 2)));
          __m512i we = _mm512_permutexvar_epi16(_mm512_and_si512(v, low), lut[r]);
          __m512i wo = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut[r]);
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = dp(a0[r][t], we, x[t] + c);
            a1[r][t] = dp(a1[r][t], wo, x[t] + c + 32);
          }
        }
    }
  } else if (kind == KIND_INT8) {
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m512 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm512_set1_ps(bf16_to_f32(s[r][g]));
      int c = k0;
      for (; c + 64 <= k0 + m.G; c += 64)
        for (int r = 0; r < R; ++r) {
          __m512i w0 = w_int8(q[r], c, sv[r]), w1 = w_int8(q[r], c + 32, sv[r]);
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = dp(a0[r][t], w0, x[t] + c);
            a1[r][t] = dp(a1[r][t], w1, x[t] + c + 32);
          }
        }
      if (c < k0 + m.G)
        for (int r = 0; r < R; ++r) {
          __m512i w0 = w_int8(q[r], c, sv[r]);
          for (int t = 0; t < NT; ++t) a0[r][t] = dp(a0[r][t], w0, x[t] + c);
        }
    }
  } else {
    int c = 0;
    for (; c + 64 <= m.K; c += 64)
      for (int r = 0; r < R; ++r) {
        __m512i w0 = _mm512_loadu_si512(q[r] + 2 * c), w1 = _mm512_loadu_si512(q[r] + 2 * c + 64);
        for (int t = 0; t < NT; ++t) {
          a0[r][t] = dp(a0[r][t], w0, x[t] + c);
          a1[r][t] = dp(a1[r][t], w1, x[t] + c + 32);
        }
      }
    if (c < m.K)
      for (int r = 0; r < R; ++r) {
        __m512i w0 = _mm512_loadu_si512(q[r] + 2 * c);
        for (int t = 0; t < NT; ++t) a0[r][t] = dp(a0[r][t], w0, x[t] + c);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r][t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
}

}  // namespace avx512bf16
#pragma GCC pop_options
#endif  // TM_X86
