// Kernels for a handful of token rows: what decoding runs per new token (batch 1 to 4).
//
// At one row, PyTorch's bf16 linear (oneDNN) costs a fixed ~17 us per call whatever its size on a
// 2-core Zen 4 (25 us for the nano model's 384 x 256 qkv projection, 23 us for its 256 x 256
// output projection), and the MoE layer's gather path copies each selected expert's weights
// (768 KB in bf16 at the nano shape) before two batched products. Both are weight-streaming
// products of a few rows, so each output here is a dot product of a weight row, read in place,
// with every token row at once:
//
//   linear_rows   y (M, N) = x (M, K) @ w (N, K)^T                          M <= 4
//   expert_rows   y (M, D) = sum_a gate[m, a] * w2[e] (silu(g) * u)          e = ids[m, a],
//                 [g; u] = w13[e] (2F, D) @ x[m]                             M * A <= 16
//
// Sums are fp32 (bf16 products are exact in fp32; AVX512-BF16 dot products where the CPU has them,
// which flush denormals) in a fixed order that does not depend on M, the
// thread count or where an output falls in a block, and each output is rounded once to the
// storage type (nearest even). expert_rows rounds where the training kernels round: the up
// projection h and the gated activation silu(g) * u * gate are stored in the token's dtype, the
// down projection sums the pairs of a token in fp32 and rounds once (the gate is cast to the
// token's dtype first, as the MoE layer does).
//
//   attend_rows   o (B, Tq, H, Dh) = softmax(q k^T / sqrt(Dh) + mask) v     B * Tq <= 4, GQA, keys
//                 read in place from the KV cache (any batch / head / position strides)
//
// cpu_kernels.cpp composes these with its norm, RoPE and routing kernels into decode_layer, one
// whole pre-norm block for the few rows of a decoding step, with the same arithmetic as the
// module-by-module path.
//
// At one query, PyTorch's SDPA costs ~35 us a call on the nano shape (96 keys of 2 heads of 32),
// for some 50 K multiply-adds; attend_rows keeps one query row's scores in fp32, an exact softmax
// (exp512, 16 scores at a time) and one rounding per output: ~5 us. decode_layer exists because
// the per-module path runs some 60 PyTorch and kernel calls per layer, each 1-2 us of Python and
// dispatch here: about 2 of the 3 ms the nano model took per decoded token in bf16 (now ~0.9 ms).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__)
namespace {

using namespace ernie5_kernels;

// out[m * ldo + n] (fp32) = sum_k x[m * K + k] * w[n * K + k] for n in [n0, n1), all M rows.
template <typename T, int M>
void dot_rows(const T* __restrict x, const T* __restrict w, int64_t K, int64_t n0, int64_t n1, float* __restrict out,
              int64_t ldo) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    const T* wr = w + n * K;
    for (int64_t k = 0; k < K; k += 16) {
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = load16(wr + j * K + k);
      for (int m = 0; m < M; ++m) {
        __m512 xv = load16(x + m * K + k);
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) out[m * ldo + n + j] = _mm512_reduce_add_ps(acc[m][j]);
  }
  for (; n < n1; ++n) {  // the same sums, one output at a time
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 wv = load16(w + n * K + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(load16(x + m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

#if defined(__AVX512BF16__)
// bf16 x and w (K a multiple of 16): the same dot products by AVX512-BF16, 32 products per
// instruction, each product exact in fp32 and added in a fixed order (k pairs in sequence; the
// instruction flushes denormals). About 3x fewer instructions than widening to fp32 for the FMAs.
// The outputs go in groups of R weight rows, so that a single token row still has R independent
// sums in flight; every output's sum is the same whatever its group.
inline __m512bh bf16_32(const uint16_t* p, bool half) {
  return (__m512bh)(half ? _mm512_maskz_loadu_epi16(__mmask32(0xFFFF), p) : _mm512_loadu_si512(p));
}

template <int M, int R>
inline void dot_group_bf16(const uint16_t* __restrict x, const uint16_t* __restrict wr, int64_t K, float* out,
                           int64_t ldo) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const bool half = k + 32 > K;  // K % 32 == 16: the last 16, upper lanes zero
    __m512bh wv[R];
    for (int j = 0; j < R; ++j) wv[j] = bf16_32(wr + j * K + k, half);
    for (int m = 0; m < M; ++m) {
      __m512bh xv = bf16_32(x + m * K + k, half);
      for (int j = 0; j < R; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < R; ++j) out[m * ldo + j] = _mm512_reduce_add_ps(acc[m][j]);
}

template <int M>
void dot_rows_bf16(const uint16_t* x, const uint16_t* w, int64_t K, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int R = M == 1 ? 8 : 4;
  int64_t n = n0;
  for (; n + R <= n1; n += R) dot_group_bf16<M, R>(x, w + n * K, K, out + n, ldo);
  for (; n < n1; ++n) dot_group_bf16<M, 1>(x, w + n * K, K, out + n, ldo);
}
#endif

// out[m * ldo + n] = x[m] . w[n] in fp32 for n in [n0, n1): the AVX512-BF16 products for bf16
// where the CPU has them, else the fp32 FMA loop above.
template <typename T, int M>
inline void dot_rows_any(const T* x, const T* w, int64_t K, int64_t n0, int64_t n1, float* out, int64_t ldo) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) return dot_rows_bf16<M>(x, w, K, n0, n1, out, ldo);
#endif
  dot_rows<T, M>(x, w, K, n0, n1, out, ldo);
}

template <typename T>
void dot_rows_m(int64_t m, const T* x, const T* w, int64_t K, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  switch (m) {
    case 1: return dot_rows_any<T, 1>(x, w, K, n0, n1, out, ldo);
    case 2: return dot_rows_any<T, 2>(x, w, K, n0, n1, out, ldo);
    case 3: return dot_rows_any<T, 3>(x, w, K, n0, n1, out, ldo);
    default: return dot_rows_any<T, 4>(x, w, K, n0, n1, out, ldo);
  }
}

// Weight elements per thread below which a product stays on one thread (a parallel region costs
// a few microseconds; the nano model's attention projections stay serial, its 4096-row head splits).
constexpr int64_t kSerialElems = 1 << 17;

// y (m, n) in O: the fp32 sums rounded once (O = T), or kept (O = float, for fp32 logits).
template <typename T, typename O>
void linear_rows_impl(const T* x, const T* w, O* y, int64_t m, int64_t n, int64_t k) {
  // Outputs go to an fp32 scratch row block, then are rounded: the dot products never see T.
  std::vector<float> scratch(std::is_same_v<O, float> ? 0 : m * n);
  float* acc = std::is_same_v<O, float> ? reinterpret_cast<float*>(y) : scratch.data();
  int64_t blocks = (n + 3) / 4, grain = std::max<int64_t>(1, kSerialElems / (4 * k));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    dot_rows_m<T>(m, x, w, k, b0 * 4, std::min(n, b1 * 4), acc, n);
  });
  if constexpr (!std::is_same_v<O, float>)
    for (int64_t i = 0; i < m * n; ++i) y[i] = from_f<T>(acc[i]);
}

template <typename T>
void expert_rows_impl(const T* x, const int64_t* ids, const float* gates, const T* w13, const T* w2, T* y,
                      int64_t m, int64_t a, int64_t d, int64_t f) {
  int64_t pairs = m * a;
  std::vector<float> hf(pairs * 2 * f), yf(m * d);
  std::vector<T> act(pairs * f);
  int threads = 1;
#if defined(_OPENMP)
  // One parallel region with a barrier between the up and the down products, rather than a
  // region each (a handful per layer and token).
  threads = (pairs * 3 * f * d >= kSerialElems) ? at::get_num_threads() : 1;
#pragma omp parallel num_threads(threads)
#endif
  {
    int t = 0, nt = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    // Up: each thread a contiguous share of every pair's 2F outputs (blocks of 4 rows).
    int64_t blocks = (2 * f + 3) / 4, b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    for (int64_t p = 0; p < pairs; ++p) {
      const T* we = w13 + ids[p] * 2 * f * d;
      dot_rows_any<T, 1>(x + (p / a) * d, we, d, b0 * 4, std::min(2 * f, b1 * 4), hf.data() + p * 2 * f, 0);
    }
#if defined(_OPENMP)
#pragma omp barrier
#endif
    // The gated activation, from h rounded as the training kernels store it.
    for (int64_t p = t; p < pairs; p += nt) {
      float gate = to_f(from_f<T>(gates[p]));  // the gate in the token's dtype, as the MoE layer casts it
#pragma omp simd
      for (int64_t i = 0; i < f; ++i) {
        float g = to_f(from_f<T>(hf[p * 2 * f + i])), u = to_f(from_f<T>(hf[p * 2 * f + f + i]));
        act[p * f + i] = from_f<T>(g / (1.f + exp_f(-g)) * u * gate);
      }
    }
#if defined(_OPENMP)
#pragma omp barrier
#endif
    // Down: each thread a share of the D outputs; a token's pairs summed in order, then rounded.
    int64_t db = (d + 3) / 4, d0 = std::min(d, db * t / nt * 4), d1 = std::min(d, db * (t + 1) / nt * 4);
    std::vector<float> part(d1 > d0 ? d1 : 0);
    for (int64_t r = 0; r < m && d1 > d0; ++r) {
      for (int64_t j = 0; j < a; ++j) {
        int64_t p = r * a + j;
        const T* we = w2 + ids[p] * d * f;
        dot_rows_any<T, 1>(act.data() + p * f, we, f, d0, d1, part.data(), 0);
        for (int64_t i = d0; i < d1; ++i) yf[r * d + i] = j ? yf[r * d + i] + part[i] : part[i];
      }
    }
  }
  for (int64_t i = 0; i < m * d; ++i) y[i] = from_f<T>(yf[i]);
}


// One query row per (b, h, t): scores against the visible keys in fp32 (q widened exactly, one FMA
// chain of 16 lanes per key, reduced), an exact softmax (exp512 on 16 scores at a time), the
// weighted sum of values in fp32, rounded once. A key j < s is visible when the mask (B, Tq, S)
// allows it (no mask: all; causal: j <= t + s - Tq). A row that sees no key (only where the
// caller's mask says so) gets zeros.
template <typename T, int NV>  // NV = Dh / 16 vectors per row, kept in registers
void attend_impl(const T* q, int64_t qsb, int64_t qsh, int64_t qst, const T* k, const T* v, int64_t ksb, int64_t ksh,
                 int64_t kss, const bool* mask, bool causal, T* o, int64_t b, int64_t h, int64_t kh, int64_t tq,
                 int64_t s) {
  constexpr int64_t dh = NV * 16;
  const float scale = 1.f / std::sqrt(static_cast<float>(dh));
  const int64_t rows = b * h * tq, group = h / kh, s16 = (s + 15) / 16 * 16;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, s * dh));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> sc(s16);
    for (int64_t r = r0; r < r1; ++r) {
      int64_t bi = r / (h * tq), hi = (r / tq) % h, ti = r % tq, ki = hi / group;
      const T* qr = q + bi * qsb + hi * qsh + ti * qst;
      __m512 qv[NV];
      for (int c = 0; c < NV; ++c) qv[c] = _mm512_mul_ps(load16(qr + 16 * c), _mm512_set1_ps(scale));
      const T* kb = k + bi * ksb + ki * ksh;
      const T* vb = v + bi * ksb + ki * ksh;
      const bool* mr = mask ? mask + (bi * tq + ti) * s : nullptr;
      const int64_t end = causal ? std::min(s, ti + s - tq + 1) : s, end16 = (end + 15) / 16 * 16;
      float mx = -INFINITY;
      for (int64_t j = 0; j < end; ++j) {
        if (mr && !mr[j]) {
          sc[j] = -INFINITY;
          continue;
        }
        const T* kr = kb + j * kss;
        __m512 a = _mm512_mul_ps(qv[0], load16(kr));
        for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(qv[c], load16(kr + 16 * c), a);
        sc[j] = _mm512_reduce_add_ps(a);
        mx = std::max(mx, sc[j]);
      }
      T* orow = o + ((bi * tq + ti) * h + hi) * dh;
      if (mx == -INFINITY) {
        for (int64_t d = 0; d < dh; ++d) orow[d] = from_f<T>(0.f);
        continue;
      }
      for (int64_t j = end; j < end16; ++j) sc[j] = -INFINITY;
      const __m512 mxv = _mm512_set1_ps(mx);
      __m512 sumv = _mm512_setzero_ps();
      for (int64_t j = 0; j < end16; j += 16) {  // p = exp(score - max); masked keys: exp(-inf) = 0
        __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc.data() + j), mxv));
        _mm512_storeu_ps(sc.data() + j, p);
        sumv = _mm512_add_ps(sumv, p);
      }
      __m512 acc[NV];
      for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < end; ++j) {
        if (sc[j] == 0.f) continue;  // a masked key: nothing from its value, whatever it holds
        const __m512 pv = _mm512_set1_ps(sc[j]);
        const T* vr = vb + j * kss;
        for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(pv, load16(vr + 16 * c), acc[c]);
      }
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sumv));
      for (int c = 0; c < NV; ++c) store16(orow + 16 * c, _mm512_mul_ps(acc[c], inv));
    }
  });
}

}  // namespace

bool rows_kernels_available() { return true; }

namespace {

torch::Tensor linear_rows_to(torch::Tensor x, torch::Tensor w, bool fp32_out) {
  auto dt = x.scalar_type();
  check(x, "x", dt);
  check(w, "weight", dt);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_rows: x ", x.sizes(), " and weight ",
              w.sizes(), " do not match");
  int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  TORCH_CHECK(m >= 1 && m <= 4 && k % 16 == 0, "linear_rows: needs 1-4 rows and in_features % 16 == 0, got ", m,
              " and ", k);
  TORCH_CHECK(dt == torch::kBFloat16 || dt == torch::kFloat, "linear_rows: x must be bf16 or fp32, got ", dt);
  auto y = torch::empty({m, n}, x.options().dtype(fp32_out ? torch::kFloat : dt));
  if (dt == torch::kBFloat16 && fp32_out)
    linear_rows_impl(ptr<uint16_t>(x), ptr<uint16_t>(w), ptr<float>(y), m, n, k);
  else if (dt == torch::kBFloat16)
    linear_rows_impl(ptr<uint16_t>(x), ptr<uint16_t>(w), ptr<uint16_t>(y), m, n, k);
  else
    linear_rows_impl(ptr<float>(x), ptr<float>(w), ptr<float>(y), m, n, k);
  return y;
}

}  // namespace

torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) { return linear_rows_to(x, w, false); }

// linear_rows with the fp32 sums returned unrounded (the router's logits of a decoding step).
torch::Tensor linear_rows_fp32(torch::Tensor x, torch::Tensor w) { return linear_rows_to(x, w, true); }

torch::Tensor expert_rows(torch::Tensor x, torch::Tensor ids, torch::Tensor gates, torch::Tensor w13,
                          torch::Tensor w2) {
  auto dt = x.scalar_type();
  check(x, "x", dt);
  check(w13, "w13", dt);
  check(w2, "w2", dt);
  check(ids, "expert ids", torch::kLong);
  check(gates, "gates", torch::kFloat);
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "expert_rows: x (M, D), w13 (E, 2F, D), w2 (E, D, F)");
  int64_t m = x.size(0), d = x.size(1), e = w13.size(0), f = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * f && w13.size(2) == d && w2.size(0) == e && w2.size(1) == d,
              "expert_rows: w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not match x ", x.sizes());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == m && gates.sizes() == ids.sizes(), "expert_rows: ids ", ids.sizes(),
              " and gates ", gates.sizes(), " must both be (", m, ", A)");
  TORCH_CHECK(d % 16 == 0 && f % 16 == 0, "expert_rows: needs d_model and d_expert multiples of 16, got ", d, " and ",
              f);
  int64_t a = ids.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m * a; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < e, "expert_rows: expert id ", ip[i], " outside [0, ", e, ")");
  auto y = torch::empty({m, d}, x.options());
  if (m == 0) return y;
  if (dt == torch::kBFloat16)
    expert_rows_impl(ptr<uint16_t>(x), ip, ptr<float>(gates), ptr<uint16_t>(w13), ptr<uint16_t>(w2),
                     ptr<uint16_t>(y), m, a, d, f);
  else if (dt == torch::kFloat)
    expert_rows_impl(ptr<float>(x), ip, ptr<float>(gates), ptr<float>(w13), ptr<float>(w2), ptr<float>(y), m, a, d,
                     f);
  else
    TORCH_CHECK(false, "expert_rows: x must be bf16 or fp32, got ", dt);
  return y;
}


// attend_rows over the first s positions of k and v (B, K, >= s, Dh), e.g. whole KV-cache buffers;
// returns (B, Tq, H, Dh).
torch::Tensor attend_rows_keys(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t s,
                               const torch::Tensor& mask, bool causal) {
  auto dt = q.scalar_type();
  TORCH_CHECK(dt == torch::kBFloat16 || dt == torch::kFloat, "attend_rows: q must be bf16 or fp32, got ", dt);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend_rows: q (B, H, Tq, Dh), k and v (B, K, S, Dh)");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "attend_rows: k ", k.sizes(), " and v ", v.sizes(),
              " must have one shape and layout");
  int64_t b = q.size(0), h = q.size(1), tq = q.size(2), dh = q.size(3), kh = k.size(1);
  TORCH_CHECK(k.size(0) == b && k.size(3) == dh && kh > 0 && h % kh == 0 && s >= tq && s <= k.size(2),
              "attend_rows: q ", q.sizes(), " and k ", k.sizes(), " do not match");
  TORCH_CHECK(dh % 16 == 0 && dh <= 128, "attend_rows: needs a head dim that is a multiple of 16 up to 128, got ", dh);
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dt,
                "attend_rows: q, k and v must be CPU tensors of one dtype");
    TORCH_CHECK(t->stride(3) == 1, "attend_rows: the head dim must be contiguous");
  }
  const bool* mp = nullptr;
  if (mask.numel() > 0) {
    check(mask, "mask", torch::kBool);
    TORCH_CHECK(mask.numel() == b * tq * s, "attend_rows: mask has ", mask.numel(), " entries, expected B*Tq*S = ",
                b * tq * s);
    mp = mask.data_ptr<bool>();
  }
  auto o = torch::empty({b, tq, h, dh}, q.options());
  auto run = [&](auto* qp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    auto go = [&](auto nv) {
      attend_impl<T, decltype(nv)::value>(qp, q.stride(0), q.stride(1), q.stride(2), ptr<T>(k), ptr<T>(v),
                                          k.stride(0), k.stride(1), k.stride(2), mp, causal, ptr<T>(o), b, h, kh, tq,
                                          s);
    };
    switch (dh / 16) {
      case 1: return go(std::integral_constant<int, 1>{});
      case 2: return go(std::integral_constant<int, 2>{});
      case 3: return go(std::integral_constant<int, 3>{});
      case 4: return go(std::integral_constant<int, 4>{});
      case 5: return go(std::integral_constant<int, 5>{});
      case 6: return go(std::integral_constant<int, 6>{});
      case 7: return go(std::integral_constant<int, 7>{});
      default: return go(std::integral_constant<int, 8>{});
    }
  };
  if (dt == torch::kBFloat16)
    run(ptr<uint16_t>(q));
  else
    run(ptr<float>(q));
  return o;
}

torch::Tensor attend_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, bool causal) {
  TORCH_CHECK(k.dim() == 4, "attend_rows: q (B, H, Tq, Dh), k and v (B, K, S, Dh)");
  return attend_rows_keys(q, k, v, k.size(2), mask, causal).permute({0, 2, 1, 3});  // (B, H, Tq, Dh) view
}

#else  // no AVX-512F: the callers use PyTorch

bool rows_kernels_available() { return false; }
torch::Tensor linear_rows(torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "linear_rows needs AVX-512F"); }
torch::Tensor linear_rows_fp32(torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "linear_rows needs AVX-512F"); }
torch::Tensor expert_rows(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "expert_rows needs AVX-512F");
}

torch::Tensor attend_rows(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, bool) {
  TORCH_CHECK(false, "attend_rows needs AVX-512F");
}
torch::Tensor attend_rows_keys(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, int64_t,
                               const torch::Tensor&, bool) {
  TORCH_CHECK(false, "attend_rows needs AVX-512F");
}

#endif
