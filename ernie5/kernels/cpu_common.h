// Helpers shared by cpu_kernels.cpp, cpu_attention.cpp and cpu_expert_gemm.cpp: bf16 <-> fp32
// conversion (bf16 handled as raw uint16 bits; scalar, and 16 lanes on AVX-512), a vectorisable
// exp, dynamic scheduling of uneven items (experts), raw data pointers and input checks.
#pragma once

#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ernie5_kernels {

inline float to_f(float v) { return v; }
inline float to_f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline uint16_t from_f<uint16_t>(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return std::isnan(f) ? static_cast<uint16_t>(0x7FC0) : r;
}

// exp(x) in fp32 without libm, so loops over it vectorise: Cephes' range reduction
// x = n ln2 + r and degree-6 polynomial for e^r (about 2 ulp), inputs clamped to the normal range.
inline float exp_f(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  float t = x * 1.44269504088896341f;
  int32_t ni = static_cast<int32_t>(t + std::copysign(0.5f, t));  // nearest integer
  float n = static_cast<float>(ni);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float e = p * r * r + r + 1.f;
  uint32_t bits = static_cast<uint32_t>(ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return e * scale;
}

#if defined(__AVX512F__)
// 16 lanes at a time: load as fp32 (bf16 widened exactly) and store rounded like from_f.
inline __m512 widen16(__m256i b) {  // 16 bf16 -> fp32, exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m256i round16(__m512 v) {  // from_f<uint16_t> on 16 lanes: nearest even, NaN -> 0x7FC0
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round16(v)); }
#endif

// fn(i) for i in [0, n), the items handed out one at a time to the threads (for items of uneven
// cost, such as experts with different loads; at::parallel_for splits the range statically).
template <typename Fn>
void parallel_dynamic(int64_t n, const Fn& fn) {
  std::atomic<int64_t> next{0};
  int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 0) return;
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

// ------------------------------------------------ gated SwiGLU activation of one MoE expert
//
// h (2F, C): rows [0, F) are the gate projection g, rows [F, 2F) the up projection u, with the C
// token slots contiguous, cv of them valid (the rest are padding, written as zero without being
// read). gate (C). Forward: out (F, C) = silu(g) * u * gate. Backward: d_out (F, C) -> d_h (2F, C)
// and d_gate (C) = sum_f d_out * silu(g) * u (fp32).

template <typename T>
inline void swiglu_fwd_row(const T* __restrict g, const T* __restrict u, const T* __restrict gt, T* __restrict o,
                           int64_t c) {
#pragma omp simd
  for (int64_t j = 0; j < c; ++j) {
    float gv = to_f(g[j]);
    float s = gv / (1.f + exp_f(-gv));
    o[j] = from_f<T>(s * to_f(u[j]) * to_f(gt[j]));
  }
}

template <typename T>
inline void swiglu_bwd_row(const T* __restrict d, const T* __restrict g, const T* __restrict u,
                           const T* __restrict gt, T* __restrict dg, T* __restrict du, float* __restrict acc,
                           int64_t c) {
#pragma omp simd
  for (int64_t j = 0; j < c; ++j) {
    float gv = to_f(g[j]), uv = to_f(u[j]), dv = to_f(d[j]);
    float sig = 1.f / (1.f + exp_f(-gv));
    float sg = gv * sig;
    acc[j] += dv * sg * uv;
    float da = dv * to_f(gt[j]);
    du[j] = from_f<T>(da * sg);
    dg[j] = from_f<T>(da * uv * sig * (1.f + gv * (1.f - sig)));
  }
}

#if defined(__AVX512F__)
// Cephes-style expf on 16 lanes: range reduction by ln2 (hi/lo), degree-6 polynomial, scalef. ~1-2 ulp;
// exp(-inf) and anything below -103.9 give exactly 0 (the attention softmax's masked scores).
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-103.9f), hi = _mm512_set1_ps(88.72f);
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);  // includes -inf
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  y = _mm512_scalef_ps(y, n);
  return _mm512_maskz_mov_ps(__mmask16(~under), y);
}

// 16 x 16 dword transpose: dst[k][r] = src_r[k] for the 16 rows row(0) ... row(15), rows of dst
// ld dwords apart.
template <typename Row>
inline void transpose16(const Row& row, uint32_t* dst, int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(row(i));
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + j] holds, in each 128-bit lane L, column 4L + j of rows 4q..4q+3.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * ld, r[i]);  // r[i]: column i of the 16 rows
}

// ... of rows ls dwords apart from src.
inline void transpose16(const uint32_t* src, int64_t ls, uint32_t* dst, int64_t ld) {
  transpose16([=](int i) { return src + i * ls; }, dst, ld);
}

// 16 bf16 lanes (the first `m`) to fp32, and back rounded to nearest even.
inline __m512 load16m(const uint16_t* p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }
inline void store16m(uint16_t* p, __mmask16 m, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
#else
  _mm256_mask_storeu_epi16(p, m, round16(v));
#endif
}
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// The bf16 rows written with intrinsics (the rounding by one AVX512-BF16 conversion where the CPU
// has it: GCC's vectorisation of from_f above took a dozen instructions per output vector). At 64
// experts x 256 x 72 slots, swiglu_gate_fwd 0.74 -> 0.36 ms and swiglu_gate_bwd 1.04 -> 0.52 ms
// (Zen 4); against the loops above, the forward's outputs were identical, 4 in 2.4 M of d_h differed
// in the last bit and d_gate by 2e-8 of its largest value.
inline void swiglu_fwd_row(const uint16_t* __restrict g, const uint16_t* __restrict u, const uint16_t* __restrict gt,
                           uint16_t* __restrict o, int64_t c) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < c; j += 16) {
    __mmask16 m = lanes(c - j);
    __m512 gv = load16m(g + j, m);
    __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    store16m(o + j, m, _mm512_mul_ps(_mm512_mul_ps(s, load16m(u + j, m)), load16m(gt + j, m)));
  }
}

inline void swiglu_bwd_row(const uint16_t* __restrict d, const uint16_t* __restrict g, const uint16_t* __restrict u,
                           const uint16_t* __restrict gt, uint16_t* __restrict dg, uint16_t* __restrict du,
                           float* __restrict acc, int64_t c) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < c; j += 16) {
    __mmask16 m = lanes(c - j);
    __m512 gv = load16m(g + j, m), uv = load16m(u + j, m), dv = load16m(d + j, m);
    __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    __m512 sg = _mm512_mul_ps(gv, sig);
    _mm512_mask_storeu_ps(acc + j, m, _mm512_fmadd_ps(_mm512_mul_ps(dv, sg), uv, _mm512_maskz_loadu_ps(m, acc + j)));
    __m512 da = _mm512_mul_ps(dv, load16m(gt + j, m));
    store16m(du + j, m, _mm512_mul_ps(da, sg));
    __m512 dsilu = _mm512_mul_ps(sig, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, sig), one));  // sig (1 + g (1 - sig))
    store16m(dg + j, m, _mm512_mul_ps(_mm512_mul_ps(da, uv), dsilu));
  }
}
#endif

// Columns a row loop runs over for cv valid slots of c: cv rounded up to whole 16-lane vectors
// (at most c), so the vector loop has no scalar remainder (GCC 12 finishes an `omp simd` loop with
// scalar iterations, each a scalar exp here); what it computes past cv is overwritten with zeros.
inline int64_t vector_width(int64_t cv, int64_t c) { return std::min(c, (cv + 15) / 16 * 16); }

template <typename T>
void swiglu_fwd_expert(const T* h, const T* gate, T* out, int64_t f, int64_t c, int64_t cv) {
  int64_t cw = vector_width(cv, c);
  for (int64_t fi = 0; fi < f; ++fi) {
    swiglu_fwd_row(h + fi * c, h + (f + fi) * c, gate, out + fi * c, cw);
    std::fill(out + fi * c + cv, out + (fi + 1) * c, T(0));  // pad slots: what h = 0 would give
  }
}

template <typename T>
void swiglu_bwd_expert(const T* dout, const T* h, const T* gate, T* dh, float* dgate, int64_t f, int64_t c,
                       int64_t cv) {
  int64_t cw = vector_width(cv, c);
  std::fill(dgate, dgate + c, 0.f);
  for (int64_t fi = 0; fi < f; ++fi) {
    T* dg = dh + fi * c;
    swiglu_bwd_row(dout + fi * c, h + fi * c, h + (f + fi) * c, gate, dg, dg + f * c, dgate, cw);
    std::fill(dg + cv, dg + c, T(0));  // pad slots: zero, as h = 0 and d_out = 0 there would give
    std::fill(dg + f * c + cv, dg + f * c + c, T(0));
  }
  std::fill(dgate + cv, dgate + c, 0.f);
}

// Stored element type of a tensor: bf16 is handled as raw uint16 bits.
template <typename T> inline T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

inline void check(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

// The valid rows (slots) of each expert in a padded (E, cap, ...) level: one int64 per expert, each
// in [0, cap]; `what` names them in the errors.
inline const int64_t* expert_counts(const torch::Tensor& n, int64_t n_exp, int64_t cap, const char* what) {
  TORCH_CHECK(n.device().is_cpu() && n.scalar_type() == torch::kLong && n.is_contiguous() && n.numel() == n_exp, what,
              "s: one int64 count per expert expected, got ", n.numel(), " for ", n_exp, " experts");
  const int64_t* p = n.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_exp; ++i) TORCH_CHECK(p[i] >= 0 && p[i] <= cap, what, " ", p[i], " outside [0, ", cap, "]");
  return p;
}

}  // namespace ernie5_kernels
