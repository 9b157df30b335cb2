// Batched expert GEMMs that skip padding: the six products of the gated SwiGLU experts
// (ernie5/model/moe.py, _GroupedSwiGLU) over a padded level, each expert e computing only its
// n[e] valid token slots of the level's cap. The tensors keep the layouts of the torch.bmm calls
// they replace (pad slots hold zeros, as bmm on zero pad rows would give), so each product can be
// swapped in on its own; the pad work (a third of the expert GEMMs of a nano step: caps of 96-112
// slots for a mean load of 64) is not done.
//
// One AVX512-BF16 micro-kernel does every product: C[m, 16 lanes] += A(m, k) . B[k, lanes] over
// pairs k, with A(m, k) a dword (two bf16 along the reduction) broadcast from any strided layout
// and B packed as [k][lanes] dwords. Each product packs what it needs per expert into a per-thread
// buffer (the token operand; for the two input-gradient products also the expert's weight, a pair
// interleave of 128-256 KB that stays in L2), accumulates in fp32 and rounds once to bf16 (round
// to nearest even), as oneDNN's bf16 bmm does (on the Zen 5 this was written on, the outputs equal
// bmm's bit for bit). Experts are handed out one at a time from a shared counter, so uneven loads
// do not leave a thread idle. The two weight-gradient products write with streaming stores (the
// optimizer reads them much later) and also return the sum of squares of what they stored, summed
// in a fixed order, so the gradient norm need not read them again (train/precision.py).
//
// Isolated, 64 experts x d_model 256 x d_ff 256, cap 112, gamma-distributed loads of mean 64, the
// six products take 6.8-7.9 ms against 9.9-11.2 ms for the six bmm calls (2 Zen 5 cores).
//
// Layouts (E experts, C = cap, D = d_model, F = d_ff, n = valid slots of the expert):
//   up       h  (E, 2F, C) = w13 (E, 2F, D) @ x^T     x  (E, C, D)
//   down     y  (E, C, D)  = (w2 (E, D, F)  @ g)^T    g  (E, F, C)
//   down_dx  dg (E, F, C)  = w2^T @ dy^T              dy (E, C, D)
//   down_dw  dw2 (E, D, F) = dy^T @ g^T               (sum over the n valid slots)
//   up_dx    dx (E, C, D)  = dh^T @ w13               dh (E, 2F, C)
//   up_dw    dw13 (E, 2F, D) = dh @ x                 (sum over the n valid slots)
//
// The MoE layer runs them as two whole-expert passes (expert_ffn_fwd: up, the gated activation,
// down; expert_ffn_bwd: down_dx, the activation's backward, down_dw, up_dw, up_dx), each expert
// end to end on one thread while its operands are in L2, its token rows read in place from the
// (N, D) activations through the level's slot -> token index. The single products remain as the
// building blocks, the parity references and `ernie5 bench moe`'s GEMM-only timing.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ERNIE5_EXPERT_GEMM 1
#endif

namespace {

using namespace ernie5_kernels;

#ifdef ERNIE5_EXPERT_GEMM

inline int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

inline uint32_t pair(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16); }

// C[r, 16 j + l] = sum_k A(r, k) . B[k][16 j + l] for r < R, j < Z; A(r, k) at a + r * ars + k * aks.
// The last vector stores only the lanes in `tail` (a row may end inside it). With `cf`, the sums go
// unrounded to the fp32 rows at cf (stride ldc) instead, whole vectors (lanes past the tail: zeros,
// as B is zero-padded). With `pf` (the next tile's A rows, ars apart, when A is a weight read in
// memory order), one of their cache lines is fetched into L1 per step of k, until all R rows are:
// spread out, the fetches never fill the core's miss buffers. (Issued all at once before the tile,
// 48 lines for the up product, the prefetch instructions stalled on them: 8 % of the product's
// time on a Zen 4. Spreading them made up and down 11-15 % faster there.)
// With H (a tail of at most 8 lanes), the last vector is a 256-bit one: the same sums in its lanes
// (bit for bit), at half the cost where 512-bit instructions run as two halves (Zen 4), so that an
// expert of 65-72 tokens pays for 4.5 vectors of columns rather than 5 (cf: only its 8 lanes are
// written).
template <int R, int Z, bool H = false>
inline void micro(const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b, int64_t ldb, int64_t k2,
                  uint16_t* c, int64_t ldc, __mmask16 tail, bool stream, double* sumsq, float* cf,
                  const uint32_t* pf = nullptr) {
  constexpr int ZF = H ? Z - 1 : Z;  // whole 512-bit vectors
  const int64_t pf_n = pf ? R * ((k2 + 15) / 16) : 0;
  // Every loop over r and j is unrolled whole (R <= 16, Z <= 4), so acc stays in registers: with
  // `unroll 8`, the 12- and 16-row tiles of 2- and 1-vector chunks kept acc in memory, and an
  // expert of 17-32 tokens took 1.7x as long in the forward as one of 48. The stores at the end
  // too: left rolled, they made GCC keep a stack copy of acc (zeroed before the k loop, written
  // after it), which cost the weight-gradient products, whose k loop is short (ne / 2 pairs),
  // 12 % on a Zen 4.
  __m512 acc[R][Z];
  __m256 acch[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < ZF; ++j) acc[r][j] = _mm512_setzero_ps();
    if constexpr (H) acch[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k2; ++k) {
    if (k < pf_n) _mm_prefetch(reinterpret_cast<const char*>(pf + (k % R) * ars + (k / R) * 16), _MM_HINT_T0);
    __m512bh bv[Z];
#pragma GCC unroll 4
    for (int j = 0; j < ZF; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + k * ldb + 16 * j);
    __m256bh bh;
    if constexpr (H) bh = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * ldb + 16 * ZF));
    const uint32_t* ak = a + k * aks;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(ak[r * ars]));
#pragma GCC unroll 4
      for (int j = 0; j < ZF; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
      if constexpr (H) acch[r] = _mm256_dpbf16_ps(acch[r], (__m256bh)_mm512_castsi512_si256((__m512i)av), bh);
    }
  }
  if (cf) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < ZF; ++j) _mm512_storeu_ps(cf + r * ldc + 16 * j, acc[r][j]);
      if constexpr (H) _mm256_storeu_ps(cf + r * ldc + 16 * ZF, acch[r]);
    }
    return;
  }
  // With sumsq, also the squares of the rounded outputs (lanes past the tail are zero: B is
  // zero-padded), in fp32 for the tile.
  __m512 sq = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < ZF; ++j) {
      __m256i o = (__m256i)_mm512_cvtneps_pbh(acc[r][j]);
      __mmask16 m = !H && j == Z - 1 ? tail : static_cast<__mmask16>(0xFFFF);
      if (stream && m == 0xFFFF)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(c + r * ldc + 16 * j), o);
      else
        _mm256_mask_storeu_epi16(c + r * ldc + 16 * j, m, o);
      if (sumsq) {
        __m512 back = widen16(o);
        sq = _mm512_fmadd_ps(back, back, sq);
      }
    }
    if constexpr (H) {
      __m128i o = (__m128i)_mm256_cvtneps_pbh(acch[r]);
      _mm_mask_storeu_epi16(c + r * ldc + 16 * ZF, static_cast<__mmask8>(tail), o);
      if (sumsq) {  // the upper 8 lanes add zeros, as the 512-bit tail's would
        __m256 back = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(o), 16));
        sq = _mm512_fmadd_ps(_mm512_zextps256_ps512(back), _mm512_zextps256_ps512(back), sq);
      }
    }
  }
  if (sumsq) *sumsq += static_cast<double>(_mm512_reduce_add_ps(sq));
}

// Rows of a z-vector column chunk in tiles of MRZ rows (24 fp32 accumulators for z = 2, 3, 4),
// the last partial tile by a smaller instantiation.
template <int Z, bool H, int R>
inline void tail_rows(int64_t rem, const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b, int64_t ldb,
                      int64_t k2, uint16_t* c, int64_t ldc, __mmask16 tail, bool stream, double* sumsq, float* cf) {
  if constexpr (R > 0) {
    if (rem == R) micro<R, Z, H>(a, ars, aks, b, ldb, k2, c, ldc, tail, stream, sumsq, cf);
    else tail_rows<Z, H, R - 1>(rem, a, ars, aks, b, ldb, k2, c, ldc, tail, stream, sumsq, cf);
  }
}

template <int Z, bool H>
void chunk_rows(int64_t m, const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b, int64_t ldb, int64_t k2,
                uint16_t* c, int64_t ldc, __mmask16 tail, bool stream, double* sumsq, float* cf) {
  auto cr = [&](int64_t r) { return cf ? cf + r * ldc : nullptr; };
  constexpr int MRZ = Z == 4 ? 6 : Z == 3 ? 8 : Z == 2 ? 12 : 16;
  int64_t r = 0;
  for (; r + MRZ <= m; r += MRZ) {
    // A rows in memory order (a weight): fetch the next tile's rows as this one runs
    const uint32_t* pf = aks == 1 && r + 2 * MRZ <= m ? a + (r + MRZ) * ars : nullptr;
    micro<MRZ, Z, H>(a + r * ars, ars, aks, b, ldb, k2, c + r * ldc, ldc, tail, stream, sumsq, cr(r), pf);
  }
  tail_rows<Z, H, MRZ - 1>(m - r, a + r * ars, ars, aks, b, ldb, k2, c + r * ldc, ldc, tail, stream, sumsq, cr(r));
}

// C (m x n, row stride ldc, bf16) = A (m x 2 k2) . B (2 k2 x n16 packed as [k2][ldb] dwords), n <= n16.
// Columns go in chunks of 4, 3 or 2 vectors (a lone vector only when n <= 16), so that no chunk is
// a single vector, whose 16 rows of broadcasts would outnumber its FMAs. With `stream` (an output
// read only much later: the weight gradients, which the optimizer reads) whole 32-byte-aligned
// vectors are written with streaming stores, which skip reading the lines in first; the caller
// fences (_mm_sfence) before the output is used. `sumsq`, if given, accumulates the squares of the
// rounded outputs in a fixed order (fp32 per micro tile, fp64 across tiles). With `cf` the product
// goes unrounded to fp32 rows of ldc floats there (n rounded up to whole vectors), c unused.
void gemm(int64_t m, int64_t n, int64_t k2, const uint32_t* a, int64_t ars, int64_t aks, const uint32_t* b,
          int64_t ldb, uint16_t* c, int64_t ldc, bool stream = false, double* sumsq = nullptr, float* cf = nullptr) {
  stream = stream && (reinterpret_cast<uintptr_t>(c) & 31) == 0 && ldc % 16 == 0;
  if (n <= 0 || m <= 0) return;
  if (cf && k2 == 0) {
    for (int64_t r = 0; r < m; ++r) std::fill(cf + r * ldc, cf + r * ldc + up16(n), 0.f);
    return;
  }
  if (k2 == 0) {
    for (int64_t r = 0; r < m; ++r) std::fill(c + r * ldc, c + r * ldc + n, uint16_t{0});
    return;
  }
  int64_t v = (n + 15) / 16, n0 = 0;
  while (v > 0) {
    // 4s, except a remainder of 5 (3 + 2), 6 (3 + 3) or 9 (3 + 3 + 3 ... via 3 first)
    int z = v <= 4 ? static_cast<int>(v) : (v == 5 || v == 6 || v % 4 == 1) ? 3 : 4;
    int64_t w = std::min<int64_t>(16 * z, n - n0);
    int64_t last = w - 16 * (z - 1);
    __mmask16 tail = lanes(last);
    float* cfn = cf ? cf + n0 : nullptr;
    auto run = [&](auto zc, auto hc) {
      chunk_rows<decltype(zc)::value, decltype(hc)::value>(m, a, ars, aks, b + n0, ldb, k2, c + n0, ldc, tail, stream,
                                                           sumsq, cfn);
    };
    auto with_tail = [&](auto zc) {  // a last vector of at most 8 lanes: the 256-bit tail
      if (last <= 8) run(zc, std::true_type{});
      else run(zc, std::false_type{});
    };
    if (z == 4) with_tail(std::integral_constant<int, 4>{});
    else if (z == 3) with_tail(std::integral_constant<int, 3>{});
    else if (z == 2) with_tail(std::integral_constant<int, 2>{});
    else with_tail(std::integral_constant<int, 1>{});
    n0 += 16 * z;
    v -= z;
  }
}

// The rows of a bf16 operand: row r at base + r * ld, or, with idx, at base + idx[r] * ld (the
// token rows of a level's slots read in place through its slot -> token index, rather than
// gathered into an (E, C, D) copy first).
struct Rows {
  const uint16_t* base;
  int64_t ld;
  const int64_t* idx = nullptr;
  const uint16_t* operator()(int64_t r) const { return base + (idx ? idx[r] : r) * ld; }
};

// out[k][r] = (src_r[2k], src_r[2k+1]) for r < rows (zero for rows <= r < width); elements at or
// past kv along a row are zero.
void pack_t(const Rows& src, int64_t rows, int64_t kv, uint32_t* out, int64_t width) {
  int64_t k2 = (kv + 1) / 2, kf = kv / 2;  // kf whole pairs
  int64_t r0 = 0;
  auto row32 = [&](int64_t r) { return reinterpret_cast<const uint32_t*>(src(r)); };
  if (src.ld % 2 == 0 && (reinterpret_cast<uintptr_t>(src.base) & 3) == 0) {  // rows are dword arrays
    for (; r0 + 16 <= rows; r0 += 16) {
      const uint32_t* rp[16];
      for (int i = 0; i < 16; ++i) rp[i] = row32(r0 + i);
      int64_t k = 0;
      for (; k + 16 <= kf; k += 16) transpose16([&](int i) { return rp[i] + k; }, out + k * width + r0, width);
      for (; k < kf; ++k)
        for (int i = 0; i < 16; ++i) out[k * width + r0 + i] = rp[i][k];
      if (kv & 1)
        for (int64_t r = r0; r < r0 + 16; ++r) out[kf * width + r] = pair(src(r)[kv - 1], 0);
    }
  }
  for (int64_t r = r0; r < rows; ++r) {
    const uint16_t* s = src(r);
    for (int64_t k = 0; k < kf; ++k) out[k * width + r] = pair(s[2 * k], s[2 * k + 1]);
    if (kv & 1) out[kf * width + r] = pair(s[kv - 1], 0);
  }
  for (int64_t k = 0; k < k2; ++k) std::fill(out + k * width + rows, out + k * width + width, 0u);
}

// out[k][j] = (src_2k[j], src_2k+1[j]) for j < cols (zero for cols <= j < width); rows at or
// past kv are zero. The rows kPackAhead pairs ahead are fetched as it goes: packing an expert's
// weight for the input-gradient products read memory that the hardware prefetcher left cold (the
// weights of a layer are read once per pass), and stalled on it.
// Alternating with the other product so that weights are cold, as in training: up_dx 409-424 ->
// 518-540 GFLOP/s, down_dx 321-369 -> 379-392 (gamma loads of mean 64, cap 112; Zen 5). They go
// to L2 (T1), not L1: 16 lines per pair of rows, fetched into L1, filled its miss buffers and
// stalled the packing on a Zen 4 (up_dx 6 %, down_dx 2-5 % faster with T1 there).
constexpr int64_t kPackAhead = 8;
void pack_i(const Rows& src, int64_t kv, int64_t cols, uint32_t* out, int64_t width) {
  int64_t k2 = (kv + 1) / 2;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < k2; ++k) {
    const uint16_t* s0 = src(2 * k);
    const bool has1 = 2 * k + 1 < kv;
    const uint16_t* s1 = has1 ? src(2 * k + 1) : s0;
    uint32_t* o = out + k * width;
    if (2 * (k + kPackAhead) + 1 < kv) {  // the row pair kPackAhead pairs ahead (see above)
      const uint16_t *p0 = src(2 * (k + kPackAhead)), *p1 = src(2 * (k + kPackAhead) + 1);
      for (int64_t j = 0; j < cols; j += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(p0 + j), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(p1 + j), _MM_HINT_T1);
      }
    }
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {  // 16 pairs: widen both rows to 32 bits, the odd one shifted up
      __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0 + j)));
      __m256i h = has1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + j)) : zero;
      __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
      _mm512_storeu_si512(o + j, _mm512_or_si512(lo, hi));
    }
    for (; j < cols; ++j) o[j] = pair(s0[j], has1 ? s1[j] : uint16_t{0});
    std::fill(o + cols, o + width, 0u);
  }
}

// Row stride (dwords) of a packed panel of n columns: whole vectors and an odd number of 64-byte
// lines, so that a panel's rows, walked along k, spread over all L1 sets rather than a few (the
// weight-gradient products, whose panels are 512 or 1024 dwords wide: up_dw +4-5 %, down_dw +1-3 %).
inline int64_t lead(int64_t n) { return up16(n) / 16 % 2 ? up16(n) : up16(n) + 16; }

// Runs fn(e, scratch) for every expert, experts handed out one at a time, the most loaded first
// (nv: valid slots per expert), so that the last ones, which decide when the threads all finish,
// are the shortest; scratch holds `words` dwords per thread. Each expert's outputs depend on its
// own operands only, so the order changes no result.
template <typename Fn>
void for_experts(int64_t n_exp, const int64_t* nv, int64_t words, const Fn& fn) {
  std::vector<int64_t> order(n_exp);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return nv[a] > nv[b]; });
  // Not zeroed: every packer writes all that the products then read (pads included).
  std::vector<std::unique_ptr<uint32_t[]>> scratch(at::get_num_threads());
  parallel_dynamic(n_exp, [&](int64_t i) {
    auto& buf = scratch[at::get_thread_num()];
    if (!buf) buf.reset(new uint32_t[static_cast<size_t>(words) + 16]);
    fn(order[i], buf.get());
  });
}

void zero_cols(uint16_t* c, int64_t rows, int64_t ldc, int64_t from) {
  if (from >= ldc) return;
  for (int64_t r = 0; r < rows; ++r) std::fill(c + r * ldc + from, c + (r + 1) * ldc, uint16_t{0});
}

const int64_t* valid_counts(const torch::Tensor& n, int64_t n_exp, int64_t cap) {
  return expert_counts(n, n_exp, cap, "expert gemm: valid count");
}

void check3(const torch::Tensor& t, const char* name) {
  check(t, name, torch::kBFloat16);
  TORCH_CHECK(t.dim() == 3, name, " must be 3-D");
}

// One expert's share of each product: the operands of expert e at the given pointers (its slice of
// the level tensors), ne valid slots of cap, scratch `buf` of the *_words(...) dwords named with it.

// he (2F, cap) = w13_e (2F, D) @ x_e (cap, D)^T, pad columns zero: the weight rows broadcast as
// they lie, the token rows packed ([d/2][slots]: (x[c, 2k], x[c, 2k+1])).
inline int64_t up_words(int64_t d, int64_t cap) { return d / 2 * up16(cap); }
void up_one(const uint16_t* we, const Rows& xe, uint16_t* he, int64_t ne, int64_t f2, int64_t d, int64_t cap,
            uint32_t* bp) {
  pack_t(xe, ne, d, bp, up16(ne));
  gemm(f2, ne, d / 2, reinterpret_cast<const uint32_t*>(we), d / 2, 1, bp, up16(ne), he, cap);
  zero_cols(he, f2, cap, ne);
}

// ye (cap, D) = (w2_e (D, F) @ g_e (F, cap))^T, pad rows zero: token rows, so that the combine
// reads each routed pair's output as one contiguous row. The product is computed as the other
// forward one (weight rows broadcast, tokens along the vector lanes) into an fp32 scratch, which is
// transposed in 16 x 16 blocks while it is in L2 and rounded once on the way out. (Written as
// (D, cap), the combine read each pair's column across 256 cache lines shared with 31 other slots:
// 2.4x slower than the input-gradient combine, which reads rows.)
inline int64_t down_words(int64_t d, int64_t f, int64_t cap) { return (f / 2 + d) * up16(cap) + 256; }
void down_one(const uint16_t* we, const uint16_t* ge, uint16_t* ye, int64_t ne, int64_t d, int64_t f, int64_t cap,
              uint32_t* buf) {
  int64_t k2 = f / 2, w16 = up16(cap), ld = up16(ne);
  uint32_t* bp = buf;                                    // [f/2][slots]: (g[2k, c], g[2k+1, c])
  float* yt = reinterpret_cast<float*>(buf + k2 * w16);  // [d][slots] fp32
  uint32_t* blk = buf + k2 * w16 + d * w16;              // one transposed 16 x 16 block
  if (ne > 0) {
    pack_i({ge, cap}, f, ne, bp, ld);
    gemm(d, ne, k2, reinterpret_cast<const uint32_t*>(we), k2, 1, bp, ld, nullptr, ld, false, nullptr, yt);
    for (int64_t c0 = 0; c0 < ne; c0 += 16)
      for (int64_t d0 = 0; d0 < d; d0 += 16) {
        transpose16(reinterpret_cast<const uint32_t*>(yt) + d0 * ld + c0, ld, blk, 16);  // blk[c][d]
        for (int64_t i = 0; i < std::min<int64_t>(16, ne - c0); ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ye + (c0 + i) * d + d0),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(_mm512_loadu_si512(blk + 16 * i))));
      }
  }
  std::fill(ye + ne * d, ye + cap * d, uint16_t{0});
}

// dge (F, cap) = w2_e (D, F)^T @ dy_e (cap, D)^T, pad columns zero.
inline int64_t down_dx_words(int64_t d, int64_t f, int64_t cap) { return d / 2 * (up16(cap) + f); }
void down_dx_one(const uint16_t* we, const Rows& dye, uint16_t* dge, int64_t ne, int64_t d, int64_t f,
                 int64_t cap, uint32_t* buf) {
  int64_t k2 = d / 2;
  uint32_t* ap = buf;           // [k2][f]: (w2[2k, f], w2[2k+1, f])
  uint32_t* bp = buf + k2 * f;  // [k2][n16]: (dy[c, 2k], dy[c, 2k+1])
  if (ne > 0) {
    pack_i({we, f}, d, f, ap, f);
    pack_t(dye, ne, d, bp, up16(ne));
    gemm(f, ne, k2, ap, 1, f, bp, up16(ne), dge, cap);
  }
  zero_cols(dge, f, cap, ne);
}

// dxe (cap, D) = dh_e (2F, cap)^T @ w13_e (2F, D), pad rows zero.
inline int64_t up_dx_words(int64_t f2, int64_t d, int64_t cap) { return f2 / 2 * (cap + d); }
void up_dx_one(const uint16_t* dhe, const uint16_t* we, uint16_t* dxe, int64_t ne, int64_t f2, int64_t d,
               int64_t cap, uint32_t* buf) {
  int64_t k2 = f2 / 2;
  uint32_t* ap = buf;             // [k2][ne]: (dh[2k, c], dh[2k+1, c])
  uint32_t* bp = buf + k2 * cap;  // [k2][d]: (w13[2k, d], w13[2k+1, d])
  if (ne > 0) {
    pack_i({dhe, cap}, f2, ne, ap, ne);
    pack_i({we, d}, f2, d, bp, d);
    gemm(ne, d, k2, ap, 1, ne, bp, d, dxe, d);
  }
  std::fill(dxe + ne * d, dxe + cap * d, uint16_t{0});
}

// oe (M, N) = sum over the ne valid slots c of a[c, m] b[c, n]: the weight gradients, both operands
// packed ([slot pairs][M] and [slot pairs][N] dwords, rows `stride` dwords apart, by pack_a(ap,
// stride) and pack_b(bp, stride)), written with streaming stores; *sq accumulates the sum of squares
// of oe as stored.
inline int64_t slots_words(int64_t m, int64_t n_out, int64_t cap) { return (cap + 1) / 2 * (lead(m) + lead(n_out)); }
template <typename PackA, typename PackB>
void slots_one(int64_t m, int64_t n_out, int64_t ne, const PackA& pack_a, const PackB& pack_b, uint16_t* oe,
               double* sq, uint32_t* buf) {
  int64_t k2 = (ne + 1) / 2, la = lead(m), lb = lead(n_out);
  uint32_t* ap = buf;
  uint32_t* bp = buf + k2 * la;
  pack_a(ap, la);
  pack_b(bp, lb);
  gemm(m, n_out, k2, ap, 1, la, bp, lb, oe, n_out, true, sq);
  _mm_sfence();
}

// dw2_e (D, F) = dy_e (cap, D)^T @ g_e (F, cap)^T over the valid slots.
void down_dw_one(const Rows& dye, const uint16_t* ge, uint16_t* oe, int64_t ne, int64_t d, int64_t f, int64_t cap,
                 double* sq, uint32_t* buf) {
  slots_one(
      d, f, ne, [&](uint32_t* ap, int64_t w) { pack_i(dye, ne, d, ap, w); },  // (dy[2k, d], dy[2k+1, d])
      [&](uint32_t* bp, int64_t w) { pack_t({ge, cap}, f, ne, bp, w); },     // (g[f, 2k], g[f, 2k+1])
      oe, sq, buf);
}

// dw13_e (2F, D) = dh_e (2F, cap) @ x_e (cap, D) over the valid slots.
void up_dw_one(const uint16_t* dhe, const Rows& xe, uint16_t* oe, int64_t ne, int64_t f2, int64_t d, int64_t cap,
               double* sq, uint32_t* buf) {
  slots_one(
      f2, d, ne, [&](uint32_t* ap, int64_t w) { pack_t({dhe, cap}, f2, ne, ap, w); },  // (dh[f, 2k], dh[f, 2k+1])
      [&](uint32_t* bp, int64_t w) { pack_i(xe, ne, d, bp, w); },                     // (x[2k, d], x[2k+1, d])
      oe, sq, buf);
}

// Sum of per-expert sums of squares in expert order, so the result does not depend on which thread
// took which expert.
double ordered(const std::vector<double>& sq) { return std::accumulate(sq.begin(), sq.end(), 0.0); }

// Checks shared by the two whole-expert passes: w13 (E, 2F, D), w2 (E, D, F), token rows (E, C, D)
// and gate (E, C), bf16.
// Checks shared by the two whole-expert passes: w13 (E, 2F, D), w2 (E, D, F), token rows x (N, D),
// gate (E, C), all bf16, and tok (E * C) int64, whose first n[e] slots of each expert must name rows
// of x (the rest, pad slots, are not read). Returns the valid counts.
const int64_t* check_ffn(const char* what, const torch::Tensor& w13, const torch::Tensor& w2, const torch::Tensor& x,
                         const torch::Tensor& tok, const torch::Tensor& gate, const torch::Tensor& n) {
  check3(w13, "w13");
  check3(w2, "w2");
  check(x, "x", torch::kBFloat16);
  check(gate, "gate", torch::kBFloat16);
  check(tok, "token index", torch::kLong);
  int64_t e_n = w13.size(0), f2 = w13.size(1), d = w13.size(2);
  TORCH_CHECK(w2.size(0) == e_n && w2.size(1) == d && 2 * w2.size(2) == f2 && x.dim() == 2 && x.size(1) == d &&
                  d % 16 == 0 && f2 % 32 == 0,
              what, ": shapes ", w13.sizes(), ", ", w2.sizes(), " and ", x.sizes());
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == e_n && tok.numel() == gate.numel(), what, ": gate ", gate.sizes(),
              " and token index of ", tok.numel(), " slots for ", e_n, " experts");
  int64_t cap = gate.size(1), rows = x.size(0);
  const int64_t* nv = valid_counts(n, e_n, cap);
  const int64_t* t = tok.data_ptr<int64_t>();
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t c = 0; c < nv[e]; ++c)
      TORCH_CHECK(t[e * cap + c] >= 0 && t[e * cap + c] < rows, what, ": token index ", t[e * cap + c],
                  " outside [0, ", rows, ")");
  return nv;
}

#endif  // ERNIE5_EXPERT_GEMM

}  // namespace

#ifdef ERNIE5_EXPERT_GEMM

bool expert_gemm_available() { return true; }

// h (E, 2F, C) = w13 (E, 2F, D) @ x (E, C, D)^T over the valid slots, pad columns zero.
torch::Tensor expert_up(torch::Tensor w13, torch::Tensor x, torch::Tensor n) {
  check3(w13, "w13");
  check3(x, "x");
  int64_t e_n = w13.size(0), f2 = w13.size(1), d = w13.size(2), cap = x.size(1);
  TORCH_CHECK(x.size(0) == e_n && x.size(2) == d && d % 2 == 0, "expert_up: shapes ", w13.sizes(), " and ", x.sizes());
  const int64_t* nv = valid_counts(n, e_n, cap);
  auto h = torch::empty({e_n, f2, cap}, w13.options());
  const uint16_t* W = ptr<uint16_t>(w13);
  const uint16_t* X = ptr<uint16_t>(x);
  uint16_t* H = ptr<uint16_t>(h);
  for_experts(e_n, nv, up_words(d, cap), [&](int64_t e, uint32_t* buf) {
    up_one(W + e * f2 * d, {X + e * cap * d, d}, H + e * f2 * cap, nv[e], f2, d, cap, buf);
  });
  return h;
}

// y (E, C, D) = (w2 (E, D, F) @ g (E, F, C))^T over the valid slots, pad rows zero.
torch::Tensor expert_down(torch::Tensor w2, torch::Tensor g, torch::Tensor n) {
  check3(w2, "w2");
  check3(g, "g");
  int64_t e_n = w2.size(0), d = w2.size(1), f = w2.size(2), cap = g.size(2);
  TORCH_CHECK(g.size(0) == e_n && g.size(1) == f && f % 2 == 0 && d % 16 == 0, "expert_down: shapes ", w2.sizes(),
              " and ", g.sizes());
  const int64_t* nv = valid_counts(n, e_n, cap);
  auto y = torch::empty({e_n, cap, d}, w2.options());
  const uint16_t* W = ptr<uint16_t>(w2);
  const uint16_t* G = ptr<uint16_t>(g);
  uint16_t* Y = ptr<uint16_t>(y);
  for_experts(e_n, nv, down_words(d, f, cap), [&](int64_t e, uint32_t* buf) {
    down_one(W + e * d * f, G + e * f * cap, Y + e * cap * d, nv[e], d, f, cap, buf);
  });
  return y;
}

// dg (E, F, C) = w2 (E, D, F)^T @ dy (E, C, D)^T over the valid slots.
torch::Tensor expert_down_dx(torch::Tensor w2, torch::Tensor dy, torch::Tensor n) {
  check3(w2, "w2");
  check3(dy, "dy");
  int64_t e_n = w2.size(0), d = w2.size(1), f = w2.size(2), cap = dy.size(1);
  TORCH_CHECK(dy.size(0) == e_n && dy.size(2) == d && d % 2 == 0, "expert_down_dx: shapes ", w2.sizes(), " and ",
              dy.sizes());
  auto nv = valid_counts(n, e_n, cap);
  auto dg = torch::empty({e_n, f, cap}, w2.options());
  const uint16_t* W = ptr<uint16_t>(w2);
  const uint16_t* DY = ptr<uint16_t>(dy);
  uint16_t* DG = ptr<uint16_t>(dg);
  for_experts(e_n, nv, down_dx_words(d, f, cap), [&](int64_t e, uint32_t* buf) {
    down_dx_one(W + e * d * f, {DY + e * cap * d, d}, DG + e * f * cap, nv[e], d, f, cap, buf);
  });
  return dg;
}

// dw2 (E, D, F) = dy (E, C, D)^T @ g (E, F, C)^T, summed over the valid slots; also the sum of
// squares of dw2 (as stored), for the gradient norm.
std::tuple<torch::Tensor, double> expert_down_dw(torch::Tensor dy, torch::Tensor g, torch::Tensor n) {
  check3(dy, "dy");
  check3(g, "g");
  int64_t e_n = dy.size(0), cap = dy.size(1), d = dy.size(2), f = g.size(1);
  TORCH_CHECK(g.size(0) == e_n && g.size(2) == cap && f % 16 == 0, "expert_down_dw: shapes ", dy.sizes(), " and ",
              g.sizes());
  const int64_t* nv = valid_counts(n, e_n, cap);
  auto dw = torch::empty({e_n, d, f}, dy.options());
  const uint16_t* DY = ptr<uint16_t>(dy);
  const uint16_t* G = ptr<uint16_t>(g);
  uint16_t* O = ptr<uint16_t>(dw);
  std::vector<double> sq(e_n, 0.0);
  for_experts(e_n, nv, slots_words(d, f, cap), [&](int64_t e, uint32_t* buf) {
    down_dw_one({DY + e * cap * d, d}, G + e * f * cap, O + e * d * f, nv[e], d, f, cap, &sq[e], buf);
  });
  return {dw, ordered(sq)};
}

// dx (E, C, D) = dh (E, 2F, C)^T @ w13 (E, 2F, D) over the valid slots (pad rows zero).
torch::Tensor expert_up_dx(torch::Tensor dh, torch::Tensor w13, torch::Tensor n) {
  check3(dh, "dh");
  check3(w13, "w13");
  int64_t e_n = dh.size(0), f2 = dh.size(1), cap = dh.size(2), d = w13.size(2);
  TORCH_CHECK(w13.size(0) == e_n && w13.size(1) == f2 && f2 % 2 == 0 && d % 16 == 0, "expert_up_dx: shapes ",
              dh.sizes(), " and ", w13.sizes());
  auto nv = valid_counts(n, e_n, cap);
  auto dx = torch::empty({e_n, cap, d}, dh.options());
  const uint16_t* DH = ptr<uint16_t>(dh);
  const uint16_t* W = ptr<uint16_t>(w13);
  uint16_t* DX = ptr<uint16_t>(dx);
  for_experts(e_n, nv, up_dx_words(f2, d, cap), [&](int64_t e, uint32_t* buf) {
    up_dx_one(DH + e * f2 * cap, W + e * f2 * d, DX + e * cap * d, nv[e], f2, d, cap, buf);
  });
  return dx;
}

// dw13 (E, 2F, D) = dh (E, 2F, C) @ x (E, C, D), summed over the valid slots; also the sum of
// squares of dw13 (as stored).
std::tuple<torch::Tensor, double> expert_up_dw(torch::Tensor dh, torch::Tensor x, torch::Tensor n) {
  check3(dh, "dh");
  check3(x, "x");
  int64_t e_n = dh.size(0), f2 = dh.size(1), cap = dh.size(2), d = x.size(2);
  TORCH_CHECK(x.size(0) == e_n && x.size(1) == cap && d % 16 == 0, "expert_up_dw: shapes ", dh.sizes(), " and ",
              x.sizes());
  const int64_t* nv = valid_counts(n, e_n, cap);
  auto dw = torch::empty({e_n, f2, d}, dh.options());
  const uint16_t* DH = ptr<uint16_t>(dh);
  const uint16_t* X = ptr<uint16_t>(x);
  uint16_t* O = ptr<uint16_t>(dw);
  std::vector<double> sq(e_n, 0.0);
  for_experts(e_n, nv, slots_words(f2, d, cap), [&](int64_t e, uint32_t* buf) {
    up_dw_one(DH + e * f2 * cap, {X + e * cap * d, d}, O + e * f2 * d, nv[e], f2, d, cap, &sq[e], buf);
  });
  return {dw, ordered(sq)};
}

// The whole forward of a level's experts, expert by expert while its rows are in L2: h = w13 x^T
// (expert_up), g = silu(h_gate) * h_up * gate (swiglu_gate_fwd), y = (w2 g)^T (expert_down), with
// x the level's token rows read in place from x (N, D) through tok (E * C; the gather of
// gather_rows, without the (E, C, D) copy). Returns {h, g, y}, each equal bit for bit to what the
// gather and the three passes give; h and g are what the backward reads. One pass instead of four:
// neither the token rows nor g are written out and read back, and the threads wait for the slowest
// expert once.
std::vector<torch::Tensor> expert_ffn_fwd(torch::Tensor w13, torch::Tensor w2, torch::Tensor x, torch::Tensor tok,
                                          torch::Tensor gate, torch::Tensor n) {
  const int64_t* nv = check_ffn("expert_ffn_fwd", w13, w2, x, tok, gate, n);
  int64_t e_n = w13.size(0), f2 = w13.size(1), f = f2 / 2, d = w13.size(2), cap = gate.size(1);
  auto h = torch::empty({e_n, f2, cap}, w13.options());
  auto g = torch::empty({e_n, f, cap}, w13.options());
  auto y = torch::empty({e_n, cap, d}, w13.options());
  const uint16_t *W13 = ptr<uint16_t>(w13), *W2 = ptr<uint16_t>(w2), *X = ptr<uint16_t>(x),
                 *GT = ptr<uint16_t>(gate);
  const int64_t* T = tok.data_ptr<int64_t>();
  uint16_t *H = ptr<uint16_t>(h), *G = ptr<uint16_t>(g), *Y = ptr<uint16_t>(y);
  int64_t words = std::max(up_words(d, cap), down_words(d, f, cap));
  for_experts(e_n, nv, words, [&](int64_t e, uint32_t* buf) {
    int64_t ne = nv[e];
    up_one(W13 + e * f2 * d, {X, d, T + e * cap}, H + e * f2 * cap, ne, f2, d, cap, buf);
    swiglu_fwd_expert(H + e * f2 * cap, GT + e * cap, G + e * f * cap, f, cap, ne);
    down_one(W2 + e * d * f, G + e * f * cap, Y + e * cap * d, ne, d, f, cap, buf);
  });
  return {h, g, y};
}

// The whole backward of a level's experts from the output gradient dy (N, D), its rows and x's read
// through tok as in the forward, expert by expert: dg = w2^T dy^T (expert_down_dx), then dh and the
// gate gradient (swiglu_gate_bwd), dw2 (expert_down_dw), dw13 (expert_up_dw) and dx (expert_up_dx).
// dg and dh live only in the thread's scratch (L2), never in memory. Returns (dx (E, C, D) token
// rows, dw13, its sum of squares, dw2, its sum of squares, d_gate (E, C) fp32), each equal bit for
// bit to what the gathers and the five passes give.
std::tuple<torch::Tensor, torch::Tensor, double, torch::Tensor, double, torch::Tensor> expert_ffn_bwd(
    torch::Tensor w13, torch::Tensor w2, torch::Tensor x, torch::Tensor tok, torch::Tensor h, torch::Tensor g,
    torch::Tensor gate, torch::Tensor dy, torch::Tensor n) {
  const int64_t* nv = check_ffn("expert_ffn_bwd", w13, w2, x, tok, gate, n);
  int64_t e_n = w13.size(0), f2 = w13.size(1), f = f2 / 2, d = w13.size(2), cap = gate.size(1);
  check3(h, "h");
  check3(g, "g");
  check(dy, "dy", torch::kBFloat16);
  TORCH_CHECK(h.sizes() == torch::IntArrayRef({e_n, f2, cap}) && g.sizes() == torch::IntArrayRef({e_n, f, cap}) &&
                  dy.sizes() == x.sizes(),
              "expert_ffn_bwd: shapes ", h.sizes(), ", ", g.sizes(), " and ", dy.sizes(), " for tokens ", x.sizes());
  auto dx = torch::empty({e_n, cap, d}, w13.options());
  auto dw13 = torch::empty({e_n, f2, d}, w13.options());
  auto dw2 = torch::empty({e_n, d, f}, w13.options());
  auto dgate = torch::empty({e_n, cap}, w13.options().dtype(torch::kFloat));
  const uint16_t *W13 = ptr<uint16_t>(w13), *W2 = ptr<uint16_t>(w2), *X = ptr<uint16_t>(x), *H = ptr<uint16_t>(h),
                 *G = ptr<uint16_t>(g), *GT = ptr<uint16_t>(gate), *DY = ptr<uint16_t>(dy);
  const int64_t* T = tok.data_ptr<int64_t>();
  uint16_t *DX = ptr<uint16_t>(dx), *DW13 = ptr<uint16_t>(dw13), *DW2 = ptr<uint16_t>(dw2);
  float* DGATE = ptr<float>(dgate);
  std::vector<double> sq13(e_n, 0.0), sq2(e_n, 0.0);
  int64_t held = up16((3 * f * cap + 1) / 2);  // dg (F, cap) and dh (2F, cap), bf16
  int64_t work = std::max({down_dx_words(d, f, cap), slots_words(d, f, cap), slots_words(f2, d, cap),
                           up_dx_words(f2, d, cap)});
  for_experts(e_n, nv, held + work, [&](int64_t e, uint32_t* buf) {
    int64_t ne = nv[e];
    uint16_t* dge = reinterpret_cast<uint16_t*>(buf);
    uint16_t* dhe = dge + f * cap;
    uint32_t* scratch = buf + held;
    const Rows dye{DY, d, T + e * cap}, xe{X, d, T + e * cap};
    const uint16_t* ge = G + e * f * cap;
    down_dx_one(W2 + e * d * f, dye, dge, ne, d, f, cap, scratch);
    swiglu_bwd_expert(dge, H + e * f2 * cap, GT + e * cap, dhe, DGATE + e * cap, f, cap, ne);
    down_dw_one(dye, ge, DW2 + e * d * f, ne, d, f, cap, &sq2[e], scratch);
    up_dw_one(dhe, xe, DW13 + e * f2 * d, ne, f2, d, cap, &sq13[e], scratch);
    up_dx_one(dhe, W13 + e * f2 * d, DX + e * cap * d, ne, f2, d, cap, scratch);
  });
  return {dx, dw13, ordered(sq13), dw2, ordered(sq2), dgate};
}

#else

bool expert_gemm_available() { return false; }
static torch::Tensor unavailable() {
  TORCH_CHECK(false, "expert gemm: this build has no AVX512-BF16");
  return {};
}
torch::Tensor expert_up(torch::Tensor, torch::Tensor, torch::Tensor) { return unavailable(); }
torch::Tensor expert_down(torch::Tensor, torch::Tensor, torch::Tensor) { return unavailable(); }
torch::Tensor expert_down_dx(torch::Tensor, torch::Tensor, torch::Tensor) { return unavailable(); }
std::tuple<torch::Tensor, double> expert_down_dw(torch::Tensor, torch::Tensor, torch::Tensor) { return {unavailable(), 0.0}; }
torch::Tensor expert_up_dx(torch::Tensor, torch::Tensor, torch::Tensor) { return unavailable(); }
std::tuple<torch::Tensor, double> expert_up_dw(torch::Tensor, torch::Tensor, torch::Tensor) { return {unavailable(), 0.0}; }
std::vector<torch::Tensor> expert_ffn_fwd(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                          torch::Tensor) {
  return {unavailable()};
}
std::tuple<torch::Tensor, torch::Tensor, double, torch::Tensor, double, torch::Tensor> expert_ffn_bwd(
    torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
    torch::Tensor, torch::Tensor) {
  auto u = unavailable();
  return {u, u, 0.0, u, 0.0, u};
}

#endif
