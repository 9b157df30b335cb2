// Fused CPU kernels for ernie5 (built on first use by ernie5/kernels/__init__.py).
//
// Each kernel replaces a chain of eager PyTorch ops that each stream the whole activation
// through memory: one pass reads the inputs, computes in fp32 and writes the outputs once.
// Tensors are bf16 or fp32; every kernel is also implemented in eager PyTorch in
// ernie5/kernels/ops.py, which is the reference the tests compare against.
//
// Determinism: at::parallel_for splits ranges statically for a given thread count, and every
// reduction runs in a fixed order inside one chunk, so results are bit-identical run to run
// (exact training resume relies on it).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

// cpu_decode.cpp (same extension): the few-row products the router uses for a decoding step.
bool rows_kernels_available();
torch::Tensor linear_rows_fp32(torch::Tensor x, torch::Tensor w);

namespace {

using namespace ernie5_kernels;

// ---------------------------------------------------------------- RMSNorm over the last dim

template <typename T>
void rms_fwd_impl(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> wf(d);
    for (int64_t j = 0; j < d; ++j) wf[j] = to_f(w[j]);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < d; ++j) {
        float v = to_f(xr[j]);
        ss += v * v;
      }
      float rs = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      rstd[r] = rs;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) yr[j] = from_f<T>(to_f(xr[j]) * rs * wf[j]);
    }
  });
}

template <typename T>
void rms_bwd_impl(const T* dy, const T* x, const T* w, const float* rstd, T* dx, float* dw_parts,
                  int64_t rows, int64_t d) {
  // dw_parts holds one fp32 row per chunk of rows; chunk boundaries depend only on rows and the
  // thread count, so the final sum over chunks is deterministic.
  int64_t nthreads = at::get_num_threads();
  int64_t chunk = (rows + nthreads - 1) / nthreads;
  at::parallel_for(0, nthreads, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> wf(d);
    for (int64_t j = 0; j < d; ++j) wf[j] = to_f(w[j]);
    for (int64_t c = c0; c < c1; ++c) {
      float* dwp = dw_parts + c * d;
      for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
        const T* xr = x + r * d;
        const T* dyr = dy + r * d;
        T* dxr = dx + r * d;
        float rs = rstd[r];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < d; ++j) {
          float xh = to_f(xr[j]) * rs;
          float g = to_f(dyr[j]);
          dot += g * wf[j] * xh;
          dwp[j] += g * xh;
        }
        float m = dot / static_cast<float>(d);
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
          float xh = to_f(xr[j]) * rs;
          dxr[j] = from_f<T>(rs * (to_f(dyr[j]) * wf[j] - xh * m));
        }
      }
    }
  });
}

std::vector<torch::Tensor> rms_norm_fwd(torch::Tensor x, torch::Tensor w, double eps) {
  auto dt = x.scalar_type();
  check(x, "x", dt);
  check(w, "weight", dt);
  int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(w.numel() == d, "weight has ", w.numel(), " elements, expected ", d);
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
  if (dt == torch::kBFloat16)
    rms_fwd_impl(ptr<uint16_t>(x), ptr<uint16_t>(w), ptr<uint16_t>(y), ptr<float>(rstd), rows, d, eps);
  else
    rms_fwd_impl(ptr<float>(x), ptr<float>(w), ptr<float>(y), ptr<float>(rstd), rows, d, eps);
  return {y, rstd};
}

std::vector<torch::Tensor> rms_norm_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor w, torch::Tensor rstd) {
  auto dt = x.scalar_type();
  check(dy, "grad", dt);
  check(x, "x", dt);
  check(w, "weight", dt);
  check(rstd, "rstd", torch::kFloat);
  int64_t d = x.size(-1), rows = x.numel() / d;
  auto dx = torch::empty_like(x);
  auto parts = torch::zeros({at::get_num_threads(), d}, x.options().dtype(torch::kFloat));
  if (dt == torch::kBFloat16)
    rms_bwd_impl(ptr<uint16_t>(dy), ptr<uint16_t>(x), ptr<uint16_t>(w), ptr<float>(rstd), ptr<uint16_t>(dx),
                 ptr<float>(parts), rows, d);
  else
    rms_bwd_impl(ptr<float>(dy), ptr<float>(x), ptr<float>(w), ptr<float>(rstd), ptr<float>(dx), ptr<float>(parts),
                 rows, d);
  return {dx, parts.sum(0)};
}

// ------------------------------------------- attention prologue: split qkv, QK-norm, RoPE
//
// qkv (B, T, H + 2K, Dh) -> q (B, H, T, Dh), k (B, K, T, Dh), v (B, K, T, Dh). q and k heads are
// RMS-normalised with their own weights (when given) and rotated by the half-split RoPE tables
// cos/sin (B, T, Dh/2), rounded to the activation dtype first, as the eager path does.

// One row's RoPE tables in the activation dtype T (bf16: rounded as from_f, then widened back).
template <typename T>
inline void rope_tables(const float* cos, const float* sin, int64_t p, float* cs, float* sn) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= p; j += 16) {
    __m512 c = _mm512_loadu_ps(cos + j), s = _mm512_loadu_ps(sin + j);
    if constexpr (std::is_same_v<T, uint16_t>) {
      _mm512_storeu_ps(cs + j, widen16(round16(c)));
      _mm512_storeu_ps(sn + j, widen16(round16(s)));
    } else {
      _mm512_storeu_ps(cs + j, c);
      _mm512_storeu_ps(sn + j, s);
    }
  }
#endif
  for (; j < p; ++j) {
    cs[j] = to_f(from_f<T>(cos[j]));
    sn[j] = to_f(from_f<T>(sin[j]));
  }
}

// DH > 0 fixes the head dim at compile time (32, 64, 128: see with_head_dim), so the short loops over
// one head are unrolled; DH = 0 is the generic runtime-size version. The rotation is computed into
// the fp32 scratch row ``tmp`` and rounded in a separate loop: with the rounding in the same loop GCC
// kept the whole rotation scalar (measured: 1.9 ms per nano layer, now about a quarter of it).
// With AVX-512 and a head dim that is a multiple of 32 (each half whole 16-lane vectors) the rows
// run on explicit vectors instead: on rows this short, the horizontal sums GCC emitted for the loops'
// reductions (QK-norm's sum of squares, the backward's dot product: chains of shuffles and scalar
// adds) and the scalar table rounding dominated. Nano shape (B 8, T 256, 8 + 2 + 2 heads of 32,
// bf16), isolated: forward 0.27 -> 0.12 ms, backward 0.38 -> 0.12 ms; nano training step, in-process
// A/B over 10 alternating steps: -3.5 to -10.5 ms (median paired difference, two runs).
// ``wf`` is all ones without QK-norm (multiplying by it is exact).
template <typename T, int DH>
inline void norm_rope_row(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ wf, bool norm,
                          float eps, const float* __restrict__ cs, const float* __restrict__ sn, int64_t dh_,
                          float* rstd_out, float* __restrict__ tmp) {
  const int64_t dh = DH > 0 ? DH : dh_, p = dh / 2;
#if defined(__AVX512F__)
  if constexpr (DH > 0 && DH % 32 == 0) {  // whole 16-lane vectors per half (see above)
    constexpr int NV = DH / 32;
    __m512 a[NV], b[NV];
    for (int v = 0; v < NV; ++v) {
      a[v] = load16(x + 16 * v);
      b[v] = load16(x + DH / 2 + 16 * v);
    }
    float rs = 1.f;
    if (norm) {
      __m512 ss = _mm512_setzero_ps();
      for (int v = 0; v < NV; ++v) ss = _mm512_fmadd_ps(b[v], b[v], _mm512_fmadd_ps(a[v], a[v], ss));
      rs = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(DH) + eps);
    }
    *rstd_out = rs;
    const __m512 r = _mm512_set1_ps(rs);
    for (int v = 0; v < NV; ++v) {
      __m512 n1 = _mm512_mul_ps(_mm512_mul_ps(a[v], r), _mm512_loadu_ps(wf + 16 * v));
      __m512 n2 = _mm512_mul_ps(_mm512_mul_ps(b[v], r), _mm512_loadu_ps(wf + DH / 2 + 16 * v));
      __m512 c = _mm512_loadu_ps(cs + 16 * v), s = _mm512_loadu_ps(sn + 16 * v);
      store16(out + 16 * v, _mm512_sub_ps(_mm512_mul_ps(n1, c), _mm512_mul_ps(n2, s)));
      store16(out + DH / 2 + 16 * v, _mm512_add_ps(_mm512_mul_ps(n2, c), _mm512_mul_ps(n1, s)));
    }
    return;
  }
#endif
  float rs = 1.f;
  if (norm) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < dh; ++j) {
      float v = to_f(x[j]);
      ss += v * v;
    }
    rs = 1.f / std::sqrt(ss / static_cast<float>(dh) + eps);
  }
  *rstd_out = rs;
#pragma omp simd
  for (int64_t j = 0; j < p; ++j) {
    float n1 = to_f(x[j]) * rs * wf[j], n2 = to_f(x[j + p]) * rs * wf[j + p];
    tmp[j] = n1 * cs[j] - n2 * sn[j];
    tmp[j + p] = n2 * cs[j] + n1 * sn[j];
  }
#pragma omp simd
  for (int64_t j = 0; j < dh; ++j) out[j] = from_f<T>(tmp[j]);
}

template <typename F> void with_head_dim(int64_t dh, F&& f) {
  switch (dh) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: f(std::integral_constant<int, 0>{});
  }
}

template <typename T, int DH>
void qk_rope_fwd_impl(const T* qkv, const T* qw, const T* kw, const float* cos, const float* sin, T* q, T* k, T* v,
                      float* rstd, int64_t b, int64_t t, int64_t h, int64_t kh, int64_t dh_, bool norm, float eps) {
  const int64_t dh = DH > 0 ? DH : dh_, p = dh / 2, nh = h + 2 * kh;
  at::parallel_for(0, b * t, 4, [&](int64_t r0, int64_t r1) {
    std::vector<float> qwf(dh, 1.f), kwf(dh, 1.f), cs(p), sn(p), tmp(dh);
    if (norm)
      for (int64_t j = 0; j < dh; ++j) {
        qwf[j] = to_f(qw[j]);
        kwf[j] = to_f(kw[j]);
      }
    for (int64_t r = r0; r < r1; ++r) {
      int64_t bi = r / t, ti = r % t;
      rope_tables<T>(cos + r * p, sin + r * p, p, cs.data(), sn.data());
      const T* row = qkv + r * nh * dh;
      for (int64_t hi = 0; hi < h; ++hi)
        norm_rope_row<T, DH>(row + hi * dh, q + ((bi * h + hi) * t + ti) * dh, qwf.data(), norm, eps, cs.data(),
                             sn.data(), dh, rstd + r * (h + kh) + hi, tmp.data());
      for (int64_t ki = 0; ki < kh; ++ki) {
        norm_rope_row<T, DH>(row + (h + ki) * dh, k + ((bi * kh + ki) * t + ti) * dh, kwf.data(), norm, eps,
                             cs.data(), sn.data(), dh, rstd + r * (h + kh) + h + ki, tmp.data());
        std::memcpy(v + ((bi * kh + ki) * t + ti) * dh, row + (h + kh + ki) * dh, dh * sizeof(T));
      }
    }
  });
}

template <typename T, int DH>
inline void norm_rope_row_bwd(const T* __restrict__ x, const T* __restrict__ dout, T* __restrict__ dx,
                              const float* __restrict__ wf, float* __restrict__ dwp, bool norm, float rs,
                              const float* __restrict__ cs, const float* __restrict__ sn, int64_t dh_,
                              float* __restrict__ dn) {
  const int64_t dh = DH > 0 ? DH : dh_, p = dh / 2;
#if defined(__AVX512F__)
  if constexpr (DH > 0 && DH % 32 == 0) {  // the same steps on whole vectors
    constexpr int NV = DH / 32, P = DH / 2;
    __m512 g[2 * NV];
    for (int v = 0; v < NV; ++v) {  // transpose of the rotation
      __m512 d1 = load16(dout + 16 * v), d2 = load16(dout + P + 16 * v);
      __m512 c = _mm512_loadu_ps(cs + 16 * v), s = _mm512_loadu_ps(sn + 16 * v);
      g[v] = _mm512_add_ps(_mm512_mul_ps(d1, c), _mm512_mul_ps(d2, s));
      g[NV + v] = _mm512_sub_ps(_mm512_mul_ps(d2, c), _mm512_mul_ps(d1, s));
    }
    if (!norm) {
      for (int v = 0; v < 2 * NV; ++v) store16(dx + 16 * v, g[v]);
      return;
    }
    const __m512 r = _mm512_set1_ps(rs);
    __m512 xs[2 * NV], dot = _mm512_setzero_ps();
    for (int v = 0; v < 2 * NV; ++v) {
      xs[v] = load16(x + 16 * v);
      __m512 xh = _mm512_mul_ps(xs[v], r);
      _mm512_storeu_ps(dwp + 16 * v, _mm512_fmadd_ps(g[v], xh, _mm512_loadu_ps(dwp + 16 * v)));
      g[v] = _mm512_mul_ps(g[v], _mm512_loadu_ps(wf + 16 * v));
      dot = _mm512_fmadd_ps(g[v], xh, dot);
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_add_ps(dot) / static_cast<float>(DH));
    for (int v = 0; v < 2 * NV; ++v)
      store16(dx + 16 * v, _mm512_mul_ps(r, _mm512_sub_ps(g[v], _mm512_mul_ps(_mm512_mul_ps(xs[v], r), m))));
    return;
  }
#endif
#pragma omp simd
  for (int64_t j = 0; j < p; ++j) {  // transpose of the rotation
    float d1 = to_f(dout[j]), d2 = to_f(dout[j + p]);
    dn[j] = d1 * cs[j] + d2 * sn[j];
    dn[j + p] = d2 * cs[j] - d1 * sn[j];
  }
  if (!norm) {
#pragma omp simd
    for (int64_t j = 0; j < dh; ++j) dx[j] = from_f<T>(dn[j]);
    return;
  }
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < dh; ++j) {
    float xh = to_f(x[j]) * rs;
    dwp[j] += dn[j] * xh;
    dn[j] *= wf[j];
    dot += dn[j] * xh;
  }
  float m = dot / static_cast<float>(dh);
#pragma omp simd
  for (int64_t j = 0; j < dh; ++j) dn[j] = rs * (dn[j] - to_f(x[j]) * rs * m);
#pragma omp simd
  for (int64_t j = 0; j < dh; ++j) dx[j] = from_f<T>(dn[j]);  // rounded apart, as in norm_rope_row
}

template <typename T, int DH>
void qk_rope_bwd_impl(const T* qkv, const T* qw, const T* kw, const float* cos, const float* sin, const float* rstd,
                      const T* dq, const T* dk, const T* dv, T* dqkv, float* dw_parts, int64_t b, int64_t t, int64_t h,
                      int64_t kh, int64_t dh_, bool norm) {
  const int64_t dh = DH > 0 ? DH : dh_, p = dh / 2, nh = h + 2 * kh, rows = b * t;
  int64_t nthreads = at::get_num_threads();
  int64_t chunk = (rows + nthreads - 1) / nthreads;
  at::parallel_for(0, nthreads, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> qwf(dh, 1.f), kwf(dh, 1.f), cs(p), sn(p), dn(dh);
    if (norm)
      for (int64_t j = 0; j < dh; ++j) {
        qwf[j] = to_f(qw[j]);
        kwf[j] = to_f(kw[j]);
      }
    for (int64_t c = c0; c < c1; ++c) {
      float* dqw = dw_parts + c * 2 * dh;
      float* dkw = dqw + dh;
      for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
        int64_t bi = r / t, ti = r % t;
        rope_tables<T>(cos + r * p, sin + r * p, p, cs.data(), sn.data());
        const T* row = qkv + r * nh * dh;
        T* drow = dqkv + r * nh * dh;
        const float* rs = rstd + r * (h + kh);
        for (int64_t hi = 0; hi < h; ++hi)
          norm_rope_row_bwd<T, DH>(row + hi * dh, dq + ((bi * h + hi) * t + ti) * dh, drow + hi * dh, qwf.data(), dqw, norm,
                            rs[hi], cs.data(), sn.data(), dh, dn.data());
        for (int64_t ki = 0; ki < kh; ++ki) {
          norm_rope_row_bwd<T, DH>(row + (h + ki) * dh, dk + ((bi * kh + ki) * t + ti) * dh, drow + (h + ki) * dh, kwf.data(),
                            dkw, norm, rs[h + ki], cs.data(), sn.data(), dh, dn.data());
          std::memcpy(drow + (h + kh + ki) * dh, dv + ((bi * kh + ki) * t + ti) * dh, dh * sizeof(T));
        }
      }
    }
  });
}

std::vector<torch::Tensor> qk_norm_rope_fwd(torch::Tensor qkv, torch::Tensor qw, torch::Tensor kw, torch::Tensor cos,
                                            torch::Tensor sin, int64_t h, int64_t kh, double eps) {
  auto dt = qkv.scalar_type();
  check(qkv, "qkv", dt);
  check(cos, "cos", torch::kFloat);
  check(sin, "sin", torch::kFloat);
  bool norm = qw.numel() > 0;
  if (norm) {
    check(qw, "q_norm weight", dt);
    check(kw, "k_norm weight", dt);
  }
  int64_t b = qkv.size(0), t = qkv.size(1), dh = qkv.size(3);
  TORCH_CHECK(qkv.size(2) == h + 2 * kh, "qkv has ", qkv.size(2), " heads, expected ", h + 2 * kh);
  TORCH_CHECK(dh % 2 == 0 && cos.numel() == b * t * (dh / 2) && sin.numel() == cos.numel(),
              "RoPE tables must be (B, T, head_dim / 2)");
  auto q = torch::empty({b, h, t, dh}, qkv.options());
  auto k = torch::empty({b, kh, t, dh}, qkv.options());
  auto v = torch::empty({b, kh, t, dh}, qkv.options());
  auto rstd = torch::empty({b, t, h + kh}, qkv.options().dtype(torch::kFloat));
  with_head_dim(dh, [&](auto fixed) {
    constexpr int DH = decltype(fixed)::value;
    if (dt == torch::kBFloat16)
      qk_rope_fwd_impl<uint16_t, DH>(ptr<uint16_t>(qkv), norm ? ptr<uint16_t>(qw) : nullptr,
                                     norm ? ptr<uint16_t>(kw) : nullptr, ptr<float>(cos), ptr<float>(sin),
                                     ptr<uint16_t>(q), ptr<uint16_t>(k), ptr<uint16_t>(v), ptr<float>(rstd), b, t, h, kh,
                                     dh, norm, eps);
    else
      qk_rope_fwd_impl<float, DH>(ptr<float>(qkv), norm ? ptr<float>(qw) : nullptr, norm ? ptr<float>(kw) : nullptr,
                                  ptr<float>(cos), ptr<float>(sin), ptr<float>(q), ptr<float>(k), ptr<float>(v),
                                  ptr<float>(rstd), b, t, h, kh, dh, norm, eps);
  });
  return {q, k, v, rstd};
}

std::vector<torch::Tensor> qk_norm_rope_bwd(torch::Tensor qkv, torch::Tensor qw, torch::Tensor kw, torch::Tensor cos,
                                            torch::Tensor sin, torch::Tensor rstd, torch::Tensor dq, torch::Tensor dk,
                                            torch::Tensor dv) {
  auto dt = qkv.scalar_type();
  check(qkv, "qkv", dt);
  check(dq, "grad q", dt);
  check(dk, "grad k", dt);
  check(dv, "grad v", dt);
  check(rstd, "rstd", torch::kFloat);
  bool norm = qw.numel() > 0;
  int64_t b = qkv.size(0), t = qkv.size(1), dh = qkv.size(3), h = dq.size(1), kh = dk.size(1);
  auto dqkv = torch::empty_like(qkv);
  auto parts = torch::zeros({at::get_num_threads(), 2, dh}, qkv.options().dtype(torch::kFloat));
  with_head_dim(dh, [&](auto fixed) {
    constexpr int DH = decltype(fixed)::value;
    if (dt == torch::kBFloat16)
      qk_rope_bwd_impl<uint16_t, DH>(ptr<uint16_t>(qkv), norm ? ptr<uint16_t>(qw) : nullptr,
                                     norm ? ptr<uint16_t>(kw) : nullptr, ptr<float>(cos), ptr<float>(sin),
                                     ptr<float>(rstd), ptr<uint16_t>(dq), ptr<uint16_t>(dk), ptr<uint16_t>(dv),
                                     ptr<uint16_t>(dqkv), ptr<float>(parts), b, t, h, kh, dh, norm);
    else
      qk_rope_bwd_impl<float, DH>(ptr<float>(qkv), norm ? ptr<float>(qw) : nullptr, norm ? ptr<float>(kw) : nullptr,
                                  ptr<float>(cos), ptr<float>(sin), ptr<float>(rstd), ptr<float>(dq), ptr<float>(dk),
                                  ptr<float>(dv), ptr<float>(dqkv), ptr<float>(parts), b, t, h, kh, dh, norm);
  });
  auto dw = parts.sum(0);
  return {dqkv, dw[0], dw[1]};
}

// --------------------------------------- gated SwiGLU activation of the batched MoE experts
//
// The per-expert loops are in cpu_common.h (the fused expert passes of cpu_expert_gemm.cpp run
// them too); here they run over every expert of a level.

template <typename T>
void swiglu_fwd_impl(const T* h, const T* gate, T* out, int64_t e, int64_t f, int64_t c, const int64_t* nv) {
  parallel_dynamic(e, [=](int64_t ei) {  // experts of uneven loads: handed out one at a time
    swiglu_fwd_expert(h + ei * 2 * f * c, gate + ei * c, out + ei * f * c, f, c, nv ? nv[ei] : c);
  });
}

template <typename T>
void swiglu_bwd_impl(const T* dout, const T* h, const T* gate, T* dh, float* dgate, int64_t e, int64_t f, int64_t c,
                     const int64_t* nv) {
  parallel_dynamic(e, [&](int64_t ei) {  // experts of uneven loads: handed out one at a time
    swiglu_bwd_expert(dout + ei * f * c, h + ei * 2 * f * c, gate + ei * c, dh + ei * 2 * f * c, dgate + ei * c, f, c,
                      nv ? nv[ei] : c);
  });
}

// Valid slots per expert (the rest of each expert's C slots are padding and are written as zero
// without being read), or nullptr (an empty tensor) for all C.
const int64_t* slot_counts(const torch::Tensor& n, int64_t e, int64_t c) {
  return n.numel() == 0 ? nullptr : expert_counts(n, e, c, "slot count");
}

torch::Tensor swiglu_gate_fwd(torch::Tensor h, torch::Tensor gate, torch::Tensor n) {
  auto dt = h.scalar_type();
  check(h, "h", dt);
  check(gate, "gate", dt);
  int64_t e = h.size(0), f = h.size(1) / 2, c = h.size(2);
  TORCH_CHECK(gate.numel() == e * c, "gate has ", gate.numel(), " elements, expected ", e * c);
  const int64_t* nv = slot_counts(n, e, c);
  auto out = torch::empty({e, f, c}, h.options());
  if (dt == torch::kBFloat16)
    swiglu_fwd_impl(ptr<uint16_t>(h), ptr<uint16_t>(gate), ptr<uint16_t>(out), e, f, c, nv);
  else
    swiglu_fwd_impl(ptr<float>(h), ptr<float>(gate), ptr<float>(out), e, f, c, nv);
  return out;
}

std::vector<torch::Tensor> swiglu_gate_bwd(torch::Tensor dout, torch::Tensor h, torch::Tensor gate, torch::Tensor n) {
  auto dt = h.scalar_type();
  check(dout, "grad", dt);
  check(h, "h", dt);
  check(gate, "gate", dt);
  int64_t e = h.size(0), f = h.size(1) / 2, c = h.size(2);
  const int64_t* nv = slot_counts(n, e, c);
  auto dh = torch::empty_like(h);
  auto dgate = torch::empty({e, c}, h.options().dtype(torch::kFloat));
  if (dt == torch::kBFloat16)
    swiglu_bwd_impl(ptr<uint16_t>(dout), ptr<uint16_t>(h), ptr<uint16_t>(gate), ptr<uint16_t>(dh), ptr<float>(dgate),
                    e, f, c, nv);
  else
    swiglu_bwd_impl(ptr<float>(dout), ptr<float>(h), ptr<float>(gate), ptr<float>(dh), ptr<float>(dgate), e, f, c,
                    nv);
  return {dh, dgate};
}

// ------------------------------------------------- AdamW step for fp32 master weights
//
// One pass per parameter: decoupled weight decay, the clip factor (inv_scale), the Adam moments,
// the bias-corrected update (the formula of PyTorch's fused AdamW), and, when a bf16 replica is
// given, the rounded copy of the new weight into it. The gradient is the replica's bf16 gradient
// or an fp32 (accumulated) one.

template <typename G, bool Replica>
void adamw_impl(float* p, const G* g, float* m, float* v, uint16_t* rep, int64_t n, float lr, float b1, float b2,
                float eps, float wd, float step_size, float bc2_sqrt, float inv_scale) {
  float decay = 1.f - lr * wd;
#if defined(__AVX512F__)
  if constexpr (Replica && std::is_same_v<G, uint16_t>) {
    // The training step's case (bf16 gradient, bf16 replica), 16 lanes at a time: the same
    // arithmetic, plus software prefetch of the four input streams 4 KB ahead and the replica
    // written with streaming stores (it is read again only by the next forward, long after it has
    // left the cache). 104M parameters on 2 Zen 5 cores, bound by memory: 33.8 -> 29.1 ms in a
    // quiet moment, 54.7 -> 51.1 ms (alternating) while the VM's memory bandwidth was contended.
    const bool stream = (reinterpret_cast<uintptr_t>(rep) & 31) == 0;
    const int64_t nv = n / 16;
    at::parallel_for(0, nv, 1 << 10, [=](int64_t c0, int64_t c1) {
      const __m512 vdecay = _mm512_set1_ps(decay), vb1 = _mm512_set1_ps(1.f - b1), vb2 = _mm512_set1_ps(b2);
      const __m512 vb2c = _mm512_set1_ps(1.f - b2), vss = _mm512_set1_ps(step_size);
      const __m512 vbc = _mm512_set1_ps(bc2_sqrt), veps = _mm512_set1_ps(eps), vis = _mm512_set1_ps(inv_scale);
      constexpr int64_t AHEAD = 1024;  // elements
      for (int64_t c = c0; c < c1; ++c) {
        int64_t i = c * 16;
        if (i + AHEAD < n) {
          _mm_prefetch(reinterpret_cast<const char*>(p + i + AHEAD), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(m + i + AHEAD), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v + i + AHEAD), _MM_HINT_T0);
          if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(g + i + AHEAD), _MM_HINT_T0);
        }
        __m512 gr = _mm512_mul_ps(load16(g + i), vis);
        __m512 pv = _mm512_mul_ps(_mm512_loadu_ps(p + i), vdecay);
        __m512 mo = _mm512_loadu_ps(m + i);
        __m512 mv = _mm512_add_ps(mo, _mm512_mul_ps(vb1, _mm512_sub_ps(gr, mo)));
        __m512 vv2 = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), vb2), _mm512_mul_ps(_mm512_mul_ps(vb2c, gr), gr));
        __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv2), vbc), veps);
        pv = _mm512_sub_ps(pv, _mm512_div_ps(_mm512_mul_ps(vss, mv), den));
        _mm512_storeu_ps(m + i, mv);
        _mm512_storeu_ps(v + i, vv2);
        _mm512_storeu_ps(p + i, pv);
        if (stream)
          _mm256_stream_si256(reinterpret_cast<__m256i*>(rep + i), round16(pv));
        else
          store16(rep + i, pv);
      }
      _mm_sfence();
    });
    if (nv * 16 == n) return;
    const int64_t done = nv * 16;
    p += done, g += done, m += done, v += done, rep += done, n -= done;  // the tail, below
  }
#endif
  at::parallel_for(0, n, 1 << 14, [=](int64_t i0, int64_t i1) {
    float* __restrict pp = p;
    float* __restrict mm = m;
    float* __restrict vv = v;
    const G* __restrict gg = g;
    uint16_t* __restrict rr = rep;
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      float gr = to_f(gg[i]) * inv_scale;
      float pv = pp[i] * decay;
      float mv = mm[i] + (1.f - b1) * (gr - mm[i]);
      float vv2 = vv[i] * b2 + (1.f - b2) * gr * gr;
      pv -= step_size * mv / (std::sqrt(vv2) / bc2_sqrt + eps);
      mm[i] = mv;
      vv[i] = vv2;
      pp[i] = pv;
      if constexpr (Replica) rr[i] = from_f<uint16_t>(pv);
    }
  });
}

template <typename G>
void adamw_dispatch(float* p, const G* g, float* m, float* v, uint16_t* rep, int64_t n, float lr, float b1,
                    float b2, float eps, float wd, float step_size, float bc2_sqrt, float inv_scale) {
  if (rep != nullptr)
    adamw_impl<G, true>(p, g, m, v, rep, n, lr, b1, b2, eps, wd, step_size, bc2_sqrt, inv_scale);
  else
    adamw_impl<G, false>(p, g, m, v, rep, n, lr, b1, b2, eps, wd, step_size, bc2_sqrt, inv_scale);
}

void adamw_step(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor replica, double lr,
                double beta1, double beta2, double eps, double weight_decay, double step, double inv_scale) {
  check(p, "param", torch::kFloat);
  check(m, "exp_avg", torch::kFloat);
  check(v, "exp_avg_sq", torch::kFloat);
  check(g, "grad", g.scalar_type());
  int64_t n = p.numel();
  TORCH_CHECK(g.numel() == n && m.numel() == n && v.numel() == n, "adamw_step: size mismatch");
  uint16_t* rep = nullptr;
  if (replica.numel() > 0) {
    check(replica, "replica", torch::kBFloat16);
    TORCH_CHECK(replica.numel() == n, "adamw_step: replica size mismatch");
    rep = ptr<uint16_t>(replica);
  }
  float step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, step)));
  float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  if (g.scalar_type() == torch::kBFloat16)
    adamw_dispatch(ptr<float>(p), ptr<uint16_t>(g), ptr<float>(m), ptr<float>(v), rep, n, lr, beta1, beta2, eps,
               weight_decay, step_size, bc2_sqrt, inv_scale);
  else {
    TORCH_CHECK(g.scalar_type() == torch::kFloat, "adamw_step: grad must be bf16 or fp32");
    adamw_dispatch(ptr<float>(p), ptr<float>(g), ptr<float>(m), ptr<float>(v), rep, n, lr, beta1, beta2, eps,
               weight_decay, step_size, bc2_sqrt, inv_scale);
  }
}

// Sum of squares of a bf16 or fp32 tensor in fp64, with a fixed reduction order.
template <typename G>
inline float block_sum_squares(const G* __restrict g, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    float x = to_f(g[i]);
    s += x * x;
  }
  return s;
}

template <typename G>
double sum_squares_impl(const G* g, int64_t n) {
  // fp32 within blocks of 4096, fp64 across blocks and chunks; chunk boundaries depend only on n
  // and the thread count, so the result is deterministic.
  int64_t nthreads = at::get_num_threads();
  int64_t chunk = (n + nthreads - 1) / nthreads;
  std::vector<double> parts(nthreads, 0.0);
  at::parallel_for(0, nthreads, 1, [=, &parts](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
      double acc = 0.0;
      for (int64_t b = lo; b < hi; b += 4096) acc += block_sum_squares(g + b, std::min<int64_t>(4096, hi - b));
      parts[c] = acc;
    }
  });
  double total = 0.0;
  for (double x : parts) total += x;
  return total;
}

double sum_squares(torch::Tensor g) {
  check(g, "grad", g.scalar_type());
  if (g.scalar_type() == torch::kBFloat16) return sum_squares_impl(ptr<uint16_t>(g), g.numel());
  TORCH_CHECK(g.scalar_type() == torch::kFloat, "sum_squares: bf16 or fp32 expected");
  return sum_squares_impl(ptr<float>(g), g.numel());
}

// ------------------------------------------------------------- MoE router: scores and top-k
//
// logits (N, E) fp32 -> scores (softmax over the available experts, or sigmoid), selection
// scores + bias (unavailable experts never selected), top-k by repeated argmax (ties: lowest
// index), gates = selected scores, renormalised to sum to one (norm) and scaled. Also the routed
// pairs per expert. The backward recomputes the scores from the logits.

inline void row_scores(const float* l, const bool* mask, bool sigmoid, float* p, int64_t e) {
  if (sigmoid) {
#pragma omp simd
    for (int64_t j = 0; j < e; ++j) p[j] = 1.f / (1.f + exp_f(-l[j]));
    if (mask)
      for (int64_t j = 0; j < e; ++j) p[j] = mask[j] ? p[j] : 0.f;
    return;
  }
  // Separate loops with simd reductions, so each vectorises (exp_f is branch-free).
  float mx = -INFINITY;
  if (mask) {
    for (int64_t j = 0; j < e; ++j)
      if (mask[j]) mx = std::max(mx, l[j]);
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < e; ++j) mx = std::max(mx, l[j]);
  }
#pragma omp simd
  for (int64_t j = 0; j < e; ++j) p[j] = exp_f(l[j] - mx);
  if (mask)
    for (int64_t j = 0; j < e; ++j) p[j] = mask[j] ? p[j] : 0.f;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < e; ++j) sum += p[j];
  float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = 0; j < e; ++j) p[j] *= inv;
}

// The first index of the largest of v[0..e) (ties: the lowest index; with NaNs, as the scalar
// loop: the first index whose value beats all before it). With AVX-512 and whole vectors, the max
// by vector compares and then the first lane equal to it: the scalar loop's chain of dependent
// compares and loads cost about 5 cycles per entry (0.22 of the 0.33 ms of route_topk_fwd at
// 2048 x 64, top-2, Zen 4).
inline int64_t argmax_first(const float* v, int64_t e) {
#if defined(__AVX512F__)
  if (e % 16 == 0) {
    __m512 m = _mm512_loadu_ps(v);
    for (int64_t j = 16; j < e; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(v + j));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int64_t j = 0; j < e; j += 16) {
      __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + j), mx, _CMP_EQ_OQ);
      if (eq) return j + __builtin_ctz(eq);
    }  // no lane equal to the max: NaNs, which the scalar loop below handles
  }
#endif
  int64_t best = 0;
  for (int64_t j = 1; j < e; ++j)
    if (v[j] > v[best]) best = j;
  return best;
}

std::vector<torch::Tensor> route_topk_fwd(torch::Tensor logits, torch::Tensor bias, torch::Tensor mask, int64_t k,
                                          bool sigmoid, bool norm, double scale) {
  check(logits, "logits", torch::kFloat);
  check(bias, "router bias", torch::kFloat);
  int64_t n = logits.size(0), e = logits.size(1);
  TORCH_CHECK(bias.numel() == e && k >= 1 && k <= e, "route_topk_fwd: bad shapes");
  const bool* mk = nullptr;
  if (mask.numel() > 0) {
    check(mask, "expert mask", torch::kBool);
    mk = mask.data_ptr<bool>();
  }
  auto ids = torch::empty({n, k}, logits.options().dtype(torch::kLong));
  auto gates = torch::empty({n, k}, logits.options());
  // A parallel region costs a few microseconds: a decoding step's few rows stay on one thread (the
  // rows are independent and the counts integers, so the split changes nothing in the results).
  int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 16));
  auto hist = torch::zeros({nthreads, e}, logits.options().dtype(torch::kLong));
  const float* lg = ptr<float>(logits);
  const float* bs = ptr<float>(bias);
  int64_t* id = ptr<int64_t>(ids);
  float* gt = ptr<float>(gates);
  int64_t* hs = ptr<int64_t>(hist);
  int64_t chunk = (n + nthreads - 1) / nthreads;
  at::parallel_for(0, nthreads, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> p(e), sel(e);
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* h = hs + c * e;
      for (int64_t r = c * chunk; r < std::min(n, (c + 1) * chunk); ++r) {
        row_scores(lg + r * e, mk, sigmoid, p.data(), e);
#pragma omp simd
        for (int64_t j = 0; j < e; ++j) sel[j] = p[j] + bs[j];
        if (mk)
          for (int64_t j = 0; j < e; ++j) sel[j] = mk[j] ? sel[j] : -INFINITY;
        float total = 0.f;
        for (int64_t a = 0; a < k; ++a) {
          int64_t best = argmax_first(sel.data(), e);
          sel[best] = -INFINITY;
          id[r * k + a] = best;
          gt[r * k + a] = p[best];
          total += p[best];
          h[best] += 1;
        }
        float f = static_cast<float>(scale) / (norm ? std::max(total, 1e-12f) : 1.f);
        for (int64_t a = 0; a < k; ++a) gt[r * k + a] *= f;
      }
    }
  });
  return {ids, gates, nthreads == 1 ? hist.view({e}) : hist.sum(0)};
}

torch::Tensor route_topk_bwd(torch::Tensor logits, torch::Tensor mask, torch::Tensor ids, torch::Tensor dgates,
                             bool sigmoid, bool norm, double scale) {
  check(logits, "logits", torch::kFloat);
  check(ids, "ids", torch::kLong);
  check(dgates, "grad gates", torch::kFloat);
  int64_t n = logits.size(0), e = logits.size(1), k = ids.size(1);
  const bool* mk = mask.numel() > 0 ? mask.data_ptr<bool>() : nullptr;
  auto dl = torch::zeros_like(logits);
  const float* lg = ptr<float>(logits);
  const int64_t* id = ptr<int64_t>(ids);
  const float* dg = ptr<float>(dgates);
  float* out = ptr<float>(dl);
  float sc = static_cast<float>(scale);
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(e), raw(k), draw(k);
    for (int64_t r = r0; r < r1; ++r) {
      row_scores(lg + r * e, mk, sigmoid, p.data(), e);
      float total = 0.f, dot = 0.f;
      for (int64_t a = 0; a < k; ++a) {
        raw[a] = p[id[r * k + a]];
        total += raw[a];
        dot += dg[r * k + a] * raw[a];
      }
      float s = norm ? std::max(total, 1e-12f) : 1.f;
      for (int64_t a = 0; a < k; ++a)
        draw[a] = norm ? sc * (dg[r * k + a] / s - dot / (s * s)) : sc * dg[r * k + a];
      float* o = out + r * e;
      if (sigmoid) {
        for (int64_t a = 0; a < k; ++a) {
          float sv = p[id[r * k + a]];
          o[id[r * k + a]] += draw[a] * sv * (1.f - sv);
        }
      } else {
        // Renormalised over the selected (norm), the gates do not depend on the other logits (the
        // softmax denominator cancels), and c = sum_a raw_a draw_a is zero up to rounding: only
        // the selected entries are written, which keeps the gradient exactly k-sparse for
        // router_logits_bwd's sparse pass.
        if (!norm) {
          float c = 0.f;
          for (int64_t a = 0; a < k; ++a) c += raw[a] * draw[a];
          for (int64_t j = 0; j < e; ++j) o[j] = -p[j] * c;
        }
        for (int64_t a = 0; a < k; ++a) o[id[r * k + a]] += raw[a] * draw[a];
      }
    }
  });
  return dl;
}

// ------------------------------------------------------- MoE dispatch into padded levels
//
// The index arithmetic of ernie5.model.moe.plan_dispatch: pairs (token, slot) sorted by expert
// (stable: in pair order within an expert) and laid out into levels; level j holds ranks
// [T_{j-1}, T_j) of every expert (all_experts) or of the experts with more than T_{j-1} pairs
// (ascending ids), padded with the lowest idle ones up to n_rows. Pad slots point at token
// n_tokens (a zero row) and pair n_pairs (a zero gate).

std::vector<torch::Tensor> dispatch_levels(torch::Tensor expert_ids, torch::Tensor counts, int64_t n_tokens,
                                           std::vector<int64_t> his, std::vector<int64_t> rows_per_level,
                                           std::vector<bool> all_experts) {
  check(expert_ids, "expert ids", torch::kLong);
  check(counts, "counts", torch::kLong);
  int64_t n_pairs = expert_ids.numel(), e = counts.numel(), n_levels = his.size();
  int64_t a = n_pairs / std::max<int64_t>(n_tokens, 1);
  const int64_t* ids = ptr<int64_t>(expert_ids);
  const int64_t* cnt = ptr<int64_t>(counts);
  std::vector<torch::Tensor> out;
  std::vector<int64_t*> tok(n_levels), pair(n_levels);
  std::vector<std::vector<int64_t>> local(n_levels, std::vector<int64_t>(e, -1));
  std::vector<int64_t> caps(n_levels);
  int64_t lo = 0;
  for (int64_t l = 0; l < n_levels; ++l) {
    caps[l] = his[l] - lo;
    int64_t rows = rows_per_level[l];
    torch::Tensor experts = torch::empty({0}, counts.options());
    if (all_experts[l]) {
      for (int64_t j = 0; j < e; ++j) local[l][j] = j;
    } else {
      std::vector<int64_t> list;
      for (int64_t j = 0; j < e; ++j)
        if (cnt[j] > lo) list.push_back(j);
      for (int64_t j = 0; j < e && static_cast<int64_t>(list.size()) < rows; ++j)
        if (cnt[j] <= lo) list.push_back(j);
      TORCH_CHECK(static_cast<int64_t>(list.size()) == rows, "dispatch_levels: level rows do not match counts");
      experts = torch::empty({rows}, counts.options());
      for (int64_t i = 0; i < rows; ++i) {
        experts.data_ptr<int64_t>()[i] = list[i];
        local[l][list[i]] = i;
      }
    }
    auto t = torch::full({rows * caps[l]}, n_tokens, counts.options());
    auto pr = torch::full({rows * caps[l]}, n_pairs, counts.options());
    tok[l] = t.data_ptr<int64_t>();
    pair[l] = pr.data_ptr<int64_t>();
    out.push_back(experts);
    out.push_back(t);
    out.push_back(pr);
    lo = his[l];
  }
  std::vector<int64_t> rank(e, 0);
  std::vector<int64_t> offs(n_levels, 0);  // first slot of each level in the concatenated slot space
  for (int64_t l = 1; l < n_levels; ++l) offs[l] = offs[l - 1] + rows_per_level[l - 1] * caps[l - 1];
  auto slot_of_pair = torch::empty({n_pairs}, counts.options());
  int64_t* sop = slot_of_pair.data_ptr<int64_t>();
  for (int64_t p = 0; p < n_pairs; ++p) {
    int64_t ex = ids[p];
    int64_t r = rank[ex]++;
    int64_t l = 0, base = 0;
    while (l < n_levels && r >= his[l]) base = his[l++];
    TORCH_CHECK(l < n_levels, "dispatch_levels: levels do not cover expert ", ex);
    int64_t slot = local[l][ex] * caps[l] + (r - base);
    tok[l][slot] = p / a;
    pair[l][slot] = p;
    sop[p] = offs[l] + slot;
  }
  out.push_back(slot_of_pair);
  return out;
}

// ------------------------------------------- MoE: gather rows into levels, combine them back
//
// gather_rows: out[s] = src[idx[s]], or a zero row where idx[s] == N (the pad slots of a level),
// so no zero-padded copy of the activations is made. combine_rows: the inverse of the dispatch,
// y[n] = sum_j rows[slot[n * A + j]] over a token's A (token, slot) pairs, summed in fp32 in slot
// order and written once (no zero fill, no scatter). The level outputs are either (R, C, D) row
// blocks or (R, D, C) (the batched GEMM's W @ X^T layout), read as strided columns.

template <typename T>
void gather_rows_impl(const T* src, const int64_t* idx, T* out, int64_t s, int64_t n, int64_t d) {
  at::parallel_for(0, s, 16, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      int64_t j = idx[i];
      TORCH_CHECK(j >= 0 && j <= n, "gather_rows: index ", j, " outside [0, ", n, "]");
      if (j < n)
        std::memcpy(out + i * d, src + j * d, d * sizeof(T));
      else
        std::memset(out + i * d, 0, d * sizeof(T));
    }
  });
}

torch::Tensor gather_rows(torch::Tensor src, torch::Tensor idx) {
  auto dt = src.scalar_type();
  check(src, "rows", dt);
  check(idx, "index", torch::kLong);
  TORCH_CHECK(src.dim() == 2, "gather_rows: rows must be 2-D (N, D)");
  int64_t n = src.size(0), d = src.size(1), s = idx.numel();
  auto out = torch::empty({s, d}, src.options());
  if (dt == torch::kBFloat16)
    gather_rows_impl(ptr<uint16_t>(src), ptr<int64_t>(idx), ptr<uint16_t>(out), s, n, d);
  else
    gather_rows_impl(ptr<float>(src), ptr<int64_t>(idx), ptr<float>(out), s, n, d);
  return out;
}

template <typename T>
void combine_impl(const std::vector<const T*>& lv, const std::vector<int64_t>& rows, const std::vector<int64_t>& caps,
                  bool transposed, const int64_t* slot, T* y, int64_t n, int64_t a, int64_t d, int64_t total) {
  std::vector<int64_t> offs(lv.size() + 1, 0);  // first slot of each level
  for (size_t l = 0; l < lv.size(); ++l) offs[l + 1] = offs[l] + rows[l] * caps[l];
  // The level of pair j of token t and the slot's index within it.
  auto locate = [&](int64_t t, int64_t j) -> std::pair<size_t, int64_t> {
    int64_t s = slot[t * a + j];
    TORCH_CHECK(s >= 0 && s < total, "combine_rows: slot ", s, " outside [0, ", total, ")");
    size_t l = std::upper_bound(offs.begin(), offs.end(), s) - offs.begin() - 1;
    return {l, s - offs[l]};
  };
#if defined(__AVX512F__)
  // Token rows in bf16: 16 lanes at a time, the same sums in the same order (0 + row 0 + row 1 ...),
  // rounded as from_f. GCC's vectorisation of the loops below (a zero fill, an add pass per row
  // and from_f per output) took 0.21 ms per call inside the nano MoE layer (2048 tokens x 2 pairs
  // x 256); this, 0.16 (Zen 4; isolated, rows in cache: 0.097 -> 0.063 ms).
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (!transposed && d % 16 == 0) {
      at::parallel_for(0, n, 16, [&](int64_t b, int64_t end) {
        std::vector<const T*> src(a);
        for (int64_t t = b; t < end; ++t) {
          for (int64_t j = 0; j < a; ++j) {
            auto [l, local] = locate(t, j);
            src[j] = lv[l] + local * d;
          }
          for (int64_t i = 0; i < d; i += 16) {
            __m512 v = _mm512_setzero_ps();
            for (int64_t j = 0; j < a; ++j) v = _mm512_add_ps(v, load16(src[j] + i));
            store16(y + t * d + i, v);
          }
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t t = b; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < a; ++j) {
        auto [l, local] = locate(t, j);
        if (transposed) {  // (R, D, C): the row is column c of expert r's block
          const T* col = lv[l] + (local / caps[l]) * d * caps[l] + local % caps[l];
          int64_t stride = caps[l];
          for (int64_t i = 0; i < d; ++i) acc[i] += to_f(col[i * stride]);
        } else {
          const T* row = lv[l] + local * d;
          for (int64_t i = 0; i < d; ++i) acc[i] += to_f(row[i]);
        }
      }
      T* o = y + t * d;
      for (int64_t i = 0; i < d; ++i) o[i] = from_f<T>(acc[i]);
    }
  });
}

torch::Tensor combine_rows(std::vector<torch::Tensor> levels, torch::Tensor slot_of_pair, int64_t n_tokens,
                           bool transposed) {
  TORCH_CHECK(!levels.empty(), "combine_rows: no levels");
  auto dt = levels[0].scalar_type();
  check(slot_of_pair, "slot_of_pair", torch::kLong);
  TORCH_CHECK(n_tokens > 0 && slot_of_pair.numel() % n_tokens == 0, "combine_rows: ", slot_of_pair.numel(),
              " pairs do not split over ", n_tokens, " tokens");
  int64_t a = slot_of_pair.numel() / n_tokens, d = levels[0].size(transposed ? 1 : 2), total = 0;
  std::vector<int64_t> rows, caps;
  for (auto& t : levels) {
    check(t, "level", dt);
    TORCH_CHECK(t.dim() == 3 && t.size(transposed ? 1 : 2) == d, "combine_rows: level of shape ", t.sizes(),
                " does not match the feature size ", d);
    rows.push_back(t.size(0));
    caps.push_back(t.size(transposed ? 2 : 1));
    total += t.size(0) * caps.back();
  }
  auto y = torch::empty({n_tokens, d}, levels[0].options());
  if (dt == torch::kBFloat16) {
    std::vector<const uint16_t*> p;
    for (auto& t : levels) p.push_back(ptr<uint16_t>(t));
    combine_impl(p, rows, caps, transposed, ptr<int64_t>(slot_of_pair), ptr<uint16_t>(y), n_tokens, a, d, total);
  } else {
    std::vector<const float*> p;
    for (auto& t : levels) p.push_back(ptr<float>(t));
    combine_impl(p, rows, caps, transposed, ptr<int64_t>(slot_of_pair), ptr<float>(y), n_tokens, a, d, total);
  }
  return y;
}

// ------------------------------------------------ cross-entropy over rows of logits
//
// Per row of (N, V) logits: the fp32 log-sum-exp (one exp pass serves it and the softmax) and
// the NLL of the target (0 where the target is IGNORE, i.e. negative); with a gradient scale,
// the row is overwritten in place with scale * (softmax - onehot(target)), rounded once to the
// logits' dtype. The fused linear cross-entropy (ernie5/model/loss.py) runs it on the logits of
// its one GEMM; _chunked_nll_eager there is the reference.

template <typename T>
void ce_rows_impl(T* logits, const int64_t* tgt, const float* scale, float* nll, int64_t n, int64_t v) {
  at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(v);
    for (int64_t r = r0; r < r1; ++r) {
      T* l = logits + r * v;
      int64_t t = tgt[r];
      TORCH_CHECK(t < v, "cross-entropy: target ", t, " outside the vocabulary of ", v);
      int64_t tc = t < 0 ? 0 : t;
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < v; ++j) mx = std::max(mx, to_f(l[j]));
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < v; ++j) {
        float e = exp_f(to_f(l[j]) - mx);
        p[j] = e;
        sum += e;
      }
      nll[r] = t < 0 ? 0.f : mx + std::log(sum) - to_f(l[tc]);
      if (scale != nullptr) {
        float s = scale[r], k = s / sum;
#pragma omp simd
        for (int64_t j = 0; j < v; ++j) l[j] = from_f<T>(p[j] * k);
        l[tc] = from_f<T>(p[tc] * k - s);
      }
    }
  });
}

torch::Tensor ce_rows(torch::Tensor logits, torch::Tensor targets, torch::Tensor grad_scale) {
  auto dt = logits.scalar_type();
  check(logits, "logits", dt);
  check(targets, "targets", torch::kLong);
  TORCH_CHECK(logits.dim() == 2 && targets.numel() == logits.size(0), "cross-entropy: logits ", logits.sizes(),
              " do not match ", targets.numel(), " targets");
  const float* scale = nullptr;
  if (grad_scale.numel() > 0) {
    check(grad_scale, "grad scale", torch::kFloat);
    TORCH_CHECK(grad_scale.numel() == logits.size(0), "cross-entropy: one grad scale per row expected");
    scale = ptr<float>(grad_scale);
  }
  int64_t n = logits.size(0), v = logits.size(1);
  auto nll = torch::empty({n}, logits.options().dtype(torch::kFloat));
  if (dt == torch::kBFloat16)
    ce_rows_impl(ptr<uint16_t>(logits), ptr<int64_t>(targets), scale, ptr<float>(nll), n, v);
  else if (dt == torch::kFloat)
    ce_rows_impl(ptr<float>(logits), ptr<int64_t>(targets), scale, ptr<float>(nll), n, v);
  else
    TORCH_CHECK(false, "cross-entropy: logits must be bf16 or fp32, got ", dt);
  return nll;
}

// ------------------------------------------------------------ router logits, in fp32 from bf16
//
// logits (N, E) = x (N, D) @ w (E, D)^T with fp32 products and sums: what F.linear(x.float(),
// w.float()) computes (the router keeps fp32 logits), without materialising the fp32 copies and
// without the fp32 GEMM library's poor efficiency at E = 64 columns (MKL: ~0.4 ms for each of the
// three products of a nano layer; these loops: about a quarter of that). Backward: dx = dlogits @ w
// (rounded to x's dtype), dw = dlogits^T @ x (rounded to w's dtype). AVX-512F register-blocked
// loops for E and D multiples of 16 (E <= 128); router_linear_available() says whether they were
// built. Every output element is one fixed-order sum, so results do not depend on the thread count.
// With AVX512-BF16, the bf16 forward uses dot-product instructions (router_fwd_rows_bf16), and the
// backward skips the zeros of a sparse logit gradient (router_bwd_sparse).

#if defined(__AVX512F__)
// NE = E / 16 accumulators per row, R rows at a time; wt is (D, E) fp32, xf an (R, D) fp32 scratch.
template <typename T, int NE, int R>
void router_fwd_rows(const T* x, const float* wt, float* out, int64_t d, int64_t e, float* xf) {
  for (int64_t i = 0; i < R * d; i += 16) _mm512_storeu_ps(xf + i, load16(x + i));
  __m512 acc[R][NE];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NE; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; ++k) {
    __m512 wv[NE];
    for (int j = 0; j < NE; ++j) wv[j] = _mm512_loadu_ps(wt + k * e + 16 * j);
    for (int r = 0; r < R; ++r) {
      __m512 xv = _mm512_set1_ps(xf[r * d + k]);
      for (int j = 0; j < NE; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NE; ++j) _mm512_storeu_ps(out + r * e + 16 * j, acc[r][j]);
}

// fn(r0, rows) over the n rows in blocks of R, rows a std::integral_constant (R, or 1 for the last
// rows one at a time), the blocks split among the threads.
template <int R, typename Fn>
void in_row_blocks(int64_t n, const Fn& fn) {
  at::parallel_for(0, (n + R - 1) / R, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t r0 = b * R;
      if (r0 + R <= n)
        fn(r0, std::integral_constant<int, R>{});
      else
        for (int64_t r = r0; r < n; ++r) fn(r, std::integral_constant<int, 1>{});
    }
  });
}

// f(std::integral_constant<int, E / 16>{}) for E a multiple of 16 up to 128 (router_shape_ok).
template <typename F>
void with_expert_vectors(int64_t e, F&& f) {
  switch (e / 16) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{});
  }
}

template <typename T, int NE>
void router_fwd_impl(const T* x, const float* wt, float* out, int64_t n, int64_t d, int64_t e) {
  constexpr int R = NE <= 4 ? 4 : 2;
  std::vector<std::vector<float>> xf(at::get_num_threads(), std::vector<float>(R * d));
  in_row_blocks<R>(n, [&](int64_t r0, auto rows) {
    router_fwd_rows<T, NE, decltype(rows)::value>(x + r0 * d, wt, out + r0 * e, d, e, xf[at::get_thread_num()].data());
  });
}

#if defined(__AVX512BF16__)
// bf16 x and w: the same sums by AVX512-BF16 dot products, two along D per instruction (the
// products of two bf16 are exact in fp32, as in the FMA loop; the sums run in another order).
// wp is (D/2, E) dwords, (w[e, 2k], w[e, 2k+1]). About twice the FMA loop's speed.
template <int NE, int R>
void router_fwd_rows_bf16(const uint32_t* x, const uint32_t* wp, float* out, int64_t d2, int64_t e) {
  __m512 acc[R][NE];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NE; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d2; ++k) {
    __m512bh wv[NE];
    for (int j = 0; j < NE; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + k * e + 16 * j);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * d2 + k]));
      for (int j = 0; j < NE; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NE; ++j) _mm512_storeu_ps(out + r * e + 16 * j, acc[r][j]);
}

template <int NE>
void router_fwd_bf16_impl(const uint16_t* x, const uint16_t* w, float* out, int64_t n, int64_t d, int64_t e) {
  constexpr int R = NE <= 4 ? 4 : 2;
  int64_t d2 = d / 2;
  std::vector<uint32_t> wp(d2 * e);
  for (int64_t j = 0; j < e; ++j)
    for (int64_t k = 0; k < d2; ++k)
      wp[k * e + j] = static_cast<uint32_t>(w[j * d + 2 * k]) | (static_cast<uint32_t>(w[j * d + 2 * k + 1]) << 16);
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  in_row_blocks<R>(n, [&](int64_t r0, auto rows) {
    router_fwd_rows_bf16<NE, decltype(rows)::value>(x32 + r0 * d2, wp.data(), out + r0 * e, d2, e);
  });
}
#endif

// dx rows: dx[n, c:c+16*NZ] = sum_e g[n, e] * wf[e, c:c+16*NZ], two rows at a time.
template <typename T, int NZ, int R>
void router_dx_rows(const float* g, const float* wf, T* dx, int64_t d, int64_t e, int64_t c) {
  __m512 acc[R][NZ];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < e; ++k) {
    __m512 wv[NZ];
    for (int j = 0; j < NZ; ++j) wv[j] = _mm512_loadu_ps(wf + k * d + c + 16 * j);
    for (int r = 0; r < R; ++r) {
      __m512 gv = _mm512_set1_ps(g[r * e + k]);
      for (int j = 0; j < NZ; ++j) acc[r][j] = _mm512_fmadd_ps(gv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NZ; ++j) store16(dx + r * d + c + 16 * j, acc[r][j]);
}

template <typename T, int R>
void router_dx_block(const float* g, const float* wf, T* dx, int64_t d, int64_t e) {
  for (int64_t c = 0; c < d; c += 128) {
    switch ((std::min<int64_t>(128, d - c)) / 16) {
      case 8: router_dx_rows<T, 8, R>(g, wf, dx, d, e, c); break;
      case 7: router_dx_rows<T, 7, R>(g, wf, dx, d, e, c); break;
      case 6: router_dx_rows<T, 6, R>(g, wf, dx, d, e, c); break;
      case 5: router_dx_rows<T, 5, R>(g, wf, dx, d, e, c); break;
      case 4: router_dx_rows<T, 4, R>(g, wf, dx, d, e, c); break;
      case 3: router_dx_rows<T, 3, R>(g, wf, dx, d, e, c); break;
      case 2: router_dx_rows<T, 2, R>(g, wf, dx, d, e, c); break;
      default: router_dx_rows<T, 1, R>(g, wf, dx, d, e, c);
    }
  }
}

// dw[e0:e0+4, c:c+64] = sum_n g[n, e] x[n, c:c+64]: one task per (4 experts, 64 columns).
template <typename T>
void router_dw_task(const float* g, const T* x, float* dw, int64_t n, int64_t d, int64_t e, int64_t e0, int64_t c) {
  __m512 acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t r = 0; r < n; ++r) {
    __m512 xv[4];
    for (int j = 0; j < 4; ++j) xv[j] = load16(x + r * d + c + 16 * j);
    for (int i = 0; i < 4; ++i) {
      __m512 gv = _mm512_set1_ps(g[r * e + e0 + i]);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(gv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(dw + (e0 + i) * d + c + 16 * j, acc[i][j]);
}

// The router's logit gradient is k-sparse per row (route_topk_bwd with sigmoid scores or
// renormalised gates writes only the selected experts): dx and dw then take only the nonzero
// entries, in the order the dense loops meet them (dx: over experts, dw: over rows, both
// ascending). Skipping an entry whose product is zero leaves every sum as it is (for finite x and
// w), so both passes give the same outputs bit for bit; the sparse one does k instead of E
// multiply-adds per row and output (64 -> 2 at the nano shape). One pass over the rows per block of
// 64 columns (x streamed in order, which the hardware prefetcher follows; dw's block accumulates in
// L1): 0.56-0.85 -> 0.13-0.18 ms at 2048 x 256 x 64.
template <typename T>
void router_bwd_sparse(const float* g, const T* x, const float* wf, T* dx, float* dw, int64_t n, int64_t d,
                       int64_t e) {
  at::parallel_for(0, d / 64, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> nz(e);
    std::vector<float> acc_dw(e * 64);
    for (int64_t c0 = 64 * b0; c0 < 64 * b1; c0 += 64) {
      std::fill(acc_dw.begin(), acc_dw.end(), 0.f);
      for (int64_t r = 0; r < n; ++r) {
        const float* gr = g + r * e;
        int32_t m = 0;
        for (int64_t j0 = 0; j0 < e; j0 += 16)
          for (uint32_t bits = _mm512_cmp_ps_mask(_mm512_loadu_ps(gr + j0), _mm512_setzero_ps(), _CMP_NEQ_UQ); bits;
               bits &= bits - 1)
            nz[m++] = static_cast<int32_t>(j0 + __builtin_ctz(bits));
        __m512 xv[4], acc[4];
        for (int q = 0; q < 4; ++q) {
          xv[q] = load16(x + r * d + c0 + 16 * q);
          acc[q] = _mm512_setzero_ps();
        }
        for (int32_t i = 0; i < m; ++i) {
          __m512 gv = _mm512_set1_ps(gr[nz[i]]);
          float* dwj = acc_dw.data() + nz[i] * 64;
          for (int q = 0; q < 4; ++q) {
            acc[q] = _mm512_fmadd_ps(gv, _mm512_loadu_ps(wf + nz[i] * d + c0 + 16 * q), acc[q]);
            _mm512_storeu_ps(dwj + 16 * q, _mm512_fmadd_ps(gv, xv[q], _mm512_loadu_ps(dwj + 16 * q)));
          }
        }
        for (int q = 0; q < 4; ++q) store16(dx + r * d + c0 + 16 * q, acc[q]);
      }
      for (int64_t j = 0; j < e; ++j) std::copy_n(acc_dw.data() + j * 64, 64, dw + j * d + c0);
    }
  });
}

// Whether at most a quarter of g's entries are nonzero (the sparse pass is then the faster).
bool mostly_zero(const float* g, int64_t count) {
  int64_t nz = 0;
#pragma omp simd reduction(+ : nz)
  for (int64_t i = 0; i < count; ++i) nz += g[i] != 0.f;
  return 4 * nz <= count;
}

bool router_linear_available() { return true; }

bool router_shape_ok(int64_t d, int64_t e) { return d % 64 == 0 && e % 16 == 0 && e <= 128 && d > 0 && e > 0; }

torch::Tensor router_logits_fwd(torch::Tensor x, torch::Tensor w) {
  auto dt = x.scalar_type();
  check(x, "x", dt);
  check(w, "router weight", dt);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "router: x ", x.sizes(), " and weight ",
              w.sizes(), " do not match");
  int64_t n = x.size(0), d = x.size(1), e = w.size(0);
  TORCH_CHECK(router_shape_ok(d, e), "router: needs d_model % 64 == 0 and n_experts % 16 == 0 (<= 128), got ", d,
              " and ", e);
  // A decoding step's few rows: fp32 dot products of the weight rows read in place, rather than
  // the repacked (bf16) or transposed fp32 copy of the weight that the row blocks below make per
  // call (5.5 / 13 us at one nano row, bf16 / fp32).
  if (n <= 4 && rows_kernels_available() && (dt == torch::kBFloat16 || dt == torch::kFloat))
    return linear_rows_fp32(x, w);
  auto out = torch::empty({n, e}, x.options().dtype(torch::kFloat));
#if defined(__AVX512BF16__)
  if (dt == torch::kBFloat16) {
    const uint16_t *xp = ptr<uint16_t>(x), *wp = ptr<uint16_t>(w);
    with_expert_vectors(e, [&](auto ne) {
      router_fwd_bf16_impl<decltype(ne)::value>(xp, wp, ptr<float>(out), n, d, e);
    });
    return out;
  }
#endif
  auto wt = w.to(torch::kFloat).t().contiguous();  // (D, E)
  auto run = [&](auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    with_expert_vectors(e, [&](auto ne) {
      router_fwd_impl<T, decltype(ne)::value>(xp, ptr<float>(wt), ptr<float>(out), n, d, e);
    });
  };
  if (dt == torch::kBFloat16)
    run(ptr<uint16_t>(x));
  else if (dt == torch::kFloat)
    run(ptr<float>(x));
  else
    TORCH_CHECK(false, "router: x must be bf16 or fp32, got ", dt);
  return out;
}

std::vector<torch::Tensor> router_logits_bwd(torch::Tensor g, torch::Tensor x, torch::Tensor w) {
  auto dt = x.scalar_type();
  check(g, "grad logits", torch::kFloat);
  check(x, "x", dt);
  check(w, "router weight", dt);
  int64_t n = x.size(0), d = x.size(1), e = w.size(0);
  TORCH_CHECK(g.dim() == 2 && g.size(0) == n && g.size(1) == e && router_shape_ok(d, e), "router: grad ", g.sizes(),
              " does not match x ", x.sizes(), " and weight ", w.sizes());
  auto wf = w.to(torch::kFloat).contiguous();  // (E, D)
  auto dx = torch::empty_like(x);
  auto dw = torch::empty({e, d}, x.options().dtype(torch::kFloat));
  const float* gp = ptr<float>(g);
  bool sparse = mostly_zero(gp, n * e);
  auto run = [&](auto* xp, auto* dxp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    if (sparse) return router_bwd_sparse<T>(gp, xp, ptr<float>(wf), dxp, ptr<float>(dw), n, d, e);
    at::parallel_for(0, (n + 1) / 2, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int64_t r0 = 2 * b;
        if (r0 + 2 <= n)
          router_dx_block<T, 2>(gp + r0 * e, ptr<float>(wf), dxp + r0 * d, d, e);
        else
          router_dx_block<T, 1>(gp + r0 * e, ptr<float>(wf), dxp + r0 * d, d, e);
      }
    });
    int64_t tasks_c = d / 64, tasks = (e / 4) * tasks_c;
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        router_dw_task<T>(gp, xp, ptr<float>(dw), n, d, e, (t / tasks_c) * 4, (t % tasks_c) * 64);
    });
  };
  if (dt == torch::kBFloat16)
    run(ptr<uint16_t>(x), ptr<uint16_t>(dx));
  else
    run(ptr<float>(x), ptr<float>(dx));
  return {dx, dw.to(w.scalar_type())};
}
#else
bool router_linear_available() { return false; }
torch::Tensor router_logits_fwd(torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "router kernels need a build with AVX-512F");
}
std::vector<torch::Tensor> router_logits_bwd(torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "router kernels need a build with AVX-512F");
}
#endif

}  // namespace

// cpu_attention.cpp (same extension)
bool attention_available();
bool attention_amx();
// cpu_expert_gemm.cpp (same extension)
bool expert_gemm_available();
torch::Tensor expert_up(torch::Tensor w13, torch::Tensor x, torch::Tensor n);
torch::Tensor expert_down(torch::Tensor w2, torch::Tensor g, torch::Tensor n);
torch::Tensor expert_down_dx(torch::Tensor w2, torch::Tensor dy, torch::Tensor n);
std::tuple<torch::Tensor, double> expert_down_dw(torch::Tensor dy, torch::Tensor g, torch::Tensor n);
torch::Tensor expert_up_dx(torch::Tensor dh, torch::Tensor w13, torch::Tensor n);
std::tuple<torch::Tensor, double> expert_up_dw(torch::Tensor dh, torch::Tensor x, torch::Tensor n);
std::vector<torch::Tensor> expert_ffn_fwd(torch::Tensor w13, torch::Tensor w2, torch::Tensor x, torch::Tensor tok,
                                          torch::Tensor gate, torch::Tensor n);
std::tuple<torch::Tensor, torch::Tensor, double, torch::Tensor, double, torch::Tensor> expert_ffn_bwd(
    torch::Tensor w13, torch::Tensor w2, torch::Tensor x, torch::Tensor tok, torch::Tensor h, torch::Tensor g,
    torch::Tensor gate, torch::Tensor dy, torch::Tensor n);
// cpu_infer_f32.cpp (same extension)
bool infer_f32_available();
torch::Tensor expert_ffn_infer(torch::Tensor w13, torch::Tensor w2, torch::Tensor x, torch::Tensor gates,
                               torch::Tensor tok, torch::Tensor pair, torch::Tensor n);
torch::Tensor attend_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, bool causal);
// cpu_decode.cpp (same extension)
bool rows_kernels_available();
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w);
torch::Tensor expert_rows(torch::Tensor x, torch::Tensor ids, torch::Tensor gates, torch::Tensor w13,
                          torch::Tensor w2);
torch::Tensor attend_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, bool causal);
torch::Tensor attend_rows_keys(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t s,
                               const torch::Tensor& mask, bool causal);

std::vector<torch::Tensor> attn_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, torch::Tensor bias,
                                    bool allow_amx);
std::vector<torch::Tensor> attn_bwd(torch::Tensor dO, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o,
                                    torch::Tensor lse, bool causal, torch::Tensor bias, bool allow_amx);

namespace {

// a + b rounded once to the storage type, as PyTorch adds bf16 or fp32 tensors (a few rows: no
// dispatch through TensorIterator).
torch::Tensor add_rows(const torch::Tensor& a, const torch::Tensor& b) {
  auto out = torch::empty_like(a);
  int64_t n = a.numel();
  auto run = [&](auto* ap) {
    using T = std::remove_pointer_t<decltype(ap)>;
    const T* bp = ptr<T>(b);
    T* op = ptr<T>(out);
    for (int64_t i = 0; i < n; ++i) op[i] = from_f<T>(to_f(ap[i]) + to_f(bp[i]));
  };
  if (a.scalar_type() == torch::kBFloat16)
    run(ptr<uint16_t>(a));
  else
    run(ptr<float>(a));
  return out;
}

// The new keys or values (B, K, T, Dh), contiguous, into the cache buffer (B, K, max_len, Dh) at
// positions [start, start + T).
void write_cache(torch::Tensor& cache, const torch::Tensor& fresh, int64_t start) {
  int64_t b = cache.size(0), kh = cache.size(1), len = cache.size(2), dh = cache.size(3), t = fresh.size(2);
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(fresh.data_ptr());
  const int64_t es = cache.element_size();
  for (int64_t i = 0; i < b * kh; ++i)
    std::memcpy(dst + (i * len + start) * dh * es, src + i * t * dh * es, t * dh * es);
}

// SwiGLU of a few rows, as ernie5.model.moe.SwiGLU runs them: w2(silu(g) * u), [g; u] = w13 x.
torch::Tensor swiglu_rows(const torch::Tensor& x, const torch::Tensor& w13, const torch::Tensor& w2) {
  auto gu = linear_rows(x, w13);
  auto parts = gu.chunk(2, -1);
  return linear_rows((at::silu(parts[0]) * parts[1]).contiguous(), w2);
}

}  // namespace

// One pre-norm block for the rows of a decoding step (cpu_decode.cpp says why): the kernels of the
// module-by-module path in its order, so the same arithmetic, in one call from Python. The
// arguments that change from step to step come first, the layer's weights and settings after.
// x (B, T, D); the new keys and values go into the cache buffers (B, K, max_len, Dh) at [start,
// start + T). The FFN is the MoE (router_w given: routed experts, plus the shared SwiGLU when s_w13 is given) or
// the dense SwiGLU (s_w13, s_w2). Returns {x_out (B, T, D), expert ids (B*T, k), gates (B*T, k)
// fp32, routed pairs per expert (E,)}; the last three empty for a dense FFN.
std::vector<torch::Tensor> decode_layer(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                        torch::Tensor v_cache, int64_t start, torch::Tensor mask, bool causal,
                                        torch::Tensor expert_mask, int64_t top_k, torch::Tensor attn_norm_w,
                                        double attn_eps, torch::Tensor wqkv, torch::Tensor qw, torch::Tensor kw,
                                        double qk_eps, torch::Tensor wo, torch::Tensor ffn_norm_w, double ffn_eps,
                                        torch::Tensor router_w, torch::Tensor router_bias, bool sigmoid,
                                        bool norm_topk, double route_scale, torch::Tensor w13, torch::Tensor w2,
                                        torch::Tensor s_w13, torch::Tensor s_w2, int64_t n_heads,
                                        int64_t n_kv_heads) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "decode_layer: x must be a contiguous (B, T, D) tensor");
  int64_t b = x.size(0), t = x.size(1), d = x.size(2), m = b * t;
  TORCH_CHECK(m >= 1 && m <= 4, "decode_layer: needs 1-4 token rows, got ", m);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == x.scalar_type() &&
                  v_cache.scalar_type() == x.scalar_type(),
              "decode_layer: the cache buffers must be contiguous (B, K, max_len, Dh) tensors of x's dtype");
  int64_t dh = k_cache.size(3), end = start + t;
  TORCH_CHECK(k_cache.size(0) == b && k_cache.size(1) == n_kv_heads && start >= 0 && end <= k_cache.size(2),
              "decode_layer: cache ", k_cache.sizes(), " cannot take positions [", start, ", ", end, ") of ", b,
              " rows and ", n_kv_heads, " kv heads");
  auto x_md = x.view({m, d});
  // Attention.
  auto h = rms_norm_fwd(x, attn_norm_w, attn_eps)[0];
  auto qkv = linear_rows(h.view({m, d}), wqkv).view({b, t, n_heads + 2 * n_kv_heads, dh});
  auto qkv_parts = qk_norm_rope_fwd(qkv, qw, kw, cos, sin, n_heads, n_kv_heads, qk_eps);
  write_cache(k_cache, qkv_parts[1], start);
  write_cache(v_cache, qkv_parts[2], start);
  auto o = attend_rows_keys(qkv_parts[0], k_cache, v_cache, end, mask, causal);  // (B, T, H, Dh)
  auto x1 = add_rows(x_md, linear_rows(o.view({m, n_heads * dh}), wo));
  // FFN.
  auto h2 = rms_norm_fwd(x1, ffn_norm_w, ffn_eps)[0];
  if (router_w.numel() == 0) {
    auto out = add_rows(x1, swiglu_rows(h2, s_w13, s_w2));
    auto none = torch::empty({0}, x.options());
    return {out.view({b, t, d}), none, none, none};
  }
  // fp32 logits, as ernie5.model.moe.route computes them: the router kernel where it takes the
  // shape, else an fp32 linear.
  auto logits = router_shape_ok(d, router_w.size(0))
                    ? router_logits_fwd(h2, router_w)
                    : at::linear(h2.to(torch::kFloat), router_w.to(torch::kFloat));
  auto bias = router_bias.scalar_type() == torch::kFloat ? router_bias : router_bias.to(torch::kFloat);
  auto routed = route_topk_fwd(logits, bias, expert_mask, top_k, sigmoid, norm_topk, route_scale);
  auto y = expert_rows(h2, routed[0], routed[1], w13, w2);
  if (s_w13.numel() > 0) y = add_rows(y, swiglu_rows(h2, s_w13, s_w2));
  return {add_rows(x1, y).view({b, t, d}), routed[0], routed[1], routed[2]};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_fwd", &rms_norm_fwd);
  m.def("rms_norm_bwd", &rms_norm_bwd);
  m.def("qk_norm_rope_fwd", &qk_norm_rope_fwd);
  m.def("qk_norm_rope_bwd", &qk_norm_rope_bwd);
  m.def("swiglu_gate_fwd", &swiglu_gate_fwd);
  m.def("swiglu_gate_bwd", &swiglu_gate_bwd);
  m.def("adamw_step", &adamw_step);
  m.def("sum_squares", &sum_squares);
  m.def("route_topk_fwd", &route_topk_fwd);
  m.def("route_topk_bwd", &route_topk_bwd);
  m.def("dispatch_levels", &dispatch_levels);
  m.def("gather_rows", &gather_rows);
  m.def("combine_rows", &combine_rows);
  m.def("ce_rows", &ce_rows);
  m.def("router_linear_available", &router_linear_available);
  m.def("router_logits_fwd", &router_logits_fwd);
  m.def("router_logits_bwd", &router_logits_bwd);
  m.def("expert_gemm_available", &expert_gemm_available);
  m.def("expert_up", &expert_up);
  m.def("expert_down", &expert_down);
  m.def("expert_down_dx", &expert_down_dx);
  m.def("expert_down_dw", &expert_down_dw);
  m.def("expert_up_dx", &expert_up_dx);
  m.def("expert_up_dw", &expert_up_dw);
  m.def("expert_ffn_fwd", &expert_ffn_fwd);
  m.def("expert_ffn_bwd", &expert_ffn_bwd);
  m.def("infer_f32_available", &infer_f32_available);
  m.def("expert_ffn_infer", &expert_ffn_infer);
  m.def("attend_f32", &attend_f32);
  m.def("attention_available", &attention_available);
  m.def("attention_amx", &attention_amx);
  m.def("attn_fwd", &attn_fwd);
  m.def("attn_bwd", &attn_bwd);
  m.def("rows_kernels_available", &rows_kernels_available);
  m.def("linear_rows", &linear_rows);
  m.def("expert_rows", &expert_rows);
  m.def("attend_rows", &attend_rows);
  m.def("decode_layer", &decode_layer);
}
