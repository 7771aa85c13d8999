// Dot products of expert-record weight rows with fp32 inputs, for the CPU lane kernel (lane_kernel.cpp):
// a portable scalar version and AVX-512 / AVX2 versions compiled for those targets only (chosen at run
// time). Weights are dequantized as the GPU kernels do: W' = bf16(float32(q) * float32(scale)).
//
// int3 rows (store/quant.py) are two bit planes: K/4 bytes of 2-bit low fields (column k at byte k / 4,
// bits 2 * (k % 4)), then K/8 bytes of high bits (column k at byte K/4 + k / 8, bit k % 8); q = low +
// 4 * high - 4. The vector paths read them in natural column order (no input reordering): a per-lane
// shift of a broadcast word of each plane puts a column's low field in its lane's bits 0-1 and its high
// bit one position up, a ternary-logic op merges the two, and one permute looks the index up in the
// group's table of bf16(q * scale). The table repeats each group of 4 entries, so the bits above a
// lane's field (the next columns' fields) need no masking.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define TM_X86 1
#endif

enum { KIND_BF16 = 0, KIND_INT4 = 1, KIND_INT8 = 2, KIND_INT3 = 3 };  // kernels/cpu/native.py KINDS
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3 };

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

// One weight matrix of a record: row r starts at q + r * row_bytes; scales at s + r * (K / G). int3: the
// row's high-bit plane starts K / 4 bytes into the row. ahead: set where the rows that far on from the ones
// computed are the caller's next ones (not another thread's), so paths that prefetch may fetch them.
struct Mat {
  const uint8_t* q;
  const uint16_t* s;
  int64_t row_bytes;
  int K, G;
  int64_t ahead = 0;  // bytes from a byte being computed to the one prefetched (0: no prefetch)
  int hint = 3;       // __builtin_prefetch locality of those prefetches: 3 (into L1) down to 1
};

// Prefetch the cache line m.ahead bytes on from p (a byte of a row being computed). Only where m.ahead: then those
// rows are the ones this thread computes next; another thread's would be read into this core for nothing.
// The scalar path does not prefetch: it computes a weight far slower than memory delivers one.
inline void prefetch_ahead(const Mat& m, const uint8_t* p) {
  if (m.hint >= 3)
    __builtin_prefetch(p + m.ahead, 0, 3);
  else if (m.hint == 2)
    __builtin_prefetch(p + m.ahead, 0, 2);
  else
    __builtin_prefetch(p + m.ahead, 0, 1);
}

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
    } else if (kind == KIND_INT3) {
      const uint16_t* s = m.s + int64_t(rows[r]) * (m.K / m.G);
      const uint8_t* hi = q + m.K / 4;
      for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
        float sc = bf16_to_f32(s[g]), lut[8];
        for (int v = 0; v < 8; ++v) lut[v] = rnd ? round_bf16(float(v - 4) * sc) : float(v - 4) * sc;
        for (int k = k0; k < k0 + m.G; ++k) {
          float w = lut[((q[k >> 2] >> ((k & 3) * 2)) & 3) | (((hi[k >> 3] >> (k & 7)) & 1) << 2)];
          for (int t = 0; t < NT; ++t) acc[t] += w * x[t][k];
        }
      }
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

// step(v, i) for v = 0..nv-1, accumulator i = v % A within whole rounds of A, then 0 for the rest: the
// loop every AVX-512 dot product runs over its vectors (A independent accumulators hide FMA latency).
// Forced inline: called out of line, the step lambda cannot keep the accumulators in registers.
template <int A, class Step>
__attribute__((always_inline)) inline void over_vectors(int nv, Step&& step) {
  int v = 0;
  for (; v + A <= nv; v += A)
    for (int i = 0; i < A; ++i) step(v + i, i);
  for (; v < nv; ++v) step(v, 0);
}

template <int R, int NT, int A>  // res[r][t] = the sum of row r's accumulators of token t, in order
inline void reduce(__m512 (&acc)[R][NT][A], float res[][4]) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      __m512 sum = acc[r][t][0];
      for (int i = 1; i < A; ++i) sum = _mm512_add_ps(sum, acc[r][t][i]);
      res[r][t] = _mm512_reduce_add_ps(sum);
    }
}

// 16 int3 weights of a row from column c (c % 16 == 0), in column order. tbl: the group's 16-entry table,
// entries 0-7 for a clear high bit (q = low - 4), 8-15 for a set one (q = low), each 4 levels repeated;
// lane b gets column c + b's low field in bits 0-1 (a shift by lsh = 2b) and its high bit in bit 3 (a
// rotation by hrot = b - 3); sel: 8 in every lane. The high bits are read as 4 bytes, 2 past this
// vector's: still inside the record, whose scale sections follow its weight sections.
inline __m512 w_int3(const uint8_t* lo, const uint8_t* hi, int c, __m512 tbl, __m512i lsh, __m512i hrot,
                     __m512i sel) {
  int32_t lw, hw;
  std::memcpy(&lw, lo + (c >> 2), 4);
  std::memcpy(&hw, hi + (c >> 3), 4);
  __m512i idx = _mm512_srlv_epi32(_mm512_set1_epi32(lw), lsh);
  __m512i h = _mm512_rorv_epi32(_mm512_set1_epi32(hw), hrot);
  return _mm512_permutexvar_ps(_mm512_ternarylogic_epi32(sel, h, idx, 0xCA), tbl);  // bit 3 from h
}

// int3 rows, G % 16 == 0, K % 16 == 0. The row's vectors take turns on A accumulators per token (4 for
// one token: a row alone has too few FMA chains to hide their latency; 2 otherwise, for registers), the
// tables are rebuilt where a group starts, and each 16th vector prefetches the same columns two rows on
// (m.ahead: rows this thread reads next): int3's extra arithmetic per byte leaves the core fewer loads
// in flight than int4 has, and without it the lane's int3 reads ran at two thirds of int4's bytes per
// second.
template <int R, int NT>
void dot_int3(const Mat& m, const int* rows, const float* const* x, bool rnd, float res[][4]) {
  constexpr int A = NT == 1 ? 4 : 2;
  const __m512 levels = _mm512_setr_ps(-4, -3, -2, -1, -4, -3, -2, -1, 0, 1, 2, 3, 0, 1, 2, 3);
  const __m512i lsh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i hrot = _mm512_setr_epi32(29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12);
  const __m512i sel = _mm512_set1_epi32(8);
  __m512 acc[R][NT][A], tbl[R];
  const uint8_t *q[R], *hi[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes, hi[r] = q[r] + m.K / 4, s[r] = m.s + int64_t(rows[r]) * (m.K / m.G);
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < A; ++i) acc[r][t][i] = _mm512_setzero_ps();
  }
  const int nv = m.K / 16, per = m.G / 16;  // vectors in a row, in a group
  int g = 0, left = 0;                      // the next group, and the vectors left in the current one
  auto step = [&](int v, int i) {           // vector v on accumulator i
    if (left == 0) {
      for (int r = 0; r < R; ++r) {
        tbl[r] = _mm512_mul_ps(levels, _mm512_set1_ps(bf16_to_f32(s[r][g])));
        if (rnd) tbl[r] = round16(tbl[r]);
      }
      ++g, left = per;
    }
    --left;
    const int c = 16 * v;
    if (m.ahead && (v & 15) == 0)
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(q[r] + 2 * m.row_bytes + (c >> 2)), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(hi[r] + 2 * m.row_bytes + (c >> 3)), _MM_HINT_T0);
      }
    for (int r = 0; r < R; ++r) {
      __m512 w = w_int3(q[r], hi[r], c, tbl[r], lsh, hrot, sel);
      for (int t = 0; t < NT; ++t) acc[r][t][i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[t] + c), acc[r][t][i]);
    }
  };
  over_vectors<A>(nv, step);
  reduce<R, NT, A>(acc, res);
}

// The fp32 paths below prefetch the next 64 bytes two rows on (m.ahead: rows this thread reads next) once
// per 64 bytes of a row: without it a GLM-5.3-Flash int4 expert took about half as long again on one Zen 5
// thread. They keep two accumulators per row and token: four, as the bf16 dot products take at one token,
// measured no faster here (the per-weight work, not the FMA latency, is what these chains wait on).

// int4 rows, G % 32 == 0, K % 32 == 0, inputs in perm32 order: a 16-entry table per row and group; a step
// reads 16 bytes of a row (32 columns), the even columns' weights on one accumulator, the odd ones' on the
// other.
template <int R, int NT>
void dot_int4(const Mat& m, const int* rows, const float* const* x, bool rnd, float res[][4]) {
  const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i low = _mm512_set1_epi32(15);
  __m512 acc[R][NT][2];
  const uint8_t* q[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes, s[r] = m.s + int64_t(rows[r]) * (m.K / m.G);
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  }
  for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
    __m512 lut[R];
    for (int r = 0; r < R; ++r) {
      lut[r] = _mm512_mul_ps(levels, _mm512_set1_ps(bf16_to_f32(s[r][g])));
      if (rnd) lut[r] = round16(lut[r]);
    }
    for (int c = k0; c < k0 + m.G; c += 32) {
      if (m.ahead && (c & 127) == 0)
        for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + c / 2);
      for (int r = 0; r < R; ++r) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + c / 2)));
        __m512 we = _mm512_permutexvar_ps(_mm512_and_si512(v, low), lut[r]);
        __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[r]);
        for (int t = 0; t < NT; ++t) {
          acc[r][t][0] = _mm512_fmadd_ps(we, _mm512_loadu_ps(x[t] + c), acc[r][t][0]);
          acc[r][t][1] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(x[t] + c + 16), acc[r][t][1]);
        }
      }
    }
  }
  reduce<R, NT, 2>(acc, res);
}

// int8 (G % 16 == 0) and bf16 rows (K % 16 == 0): 16 columns a step, the steps taking turns on the two
// accumulators; the group's scale is set where a group starts.
template <int KIND, int R, int NT>
void dot_int8_bf16(const Mat& m, const int* rows, const float* const* x, bool rnd, float res[][4]) {
  constexpr int PF = KIND == KIND_INT8 ? 3 : 1;  // steps between prefetches, less one: 16 or 32 bytes a step
  __m512 acc[R][NT][2], sv[R];
  const uint8_t* q[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes, s[r] = m.s ? m.s + int64_t(rows[r]) * (m.K / m.G) : nullptr;
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  }
  const int nv = m.K / 16, per = KIND == KIND_INT8 ? m.G / 16 : nv;  // steps in a row, in a group
  int g = 0, left = 0;  // the next group, and the steps left in the current one
  auto step = [&](int v, int i) {  // step v on accumulator i
    if (KIND == KIND_INT8 && left == 0) {
      for (int r = 0; r < R; ++r) sv[r] = _mm512_set1_ps(bf16_to_f32(s[r][g]));
      ++g, left = per;
    }
    --left;
    const int c = 16 * v;
    if (m.ahead && (v & PF) == 0)
      for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + (KIND == KIND_INT8 ? c : 2 * c));
    for (int r = 0; r < R; ++r) {
      __m512 w = KIND == KIND_INT8 ? w_int8(q[r], c, sv[r], rnd) : w_bf16(q[r], c);
      for (int t = 0; t < NT; ++t) acc[r][t][i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[t] + c), acc[r][t][i]);
    }
  };
  int v = 0;
  for (; v + 2 <= nv; v += 2) step(v, 0), step(v + 1, 1);
  if (v < nv) step(v, 0);
  reduce<R, NT, 2>(acc, res);
}

template <int R, int NT>
void dot(const Mat& m, const int* rows, const float* const* x, int kind, bool rnd, float res[][4]) {
  if (kind == KIND_INT3) return dot_int3<R, NT>(m, rows, x, rnd, res);
  if (kind == KIND_INT4) return dot_int4<R, NT>(m, rows, x, rnd, res);
  if (kind == KIND_INT8) return dot_int8_bf16<KIND_INT8, R, NT>(m, rows, x, rnd, res);
  dot_int8_bf16<KIND_BF16, R, NT>(m, rows, x, rnd, res);
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

// 16 int3 weights of a row from column c (c % 16 == 0), in column order, as w0 (columns c..c+7) and w1:
// an 8-entry table (q = -4..3 times the scale) indexed by low field | high bit << 2. The high bits are
// broadcast shifted left by 2, so a right shift by the lane's column puts its bit at bit 2.
inline void w_int3(const uint8_t* lo, const uint8_t* hi, int c, __m256 tbl, __m256& w0, __m256& w1) {
  uint32_t lw;
  uint16_t hw;
  std::memcpy(&lw, lo + (c >> 2), 4);
  std::memcpy(&hw, hi + (c >> 3), 2);
  const __m256i three = _mm256_set1_epi32(3), four = _mm256_set1_epi32(4);
  __m256i l = _mm256_set1_epi32(int(lw)), h = _mm256_set1_epi32(int(hw) << 2);
  __m256i i0 = _mm256_or_si256(
      _mm256_and_si256(_mm256_srlv_epi32(l, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), three),
      _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), four));
  __m256i i1 = _mm256_or_si256(
      _mm256_and_si256(_mm256_srlv_epi32(l, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)), three),
      _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)), four));
  w0 = _mm256_permutevar8x32_ps(tbl, i0);
  w1 = _mm256_permutevar8x32_ps(tbl, i1);
}

// Every kind prefetches the next 64 bytes two rows on (m.ahead: rows this thread reads next) once per 64
// bytes of a row (int3: of its low-bit plane, with the high-bit plane's bytes of the same columns): without
// it one thread took a sixth longer on int4 and a third longer on bf16. Two accumulators per row and token,
// also at one token: four spill (16 registers) and measured no faster.
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
        if (m.ahead && (c & 127) == 0)
          for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + c / 2);
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
  } else if (kind == KIND_INT3) {  // natural column order, G % 16 == 0
    const __m256 levels = _mm256_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3);
    const uint8_t* hi[R];
    for (int r = 0; r < R; ++r) hi[r] = q[r] + m.K / 4;
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m256 tbl[R];
      for (int r = 0; r < R; ++r) {
        tbl[r] = _mm256_mul_ps(levels, _mm256_set1_ps(bf16_to_f32(s[r][g])));
        if (rnd) tbl[r] = round8(tbl[r]);
      }
      for (int c = k0; c < k0 + m.G; c += 16) {
        if (m.ahead && (c & 255) == 0)
          for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + c / 4), prefetch_ahead(m, hi[r] + c / 8);
        for (int r = 0; r < R; ++r) {
          __m256 w0, w1;
          w_int3(q[r], hi[r], c, tbl[r], w0, w1);
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + c), a0[r][t]);
            a1[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + c + 8), a1[r][t]);
          }
        }
      }
    }
  } else if (kind == KIND_INT8) {  // G % 16 == 0
    for (int g = 0, k0 = 0; k0 < m.K; ++g, k0 += m.G) {
      __m256 sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm256_set1_ps(bf16_to_f32(s[r][g]));
      for (int c = k0; c < k0 + m.G; c += 16) {
        if (m.ahead && (c & 63) == 0)
          for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + c);
        for (int r = 0; r < R; ++r) {
          __m256 w0 = w_int8(q[r], c, sv[r], rnd), w1 = w_int8(q[r], c + 8, sv[r], rnd);
          for (int t = 0; t < NT; ++t) {
            a0[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + c), a0[r][t]);
            a1[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + c + 8), a1[r][t]);
          }
        }
      }
    }
  } else {  // bf16, K % 16 == 0
    for (int c = 0; c < m.K; c += 16) {
      if (m.ahead && (c & 31) == 0)
        for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + 2 * c);
      for (int r = 0; r < R; ++r) {
        __m256 w0 = w_bf16(q[r], c), w1 = w_bf16(q[r], c + 8);
        for (int t = 0; t < NT; ++t) {
          a0[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + c), a0[r][t]);
          a1[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + c + 8), a1[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r][t] = hsum(_mm256_add_ps(a0[r][t], a1[r][t]));
}

}  // namespace avx2
#pragma GCC pop_options

// int3 with bf16 dot products (see avx512bf16 below), in a namespace of its own because it needs
// AVX512-VBMI: vpmultishiftqb takes the 2-bit field of 32 columns out of one broadcast 8-byte word of the
// low plane in a single instruction (Sapphire Rapids and Zen 4 have it, Cooper Lake does not: there the
// kernel runs int3 on the fp32 AVX-512 path). Kept apart so that no other path is compiled for VBMI.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c")
namespace avx512vbmi {

// 32 int3 weights of a row from column c (c % 32 == 0) as bf16, in column order. tbl: the group's 32-entry
// bf16 table, entries 0-15 for a clear high bit (q = low - 4), 16-31 for a set one (q = low), each 4
// levels repeated; lctl / hctl: multishift offsets that put column c + w's low field in bits 0-1 of word w
// (bit 2w of the low plane's 8 bytes) and its high bit in bit 4 (bit w of the high plane's 4 bytes,
// rotated); sel: 0x10 in every word. Vector instructions only: moving the high bits through a mask
// register costs a general-register-to-mask move where the compiler chooses one, slow on some CPUs.
inline __m512i w_int3(const uint8_t* lo, const uint8_t* hi, int c, __m512i tbl, __m512i lctl, __m512i hctl,
                      __m512i sel) {
  int64_t lw;
  int32_t hw;
  std::memcpy(&lw, lo + (c >> 2), 8);
  std::memcpy(&hw, hi + (c >> 3), 4);
  __m512i idx = _mm512_multishift_epi64_epi8(lctl, _mm512_set1_epi64(lw));
  __m512i h = _mm512_multishift_epi64_epi8(hctl, _mm512_set1_epi32(hw));
  return _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(sel, h, idx, 0xCA), tbl);  // bit 4 from h
}

// The R rows' pointers (low-bit plane, high-bit plane K / 4 bytes on, scales) and zeroed accumulators.
template <int R, int NT, int A>
__attribute__((always_inline)) inline void int3_rows(const Mat& m, const int* rows, const uint8_t* (&q)[R],
                                                     const uint8_t* (&hi)[R], const uint16_t* (&s)[R],
                                                     __m512 (&acc)[R][NT][A]) {
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes, hi[r] = q[r] + m.K / 4, s[r] = m.s + int64_t(rows[r]) * (m.K / m.G);
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < A; ++i) acc[r][t][i] = _mm512_setzero_ps();
  }
}

// Step v of an int3 row walk: every eighth step prefetches both bit planes two rows on (m.ahead), then
// the NT tokens' 32 bf16 inputs at column 32 v.
template <int R, int NT>
__attribute__((always_inline)) inline void int3_step_inputs(const Mat& m, const uint8_t* const (&q)[R],
                                                            const uint8_t* const (&hi)[R],
                                                            const uint16_t* const* x, int v, __m512bh (&xv)[NT]) {
  const int c = 32 * v;
  if (m.ahead && (v & 7) == 0)
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(q[r] + 2 * m.row_bytes + (c >> 2)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(hi[r] + 2 * m.row_bytes + (c >> 3)), _MM_HINT_T0);
    }
  for (int t = 0; t < NT; ++t) xv[t] = (__m512bh)_mm512_loadu_si512(x[t] + c);
}

// int3 rows with G = 16 (GGUF Q3_K's sub-blocks), K % 32 == 0: a vector of 32 columns spans two groups.
// One table serves both: [group a, q = low - 4 | group b, q = low - 4 | a, q = low | b, q = low], 8
// entries each, built from a scale vector [a x 8 | b x 8] (one broadcast of the two bf16 scales); a
// second ternary-logic op sets index bit 3 for the second group's lanes. Accumulators and prefetches
// as dot_int3.
template <int R, int NT>
void dot_int3_g16(const Mat& m, const int* rows, const uint16_t* const* x, float res[][4]) {
  constexpr int A = NT == 1 ? 4 : 2;
  const __m512 lv0 = _mm512_setr_ps(-4, -3, -2, -1, -4, -3, -2, -1, -4, -3, -2, -1, -4, -3, -2, -1);
  const __m512 lv1 = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  alignas(64) uint8_t lo_offs[64], hi_offs[64];
  alignas(64) uint16_t second[32];
  for (int w = 0; w < 32; ++w) {
    lo_offs[2 * w] = uint8_t(2 * w), hi_offs[2 * w] = uint8_t((w - 4) & 63);
    lo_offs[2 * w + 1] = hi_offs[2 * w + 1] = 0;
    second[w] = w < 16 ? 0 : 8;
  }
  const __m512i lctl = _mm512_load_si512(lo_offs), hctl = _mm512_load_si512(hi_offs), grp = _mm512_load_si512(second);
  const __m512i sel_hi = _mm512_set1_epi16(0x10), sel_grp = _mm512_set1_epi16(0x08);
  const __m512i upper16 = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 acc[R][NT][A];
  const uint8_t *q[R], *hi[R];
  const uint16_t* s[R];
  int3_rows<R, NT, A>(m, rows, q, hi, s, acc);  // G = 16: K / 16 scales a row
  auto step = [&](int v, int i) {
    const int c = 32 * v;
    __m512bh xv[NT];
    int3_step_inputs<R, NT>(m, q, hi, x, v, xv);
    for (int r = 0; r < R; ++r) {
      int32_t pair, lw_hi;
      int64_t lw;
      std::memcpy(&pair, s[r] + 2 * v, 4);  // bf16 scales of groups 2v (low half) and 2v + 1
      std::memcpy(&lw, q[r] + (c >> 2), 8);
      std::memcpy(&lw_hi, hi[r] + (c >> 3), 4);
      __m512i sp = _mm512_set1_epi32(pair);
      __m512 sv = _mm512_castsi512_ps(_mm512_mask_slli_epi32(_mm512_and_si512(sp, upper16), 0x00FF, sp, 16));
      __m512i tbl = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(lv1, sv), _mm512_mul_ps(lv0, sv));
      __m512i idx = _mm512_multishift_epi64_epi8(lctl, _mm512_set1_epi64(lw));
      __m512i h = _mm512_multishift_epi64_epi8(hctl, _mm512_set1_epi32(lw_hi));
      idx = _mm512_ternarylogic_epi32(sel_grp, grp, _mm512_ternarylogic_epi32(sel_hi, h, idx, 0xCA), 0xCA);
      __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, tbl);
      for (int t = 0; t < NT; ++t) acc[r][t][i] = _mm512_dpbf16_ps(acc[r][t][i], w, xv[t]);
    }
  };
  const int nv = m.K / 32;
  avx512::over_vectors<A>(nv, step);
  avx512::reduce<R, NT, A>(acc, res);
}

// int3 rows, G % 32 == 0 (or G = 16: dot_int3_g16), K % 32 == 0, bf16 inputs; accumulators, tables and
// prefetches as avx512::dot_int3.
template <int R, int NT>
void dot_int3(const Mat& m, const int* rows, const uint16_t* const* x, float res[][4]) {
  if (m.G == 16) return dot_int3_g16<R, NT>(m, rows, x, res);
  constexpr int A = NT == 1 ? 4 : 2;
  const __m512 lv0 = _mm512_setr_ps(-4, -3, -2, -1, -4, -3, -2, -1, -4, -3, -2, -1, -4, -3, -2, -1);
  const __m512 lv1 = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  alignas(64) uint8_t lo_offs[64], hi_offs[64];
  for (int w = 0; w < 32; ++w) {
    lo_offs[2 * w] = uint8_t(2 * w), hi_offs[2 * w] = uint8_t((w - 4) & 63);
    lo_offs[2 * w + 1] = hi_offs[2 * w + 1] = 0;
  }
  const __m512i lctl = _mm512_load_si512(lo_offs), hctl = _mm512_load_si512(hi_offs), sel = _mm512_set1_epi16(0x10);
  __m512 acc[R][NT][A];
  __m512i tbl[R];
  const uint8_t *q[R], *hi[R];
  const uint16_t* s[R];
  int3_rows<R, NT, A>(m, rows, q, hi, s, acc);
  const int nv = m.K / 32, per = m.G / 32;
  int g = 0, left = 0;
  auto step = [&](int v, int i) {
    if (left == 0) {
      for (int r = 0; r < R; ++r) {
        __m512 sv = _mm512_set1_ps(bf16_to_f32(s[r][g]));
        tbl[r] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(lv1, sv), _mm512_mul_ps(lv0, sv));
      }
      ++g, left = per;
    }
    --left;
    const int c = 32 * v;
    __m512bh xv[NT];
    int3_step_inputs<R, NT>(m, q, hi, x, v, xv);
    for (int r = 0; r < R; ++r) {
      __m512bh w = (__m512bh)w_int3(q[r], hi[r], c, tbl[r], lctl, hctl, sel);
      for (int t = 0; t < NT; ++t) acc[r][t][i] = _mm512_dpbf16_ps(acc[r][t][i], w, xv[t]);
    }
  };
  avx512::over_vectors<A>(nv, step);
  avx512::reduce<R, NT, A>(acc, res);
}

}  // namespace avx512vbmi
#pragma GCC pop_options

// bf16 numerics on CPUs with AVX512-BF16 (Sapphire Rapids, Zen 4): weights W' = bf16(q * scale)
// and inputs already bf16, so one vdpbf16ps multiplies 32 pairs exactly and sums them in fp32, half
// the instructions of the fp32 path per weight. Inputs: bf16 bits, int4 in perm64 order, else
// natural. int4 needs G % 64 == 0, int8 G % 32 == 0, int3 G % 32 == 0 or 16 and VBMI, bf16 K % 32 == 0.
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

// int4 rows, G % 64 == 0, K % 64 == 0, inputs in perm64 order: a 16-entry bf16 table per row and group; a
// step reads 32 bytes of a row (64 columns), the even columns' weights on one accumulator and the odd
// ones' on the next. At one token the steps alternate between two such pairs (a row alone has too few
// dot-product chains to hide their latency), and every second step prefetches the next 64 bytes two rows
// on (m.ahead: rows this thread reads next). Without either a GLM-5.3-Flash int4 expert took a quarter
// longer on one Zen 5 thread; the prefetch is most of that, four chains instead of two about a tenth.
template <int R, int NT>
void dot_int4(const Mat& m, const int* rows, const uint16_t* const* x, float res[][4]) {
  constexpr int A = NT == 1 ? 4 : 2;
  const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i low = _mm512_set1_epi16(15);
  __m512 acc[R][NT][A];
  __m512i lut[R];
  const uint8_t* q[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes, s[r] = m.s + int64_t(rows[r]) * (m.K / m.G);
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < A; ++i) acc[r][t][i] = _mm512_setzero_ps();
  }
  const int nv = m.K / 64, per = m.G / 64;  // steps in a row, in a group
  int g = 0, left = 0;                      // the next group, and the steps left in the current one
  auto step = [&](int v, int i) {           // step v on accumulators i and i + 1
    if (left == 0) {
      for (int r = 0; r < R; ++r) {
        __m256bh l = _mm512_cvtneps_pbh(_mm512_mul_ps(levels, _mm512_set1_ps(bf16_to_f32(s[r][g]))));
        lut[r] = _mm512_castsi256_si512((__m256i)l);
      }
      ++g, left = per;
    }
    --left;
    const int c = 64 * v;
    if (m.ahead && (v & 1) == 0)
      for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + c / 2);
    for (int r = 0; r < R; ++r) {
      __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + c / 2)));
      __m512i we = _mm512_permutexvar_epi16(_mm512_and_si512(b, low), lut[r]);
      __m512i wo = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut[r]);
      for (int t = 0; t < NT; ++t) {
        acc[r][t][i] = dp(acc[r][t][i], we, x[t] + c);
        acc[r][t][i + 1] = dp(acc[r][t][i + 1], wo, x[t] + c + 32);
      }
    }
  };
  int v = 0;
  for (; v + A / 2 <= nv; v += A / 2)
    for (int i = 0; i < A / 2; ++i) step(v + i, 2 * i);
  for (; v < nv; ++v) step(v, 0);
  avx512::reduce<R, NT, A>(acc, res);
}

// int8 rows, G % 32 == 0: 32 columns (32 bytes of a row) a step, one step per accumulator in turn (4 at
// one token, else 2) and every second step prefetches the next 64 bytes two rows on (m.ahead), as dot_int4.
template <int R, int NT>
void dot_int8(const Mat& m, const int* rows, const uint16_t* const* x, float res[][4]) {
  constexpr int A = NT == 1 ? 4 : 2;
  __m512 acc[R][NT][A], sv[R];
  const uint8_t* q[R];
  const uint16_t* s[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes, s[r] = m.s + int64_t(rows[r]) * (m.K / m.G);
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < A; ++i) acc[r][t][i] = _mm512_setzero_ps();
  }
  const int nv = m.K / 32, per = m.G / 32;
  int g = 0, left = 0;
  auto step = [&](int v, int i) {
    if (left == 0) {
      for (int r = 0; r < R; ++r) sv[r] = _mm512_set1_ps(bf16_to_f32(s[r][g]));
      ++g, left = per;
    }
    --left;
    const int c = 32 * v;
    if (m.ahead && (v & 1) == 0)
      for (int r = 0; r < R; ++r) prefetch_ahead(m, q[r] + c);
    for (int r = 0; r < R; ++r) {
      __m512i w = w_int8(q[r], c, sv[r]);
      for (int t = 0; t < NT; ++t) acc[r][t][i] = dp(acc[r][t][i], w, x[t] + c);
    }
  };
  avx512::over_vectors<A>(nv, step);
  avx512::reduce<R, NT, A>(acc, res);
}

// bf16 rows, K % 32 == 0, as before: no prefetch, two accumulators. With the least work per byte of all
// kinds they read at about the host's read rate already, and the prefetch measured slower here.
template <int R, int NT>
void dot_bf16(const Mat& m, const int* rows, const uint16_t* const* x, float res[][4]) {
  __m512 acc[R][NT][2];
  const uint8_t* q[R];
  for (int r = 0; r < R; ++r) {
    q[r] = m.q + rows[r] * m.row_bytes;
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  }
  int c = 0;
  for (; c + 64 <= m.K; c += 64)
    for (int r = 0; r < R; ++r) {
      __m512i w0 = _mm512_loadu_si512(q[r] + 2 * c), w1 = _mm512_loadu_si512(q[r] + 2 * c + 64);
      for (int t = 0; t < NT; ++t) {
        acc[r][t][0] = dp(acc[r][t][0], w0, x[t] + c);
        acc[r][t][1] = dp(acc[r][t][1], w1, x[t] + c + 32);
      }
    }
  if (c < m.K)
    for (int r = 0; r < R; ++r) {
      __m512i w0 = _mm512_loadu_si512(q[r] + 2 * c);
      for (int t = 0; t < NT; ++t) acc[r][t][0] = dp(acc[r][t][0], w0, x[t] + c);
    }
  avx512::reduce<R, NT, 2>(acc, res);
}

template <int R, int NT>
void dot(const Mat& m, const int* rows, const uint16_t* const* x, int kind, float res[][4]) {
  if (kind == KIND_INT3) return avx512vbmi::dot_int3<R, NT>(m, rows, x, res);  // a call: another target
  if (kind == KIND_INT4) return dot_int4<R, NT>(m, rows, x, res);
  if (kind == KIND_INT8) return dot_int8<R, NT>(m, rows, x, res);
  dot_bf16<R, NT>(m, rows, x, res);
}

}  // namespace avx512bf16
#pragma GCC pop_options
#endif  // TM_X86
