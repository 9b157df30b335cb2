// fp32 kernels for inference (no gradient): the MoE layer's experts and attention, each one pass
// over exactly the work there is. Both use one register-tiled fp32 product (`gemm` below: rows of
// A broadcast as they lie, 16-lane vectors of B, fp32 FMA accumulators over the whole reduction),
// so each output is one sum in order of k; results differ from PyTorch's only in rounding.
//
// expert_ffn_infer: every routed (token, expert) pair's y = w2 (silu(w13_gate x) * (w13_up x) * gate),
// computed for exactly the routed rows of each expert (no padding), then each token's pairs summed
// in pair order. It replaces, in fp32 (ernie5/model/moe.py, _GroupedSwiGLU), padded torch.bmm levels
// whose plan, an exhaustive search over level capacities, took ~1.7 ms per layer in Python, plus a
// gathered copy of the weights of every subset level. In a 1 x 512 nano prefill (Zen 4, 2 threads)
// the bmm calls alone took 82 ms of the forward's 136.
// Work items are (expert, block of up to kCols of its token rows), the most loaded experts first,
// handed out one at a time. An item runs end to end on one thread, its operands in a per-thread
// scratch that stays in L2:
//   xb (D, w)  = the block's token rows, transposed (w: the rows rounded up to whole 16-lane vectors,
//                zero past them);
//   h  (2F, w) = w13_e (2F, D) @ xb, then g = silu(h[:F]) * h[F:] * gate written over h[:F];
//   yt (D, w)  = w2_e (D, F) @ g, transposed in 16 x 16 blocks into the pairs' output rows.
// The products broadcast weight elements as they lie (rows of 16, 12, 8 or 6, for 1, 2, 3 or 4
// vectors of token columns).
//
// attend_f32: softmax(q k^T / sqrt(Dh) + mask) v with whole key rows and an exact softmax. Each kv
// head's keys are transposed once to (Dh, S), so scores come 16 keys per vector with no horizontal
// sums (the few-query attend_rows of cpu_decode.cpp sums each key's products across lanes, which
// is right for one query, not for hundreds). Work items are (batch row, head, 32 query rows):
// scores (32, S) in a per-thread scratch, the softmax in place, then P @ V. Nano, 512 causal
// queries and keys: 1.0 ms against PyTorch's fp32 SDPA 2.6 ms; 2048: 13.7 against 19.9 (Zen 4, 2
// threads; ~0.9 of the measured fp32 peak at 2048).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

namespace {

using namespace ernie5_kernels;

#if defined(__AVX512F__)

constexpr int64_t kCols = 64;  // token rows per work item: 4 vectors, one column chunk

// C[r][16 j + l] = sum_k A[r * ars + k] * B[k * ldb + 16 j + l] for r < R, j < Z; whole vectors.
// With pf (the next tile's A rows, ars apart), one of their cache lines is fetched per step of k
// until all are, as the bf16 expert kernels do: A is a weight streamed from memory.
template <int R, int Z>
inline void micro(const float* a, int64_t ars, const float* b, int64_t ldb, int64_t kn, float* c, int64_t ldc,
                  const float* pf = nullptr) {
  const int64_t pf_n = pf ? R * ((kn + 15) / 16) : 0;
  __m512 acc[R][Z];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < Z; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kn; ++k) {
    if (k < pf_n) _mm_prefetch(reinterpret_cast<const char*>(pf + (k % R) * ars + (k / R) * 16), _MM_HINT_T0);
    __m512 bv[Z];
#pragma GCC unroll 4
    for (int j = 0; j < Z; ++j) bv[j] = _mm512_loadu_ps(b + k * ldb + 16 * j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512 av = _mm512_set1_ps(a[r * ars + k]);
#pragma GCC unroll 4
      for (int j = 0; j < Z; ++j) acc[r][j] = _mm512_fmadd_ps(av, bv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < Z; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
}

template <int Z, int R>
inline void rows_tail(int64_t rem, const float* a, int64_t ars, const float* b, int64_t ldb, int64_t kn, float* c,
                      int64_t ldc) {
  if constexpr (R > 0) {
    if (rem == R) micro<R, Z>(a, ars, b, ldb, kn, c, ldc);
    else rows_tail<Z, R - 1>(rem, a, ars, b, ldb, kn, c, ldc);
  }
}

// C (m, 16 Z) = A (m, kn; rows ars apart) @ B (kn, 16 Z; rows ldb apart), rows in tiles of at
// most 24 accumulators.
template <int Z>
void rows(int64_t m, const float* a, int64_t ars, const float* b, int64_t ldb, int64_t kn, float* c, int64_t ldc) {
  constexpr int MR = Z == 4 ? 6 : Z == 3 ? 8 : Z == 2 ? 12 : 16;
  int64_t r = 0;
  for (; r + MR <= m; r += MR) {
    const float* pf = r + 2 * MR <= m ? a + (r + MR) * ars : nullptr;
    micro<MR, Z>(a + r * ars, ars, b, ldb, kn, c + r * ldc, ldc, pf);
  }
  rows_tail<Z, MR - 1>(m - r, a + r * ars, ars, b, ldb, kn, c + r * ldc, ldc);
}

// C (m, 16 v) = A (m, kn) @ B (kn, 16 v): columns in chunks of 4 vectors (the last 1-3).
void gemm(int64_t m, int64_t v, const float* a, int64_t ars, const float* b, int64_t ldb, int64_t kn, float* c,
          int64_t ldc) {
  for (int64_t c0 = 0; c0 < v; c0 += 4) {
    const float* bc = b + 16 * c0;
    float* cc = c + 16 * c0;
    switch (std::min<int64_t>(4, v - c0)) {
      case 4: rows<4>(m, a, ars, bc, ldb, kn, cc, ldc); break;
      case 3: rows<3>(m, a, ars, bc, ldb, kn, cc, ldc); break;
      case 2: rows<2>(m, a, ars, bc, ldb, kn, cc, ldc); break;
      default: rows<1>(m, a, ars, bc, ldb, kn, cc, ldc); break;
    }
  }
}

// One work item: the rows of slots [s0, s0 + nc) of expert e (nc <= kCols). `pair` names each
// slot's routed pair: its gate, and its output row in yp (N * A, D).
void expert_block(const float* w13, const float* w2, const float* x, const int64_t* tok, const int64_t* pair,
                  const float* gate, float* yp, int64_t nc, int64_t d, int64_t f, float* buf) {
  const int64_t w = (nc + 15) / 16 * 16, v = w / 16;
  float* xb = buf;          // (D, w)
  float* h = xb + d * w;    // (2F, w)
  float* yt = h + 2 * f * w;  // (D, w)
  float* blk = yt + d * w;  // 16 x 16
  float gt[kCols];
  // xb[k][j] = x[tok[j]][k]: whole groups of 16 rows by 16 x 16 transposes, the rest one by one.
  int64_t j0 = 0;
  for (; j0 + 16 <= nc; j0 += 16)
    for (int64_t k = 0; k < d; k += 16)
      transpose16([&](int i) { return reinterpret_cast<const uint32_t*>(x + tok[j0 + i] * d + k); },
                  reinterpret_cast<uint32_t*>(xb + k * w + j0), w);
  for (int64_t k = 0; k < d; ++k) {
    float* row = xb + k * w;
    for (int64_t j = j0; j < nc; ++j) row[j] = x[tok[j] * d + k];
    std::fill(row + nc, row + w, 0.f);
  }
  for (int64_t j = 0; j < w; ++j) gt[j] = j < nc ? gate[pair[j]] : 0.f;
  gemm(2 * f, v, w13, d, xb, w, d, h, w);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t fi = 0; fi < f; ++fi) {  // g = silu(h_gate) * h_up * gate, over h's gate rows
    float* g = h + fi * w;
    const float* u = h + (f + fi) * w;
    for (int64_t j = 0; j < w; j += 16) {
      __m512 gv = _mm512_loadu_ps(g + j);
      __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_storeu_ps(g + j, _mm512_mul_ps(_mm512_mul_ps(s, _mm512_loadu_ps(u + j)), _mm512_loadu_ps(gt + j)));
    }
  }
  gemm(d, v, w2, f, h, w, f, yt, w);
  for (int64_t c0 = 0; c0 < nc; c0 += 16)
    for (int64_t k = 0; k < d; k += 16) {
      transpose16(reinterpret_cast<const uint32_t*>(yt + k * w + c0), w, reinterpret_cast<uint32_t*>(blk), 16);
      for (int64_t i = 0; i < std::min<int64_t>(16, nc - c0); ++i)
        _mm512_storeu_ps(yp + pair[c0 + i] * d + k, _mm512_loadu_ps(blk + 16 * i));
    }
}

constexpr int64_t kQueryRows = 32;  // query rows per attention work item

// One work item of attend_f32, for one (batch row, head): query rows [t0, t0 + nr) of q (rows qst
// apart) against its kv head's transposed keys kt (Dh, s16) and values v (rows kss apart), mask the
// batch row's (T, S) or null. Scores go to the scratch sc (nr, s16) and become probabilities there;
// output row t goes to o + t * ost.
void attend_block(const float* q, int64_t qst, const float* kt, const float* v, int64_t kss, const bool* mask,
                  bool causal, float* o, int64_t ost, int64_t nr, int64_t t0, int64_t tq, int64_t s, int64_t dh,
                  float* sc, int64_t s16) {
  // Keys any row of the block may see: causal rows up to their own position.
  const int64_t hi_key = causal ? std::min(s, t0 + nr + s - tq) : s, hv = (hi_key + 15) / 16;
  gemm(nr, hv, q + t0 * qst, qst, kt, s16, dh, sc, s16);  // scores (unscaled) of keys [0, 16 hv)
  const float scale = 1.f / std::sqrt(static_cast<float>(dh));
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < nr; ++r) {
    float* row = sc + r * s16;
    const int64_t t = t0 + r, end = causal ? std::min(s, t + s - tq + 1) : s;
    const bool* mr = mask ? mask + t * s : nullptr;
    // Scaled scores, -inf where the mask or causality hides the key (and past the last key).
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < 16 * hv; j += 16) {
      __mmask16 seen = end > j ? lanes(end - j) : __mmask16(0);
      if (mr && seen) {
        alignas(16) uint8_t bytes[16] = {0};
        std::memcpy(bytes, mr + j, static_cast<size_t>(std::min<int64_t>(16, end - j)));
        __m512i m32 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes)));
        seen &= _mm512_test_epi32_mask(m32, m32);
      }
      __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_loadu_ps(row + j), _mm512_set1_ps(scale));
      _mm512_storeu_ps(row + j, x);
      mxv = _mm512_max_ps(mxv, x);
    }
    const float mx = _mm512_reduce_max_ps(mxv);
    if (mx == -INFINITY) {  // a row that sees no key: zero probabilities, so a zero output below
      std::fill(row, row + 16 * hv, 0.f);
      continue;
    }
    mxv = _mm512_set1_ps(mx);
    __m512 sumv = _mm512_setzero_ps();
    for (int64_t j = 0; j < 16 * hv; j += 16) {  // p = exp(score - max); masked keys: exp(-inf) = 0
      __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), mxv));
      _mm512_storeu_ps(row + j, p);
      sumv = _mm512_add_ps(sumv, p);
    }
    const __m512 inv = _mm512_div_ps(one, _mm512_set1_ps(_mm512_reduce_add_ps(sumv)));
    for (int64_t j = 0; j < 16 * hv; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), inv));
  }
  // o (nr, Dh) = P (nr, keys) @ V (keys, Dh).
  gemm(nr, dh / 16, sc, s16, v, kss, hi_key, o + t0 * ost, ost);
}

#endif  // __AVX512F__

}  // namespace

#if defined(__AVX512F__)

bool infer_f32_available() { return true; }

// y (N, D) = sum over each token's A routed pairs of its expert's gated SwiGLU output, fp32.
// w13 (E, 2F, D), w2 (E, D, F), x (N, D), gates (N * A) per pair; tok and pair (E * cap): each
// expert's slots (the level of moe.plan_dispatch), the first n[e] naming a token row and its pair.
// Every pair must be in exactly one valid slot (each token's A outputs are summed from them).
torch::Tensor expert_ffn_infer(torch::Tensor w13, torch::Tensor w2, torch::Tensor x, torch::Tensor gates,
                               torch::Tensor tok, torch::Tensor pair, torch::Tensor n) {
  check(w13, "w13", torch::kFloat);
  check(w2, "w2", torch::kFloat);
  check(x, "x", torch::kFloat);
  check(gates, "gates", torch::kFloat);
  check(tok, "token index", torch::kLong);
  check(pair, "pair index", torch::kLong);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && x.dim() == 2, "expert_ffn_infer: w13, w2 must be 3-D, x 2-D");
  const int64_t e_n = w13.size(0), f2 = w13.size(1), f = f2 / 2, d = w13.size(2), rows = x.size(0);
  TORCH_CHECK(w2.size(0) == e_n && w2.size(1) == d && 2 * w2.size(2) == f2 && x.size(1) == d && d % 16 == 0 &&
                  f % 16 == 0,
              "expert_ffn_infer: shapes ", w13.sizes(), ", ", w2.sizes(), " and ", x.sizes());
  const int64_t n_pairs = gates.numel();
  TORCH_CHECK(rows > 0 && n_pairs % rows == 0, "expert_ffn_infer: ", n_pairs, " gates for ", rows, " tokens");
  TORCH_CHECK(tok.numel() == pair.numel() && tok.numel() % std::max<int64_t>(e_n, 1) == 0,
              "expert_ffn_infer: token index of ", tok.numel(), " and pair index of ", pair.numel(), " slots for ",
              e_n, " experts");
  const int64_t cap = e_n ? tok.numel() / e_n : 0;
  const int64_t* nv = expert_counts(n, e_n, cap, "expert_ffn_infer: valid count");
  const int64_t *T = tok.data_ptr<int64_t>(), *P = pair.data_ptr<int64_t>();
  std::vector<char> seen(n_pairs, 0);
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t c = 0; c < nv[e]; ++c) {
      int64_t t = T[e * cap + c], p = P[e * cap + c];
      TORCH_CHECK(t >= 0 && t < rows, "expert_ffn_infer: token index ", t, " outside [0, ", rows, ")");
      TORCH_CHECK(p >= 0 && p < n_pairs && !seen[p] && p / (n_pairs / rows) == t, "expert_ffn_infer: pair index ",
                  p, " repeated, outside [0, ", n_pairs, ") or not of token ", t);
      seen[p] = 1;
    }
  TORCH_CHECK(std::all_of(seen.begin(), seen.end(), [](char s) { return s != 0; }),
              "expert_ffn_infer: a routed pair is in no expert's valid slots");
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first slot), the most loaded experts first
  std::vector<int64_t> order(e_n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return nv[a] > nv[b]; });
  for (int64_t e : order)
    for (int64_t s = 0; s < nv[e]; s += kCols) items.emplace_back(e, s);
  auto yp = torch::empty({n_pairs, d}, x.options());
  const float *W13 = w13.data_ptr<float>(), *W2 = w2.data_ptr<float>(), *X = x.data_ptr<float>(),
              *G = gates.data_ptr<float>();
  float* YP = yp.data_ptr<float>();
  const int64_t words = (2 * d + f2) * kCols + 256;
  std::vector<std::unique_ptr<float[]>> scratch(at::get_num_threads());
  parallel_dynamic(static_cast<int64_t>(items.size()), [&](int64_t i) {
    auto& buf = scratch[at::get_thread_num()];
    if (!buf) buf.reset(new float[static_cast<size_t>(words)]);
    auto [e, s] = items[i];
    int64_t off = e * cap + s;
    expert_block(W13 + e * f2 * d, W2 + e * d * f, X, T + off, P + off, G, YP, std::min(kCols, nv[e] - s), d, f,
                 buf.get());
  });
  // Each token's pairs, summed in pair order (0 + pair 0 + pair 1 ...).
  const int64_t a = n_pairs / rows;
  auto y = torch::empty({rows, d}, x.options());
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t)
      for (int64_t k = 0; k < d; k += 16) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t j = 0; j < a; ++j) s = _mm512_add_ps(s, _mm512_loadu_ps(YP + (t * a + j) * d + k));
        _mm512_storeu_ps(Y + t * d + k, s);
      }
  });
  return y;
}

// o (B, T, H, Dh) = softmax(q k^T / sqrt(Dh) + mask) v in fp32 for inference: q (B, H, T, Dh), k and v
// (B, K, >= S, Dh) with a contiguous head dim (KV-cache views; the first S positions are used),
// GQA (H a multiple of K); mask (B, T, S) bool or empty; causal: query t sees keys <= t + S - T.
// Each kv head's keys are transposed once to (Dh, S) so that scores, 16 keys per vector, need no
// horizontal sums; work items are (batch row, head, 32 query rows); whole key rows, exact softmax.
torch::Tensor attend_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, bool causal) {
  check(q, "q", torch::kFloat);
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k.scalar_type() == torch::kFloat &&
                  v.scalar_type() == torch::kFloat,
              "attend_f32: k and v must be fp32 CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
                  k.stride(3) == 1,
              "attend_f32: q (B, H, T, Dh), k and v (B, K, S, Dh) of one layout with a contiguous head dim");
  const int64_t b = q.size(0), h = q.size(1), tq = q.size(2), dh = q.size(3), kh = k.size(1), s = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(3) == dh && kh > 0 && h % kh == 0 && s >= tq && dh % 16 == 0,
              "attend_f32: q ", q.sizes(), " and k ", k.sizes(), " do not match");
  const bool* mp = nullptr;
  if (mask.numel() > 0) {
    check(mask, "mask", torch::kBool);
    TORCH_CHECK(mask.numel() == b * tq * s, "attend_f32: mask has ", mask.numel(), " entries, expected B*T*S = ",
                b * tq * s);
    mp = mask.data_ptr<bool>();
  }
  const int64_t s16 = (s + 15) / 16 * 16, group = h / kh;
  auto kt = torch::empty({b, kh, dh, s16}, q.options());
  float* KT = kt.data_ptr<float>();
  const float *K = k.data_ptr<float>(), *V = v.data_ptr<float>(), *Q = q.data_ptr<float>();
  at::parallel_for(0, b * kh, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* kb = K + (p / kh) * k.stride(0) + (p % kh) * k.stride(1);
      float* out = KT + p * dh * s16;
      int64_t j0 = 0;
      for (; j0 + 16 <= s; j0 += 16)
        for (int64_t d = 0; d < dh; d += 16)
          transpose16([&](int i) { return reinterpret_cast<const uint32_t*>(kb + (j0 + i) * k.stride(2) + d); },
                      reinterpret_cast<uint32_t*>(out + d * s16 + j0), s16);
      for (int64_t d = 0; d < dh; ++d) {
        for (int64_t j = j0; j < s; ++j) out[d * s16 + j] = kb[j * k.stride(2) + d];
        std::fill(out + d * s16 + s, out + (d + 1) * s16, 0.f);
      }
    }
  });
  auto o = torch::empty({b, tq, h, dh}, q.options());
  float* O = o.data_ptr<float>();
  const int64_t blocks = (tq + kQueryRows - 1) / kQueryRows, items = b * h * blocks;
  std::vector<std::unique_ptr<float[]>> scratch(at::get_num_threads());
  parallel_dynamic(items, [&](int64_t i) {
    auto& buf = scratch[at::get_thread_num()];
    if (!buf) buf.reset(new float[static_cast<size_t>(kQueryRows * s16)]);
    const int64_t bi = i / (h * blocks), hi = (i / blocks) % h, t0 = (i % blocks) * kQueryRows;
    const int64_t ki = hi / group;
    attend_block(Q + bi * q.stride(0) + hi * q.stride(1), q.stride(2), KT + (bi * kh + ki) * dh * s16,
                 V + bi * v.stride(0) + ki * v.stride(1), v.stride(2), mp ? mp + bi * tq * s : nullptr, causal,
                 O + bi * tq * h * dh + hi * dh, h * dh, std::min(kQueryRows, tq - t0), t0, tq, s, dh, buf.get(), s16);
  });
  return o;
}

#else

bool infer_f32_available() { return false; }
torch::Tensor attend_f32(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, bool) {
  TORCH_CHECK(false, "attend_f32: this build has no AVX-512");
  return {};
}
torch::Tensor expert_ffn_infer(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                               torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "expert_ffn_infer: this build has no AVX-512");
  return {};
}

#endif
