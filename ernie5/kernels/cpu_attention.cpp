// Fused CPU attention, forward and backward (built with cpu_kernels.cpp into one extension).
//
// bf16 storage, fp32 math, whole key rows (S <= 512 in use; no online softmax), exact softmax.
// Dot products of two bf16 operands (Q K^T, dO V^T) run on AMX tiles where the CPU and the
// kernel allow them, else on AVX512-BF16 _mm512_dpbf16_ps: both multiply bf16 exactly and add in
// fp32. Products involving fp32 intermediates (P V, P^T dO, dS^T Q, dS K) use fp32 FMAs, so P and
// dS are never rounded to bf16. Causal rows skip key blocks above the diagonal; with an additive
// mask each 16-row query block only visits the key span where the mask is finite. A fully masked
// row gives o = 0, lse = +inf and zero gradients.
//
// Determinism: one task per (batch, kv head, head split), the split depending only on the shape;
// dK/dV of the query heads of a group accumulate in fp32 buffers and are reduced over the splits
// in a fixed order, so results are bit-identical run to run and across thread counts.
//
// Portability: compiled only where the compiler targets AVX-512F + AVX512-BF16 (-march=native on
// such a CPU); elsewhere attention_available() is false and the model runs PyTorch's attention.
// The AMX path additionally needs AMX-TILE/AMX-BF16 and the kernel's permission
// (arch_prctl ARCH_REQ_XCOMP_PERM), else the AVX512-BF16 path runs.
#include <torch/extension.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ERNIE5_ATTENTION 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ERNIE5_AMX 1
#endif
#endif

#ifdef ERNIE5_ATTENTION
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_common.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace ernie5_kernels;

// ---- AMX (tile bf16 dot products: exact bf16 products, fp32 accumulation, like dpbf16) ----
bool amx_permitted() {  // asks the kernel once per process
#ifdef ERNIE5_AMX
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XFEATURE_XTILEDATA*/) == 0;
  return ok;
#else
  return false;
#endif
}

#ifdef ERNIE5_AMX
struct __attribute__((packed)) TileCfg {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline void amx_config() {
  TileCfg cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // gcc 12 treats ldtilecfg's operand as not read and drops the stores above; force them to memory
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
inline void amx_release() { _tile_release(); }
#else
inline void amx_config() {}
inline void amx_release() {}
#endif

constexpr int QB = 16;  // query rows per block (== key block width)


// Pair-interleaved bf16 layout (dpbf16 / AMX "VNNI" B operand):
// [Spad/16 key blocks][PP pairs][16 keys] uint32 (lo = elem 2p, hi = elem 2p+1); pairs >= D/2 and keys >= S are 0.
void pack_pairs(const uint16_t* src, int S, int D, int PP, uint32_t* dst, int Spad) {
  const int P = D / 2;
  const uint32_t* s32 = reinterpret_cast<const uint32_t*>(src);
  for (int kb = 0; kb < Spad / 16; ++kb)
    for (int p = 0; p < PP; ++p)
      for (int l = 0; l < 16; ++l) {
        int j = kb * 16 + l;
        dst[(kb * PP + p) * 16 + l] = (j < S && p < P) ? s32[j * P + p] : 0u;
      }
}

template <int ND> struct Dims {
  static constexpr int D = ND * 16;
  static constexpr int Dp = (ND + 1) / 2 * 32;  // D padded to a multiple of 32 (AMX K-chunk)
  static constexpr int PP = Dp / 2;
  static constexpr int NC = Dp / 32;
};

// dpbf16 path: out[r][kb*16 + l] = sum_d q[r][d] * k[kb*16+l][d]  for 4 rows, NKB key blocks
template <int ND, int NKB>
inline void qk_tile4(const uint16_t* q, const uint32_t* kp, float* out, int ldo) {
  using Dm = Dims<ND>;
  __m512 acc[4][NKB];
  for (int r = 0; r < 4; ++r)
    for (int n = 0; n < NKB; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int p = 0; p < Dm::D / 2; ++p) {
    __m512i kv[NKB];
    for (int n = 0; n < NKB; ++n) kv[n] = _mm512_loadu_si512(kp + (n * Dm::PP + p) * 16);
    for (int r = 0; r < 4; ++r) {
      uint32_t qq; std::memcpy(&qq, q + r * Dm::Dp + 2 * p, 4);
      __m512i qb = _mm512_set1_epi32(int(qq));
      for (int n = 0; n < NKB; ++n)
        acc[r][n] = _mm512_dpbf16_ps(acc[r][n], (__m512bh)kv[n], (__m512bh)qb);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int n = 0; n < NKB; ++n) _mm512_storeu_ps(out + r * ldo + n * 16, acc[r][n]);
}

// Sb[r][j] for the QB rows of qbuf (stride Dp) and key blocks [kb0, kb1)
template <int ND>
void qk_block(bool amx, const uint16_t* qbuf, const uint32_t* kp, int kb0, int kb1, float* Sb, int ldo) {
  using Dm = Dims<ND>;
  constexpr int PP = Dm::PP;
#ifdef ERNIE5_AMX
  if (amx) {
    // tiles 0..NC-1: Q chunks (16 rows x 32 bf16); 4: K block chunk (16 pairs x 16 keys); 5: C (16 x 16 fp32)
    _tile_loadd(0, qbuf, Dm::Dp * 2);
    if constexpr (Dm::NC > 1) _tile_loadd(1, qbuf + 32, Dm::Dp * 2);
    if constexpr (Dm::NC > 2) _tile_loadd(2, qbuf + 64, Dm::Dp * 2);
    if constexpr (Dm::NC > 3) _tile_loadd(3, qbuf + 96, Dm::Dp * 2);
    for (int kb = kb0; kb < kb1; ++kb) {
      const uint32_t* b = kp + size_t(kb) * PP * 16;
      _tile_zero(5);
      _tile_loadd(4, b, 64); _tile_dpbf16ps(5, 0, 4);
      if constexpr (Dm::NC > 1) { _tile_loadd(6, b + 16 * 16, 64); _tile_dpbf16ps(5, 1, 6); }
      if constexpr (Dm::NC > 2) { _tile_loadd(4, b + 32 * 16, 64); _tile_dpbf16ps(5, 2, 4); }
      if constexpr (Dm::NC > 3) { _tile_loadd(6, b + 48 * 16, 64); _tile_dpbf16ps(5, 3, 6); }
      _tile_stored(5, Sb + kb * 16, ldo * 4);
    }
    return;
  }
#endif
  for (int r0 = 0; r0 < QB; r0 += 4) {
    const uint16_t* q = qbuf + r0 * Dm::Dp;
    float* o = Sb + r0 * ldo;
    int kb = kb0;
    for (; kb + 4 <= kb1; kb += 4) qk_tile4<ND, 4>(q, kp + kb * PP * 16, o + kb * 16, ldo);
    switch (kb1 - kb) {
      case 3: qk_tile4<ND, 3>(q, kp + kb * PP * 16, o + kb * 16, ldo); break;
      case 2: qk_tile4<ND, 2>(q, kp + kb * PP * 16, o + kb * 16, ldo); break;
      case 1: qk_tile4<ND, 1>(q, kp + kb * PP * 16, o + kb * 16, ldo); break;
      default: break;
    }
  }
}

constexpr int rblk(int ND) { return ND == 1 ? 16 : ND == 2 ? 8 : ND <= 4 ? 4 : 2; }

// C[r][:] = sum_{j in [j0,j1)} A[r][j] * B[j][:]   (R rows)
template <int ND, int R>
inline void axb_tile(const float* A, int lda, const float* Bm, int j0, int j1, float* C) {
  constexpr int D = ND * 16;
  __m512 acc[R][ND];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < ND; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int j = j0; j < j1; ++j) {
    __m512 b[ND];
    for (int n = 0; n < ND; ++n) b[n] = _mm512_loadu_ps(Bm + j * D + n * 16);
    for (int r = 0; r < R; ++r) {
      __m512 a = _mm512_set1_ps(A[r * lda + j]);
      for (int n = 0; n < ND; ++n) acc[r][n] = _mm512_fmadd_ps(a, b[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < ND; ++n) _mm512_storeu_ps(C + r * D + n * 16, acc[r][n]);
}

// C[j0+jj][:] += sum_{r in [r0,r1)} A[r][j0+jj] * X[r][:]   (J keys)
template <int ND, int J>
inline void atx_tile(const float* A, int lda, int r0, int r1, const float* X, float* C, int j0) {
  constexpr int D = ND * 16;
  __m512 acc[J][ND];
  for (int jj = 0; jj < J; ++jj)
    for (int n = 0; n < ND; ++n) acc[jj][n] = _mm512_loadu_ps(C + (j0 + jj) * D + n * 16);
  for (int r = r0; r < r1; ++r) {
    __m512 x[ND];
    for (int n = 0; n < ND; ++n) x[n] = _mm512_loadu_ps(X + r * D + n * 16);
    for (int jj = 0; jj < J; ++jj) {
      __m512 a = _mm512_set1_ps(A[r * lda + j0 + jj]);
      for (int n = 0; n < ND; ++n) acc[jj][n] = _mm512_fmadd_ps(a, x[n], acc[jj][n]);
    }
  }
  for (int jj = 0; jj < J; ++jj)
    for (int n = 0; n < ND; ++n) _mm512_storeu_ps(C + (j0 + jj) * D + n * 16, acc[jj][n]);
}

struct BiasView {
  const float* p = nullptr;
  int64_t sb = 0, sh = 0, st = 0;
  const float* row(int b, int h, int i) const { return p + b * sb + h * sh + int64_t(i) * st; }
};

// first / last+1 index in [0, e) with finite (!= -inf) bias; f == e if none. Vectorised scan.
inline void finite_span(const float* br, int e, int& f, int& l) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  f = e;
  for (int j = 0; j < e; j += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(__mmask16((e - j >= 16) ? 0xffff : ((1u << (e - j)) - 1)), br + j), ninf, _CMP_NEQ_UQ);
    if (e - j < 16) m &= __mmask16((1u << (e - j)) - 1);
    if (m) { f = j + __builtin_ctz(m); break; }
  }
  l = f;
  if (f == e) return;
  for (int j = ((e - 1) / 16) * 16; j >= f - 15 && j >= 0; j -= 16) {
    int n = std::min(16, e - j);
    __mmask16 lm = __mmask16(n >= 16 ? 0xffff : ((1u << n) - 1));
    __mmask16 m = _mm512_mask_cmp_ps_mask(lm, _mm512_maskz_loadu_ps(lm, br + j), ninf, _CMP_NEQ_UQ);
    if (m) { l = j + 31 - __builtin_clz(uint32_t(m)) + 1; break; }
  }
}

// Key ranges [jlo, jhi) per query block: causal cut and (if bias) span of finite bias entries.
void key_ranges(int T, int S, bool causal, const BiasView& bv, int b, int h, std::vector<int>& rng) {
  const int nqb = (T + QB - 1) / QB;
  rng.resize(2 * nqb);
  for (int qb = 0; qb < nqb; ++qb) {
    const int i0 = qb * QB, nr = std::min(QB, T - i0);
    const int hi_c = causal ? std::min(S, i0 + nr) : S;
    int jlo = 0, jhi = hi_c;
    if (bv.p) {
      jlo = S; jhi = 0;
      for (int r = 0; r < nr; ++r) {
        const int e = causal ? std::min(S, i0 + r + 1) : S;
        int f, l;
        finite_span(bv.row(b, h, i0 + r), e, f, l);
        if (f == e) continue;
        jlo = std::min(jlo, f);
        jhi = std::max(jhi, l);
      }
      if (jhi <= jlo) { jlo = 0; jhi = 0; }
    }
    rng[2 * qb] = jlo; rng[2 * qb + 1] = jhi;
  }
}

// x = s*scale (+bias); lanes with key >= rowend or key >= S -> -inf.
inline __m512 masked_logits(const float* srow, const float* brow, int j, int rowend, int S, float scale) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i lane = _mm512_add_epi32(_mm512_set1_epi32(j), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __mmask16 valid = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(rowend));
  __m512 x = _mm512_mul_ps(_mm512_loadu_ps(srow + j), _mm512_set1_ps(scale));
  if (brow) {
    __mmask16 inS = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(S));
    x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(inS, brow + j));
  }
  return _mm512_mask_blend_ps(valid, ninf, x);
}

// Heads of a kv group are split into nsplit task chunks. Depends only on the shape (not on the thread
// count), so results are bit-identical run to run and across thread counts.
int choose_nsplit(int B, int K, int G) {
  for (int d = 1; d <= G; ++d)
    if (G % d == 0 && int64_t(B) * K * d >= 16) return d;
  return G;
}

inline void load_rows(uint16_t* buf, int ld, const uint16_t* src, int D, int nr) {
  std::memset(buf, 0, sizeof(uint16_t) * QB * ld);
  for (int r = 0; r < nr; ++r) std::memcpy(buf + r * ld, src + int64_t(r) * D, sizeof(uint16_t) * D);
}

template <int ND>
void fwd_impl(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o, float* lse, int B, int H, int K,
              int T, int S, int Spad, bool causal, const BiasView& bv, float scale, bool amx) {
  using Dm = Dims<ND>;
  constexpr int D = Dm::D, Dp = Dm::Dp;
  constexpr int R = rblk(ND);
  const int G = H / K, nsplit = choose_nsplit(B, K, G), hps = G / nsplit;
  const int nqb = (T + QB - 1) / QB;
  at::parallel_for(0, int64_t(B) * K * nsplit, 1, [&](int64_t beg, int64_t end) {
    std::vector<uint16_t> qbuf(QB * Dp);
    std::vector<uint32_t> kp(size_t(Spad) * Dm::PP);
    std::vector<float> vf(size_t(Spad) * D), Sb(size_t(QB) * Spad), Ob(QB * D), rinv(QB);
    std::vector<int> rng;
    if (amx) amx_config();
    for (int64_t task = beg; task < end; ++task) {
      const int bg = int(task / nsplit), sp = int(task % nsplit), b = bg / K, g = bg % K;
      pack_pairs(k + int64_t(bg) * S * D, S, D, Dm::PP, kp.data(), Spad);
      std::memset(vf.data(), 0, sizeof(float) * Spad * D);
      for (int x = 0; x < S * D; ++x) vf[x] = to_f(v[int64_t(bg) * S * D + x]);
      int rng_h = -1;
      for (int t = 0; t < hps; ++t) {
        const int h = g * G + sp * hps + t;
        const int64_t bh = int64_t(b) * H + h;
        const int hb = bv.sh ? h : 0;
        if (hb != rng_h) { key_ranges(T, S, causal, bv, b, h, rng); rng_h = hb; }
        const uint16_t* qh = q + bh * T * D;
        uint16_t* oh = o + bh * T * D;
        float* lh = lse + bh * T;
        for (int qb = 0; qb < nqb; ++qb) {
          const int i0 = qb * QB, nr = std::min(QB, T - i0);
          load_rows(qbuf.data(), Dp, qh + int64_t(i0) * D, D, nr);
          const int jlo = rng[2 * qb], jhi = rng[2 * qb + 1];
          const int kb0 = jlo / 16, kb1 = (jhi + 15) / 16, j0 = kb0 * 16, j1 = kb1 * 16;
          if (kb1 > kb0) qk_block<ND>(amx, qbuf.data(), kp.data(), kb0, kb1, Sb.data(), Spad);
          for (int r = 0; r < QB; ++r) {
            float* sr = Sb.data() + size_t(r) * Spad;
            if (r >= nr) { for (int j = j0; j < j1; ++j) sr[j] = 0.f; rinv[r] = 0.f; continue; }
            const int i = i0 + r;
            const float* br = bv.p ? bv.row(b, h, i) : nullptr;
            const int rowend = causal ? std::min(jhi, i + 1) : jhi;
            __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            for (int j = j0; j < j1; j += 16) {
              __m512 x = masked_logits(sr, br, j, rowend, S, scale);
              _mm512_storeu_ps(sr + j, x);
              vm = _mm512_max_ps(vm, x);
            }
            const float m = (j1 > j0) ? _mm512_reduce_max_ps(vm) : -std::numeric_limits<float>::infinity();
            if (m == -std::numeric_limits<float>::infinity()) {  // fully masked row: o = 0, lse = +inf
              for (int j = j0; j < j1; ++j) sr[j] = 0.f;
              rinv[r] = 0.f;
              lh[i] = std::numeric_limits<float>::infinity();
              continue;
            }
            __m512 vs = _mm512_setzero_ps(), mm = _mm512_set1_ps(m);
            for (int j = j0; j < j1; j += 16) {
              __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mm));
              _mm512_storeu_ps(sr + j, p);
              vs = _mm512_add_ps(vs, p);
            }
            const float sum = _mm512_reduce_add_ps(vs);
            rinv[r] = 1.f / sum;
            lh[i] = m + std::log(sum);
          }
          for (int r0 = 0; r0 < QB; r0 += R) {
            const int je = causal ? std::min(j1, i0 + r0 + R) : j1;
            axb_tile<ND, R>(Sb.data() + size_t(r0) * Spad, Spad, vf.data(), j0, std::max(j0, je), Ob.data() + r0 * D);
          }
          for (int r = 0; r < nr; ++r)
            for (int d = 0; d < D; ++d) oh[int64_t(i0 + r) * D + d] = from_f<uint16_t>(Ob[r * D + d] * rinv[r]);
        }
      }
    }
    if (amx) amx_release();
  });
}

template <int ND>
void bwd_impl(const uint16_t* dO, const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
              const float* lse, uint16_t* dq, uint16_t* dk, uint16_t* dv, float* part, int B, int H, int K, int T,
              int S, int Spad, bool causal, const BiasView& bv, float scale, int nsplit, bool amx) {
  using Dm = Dims<ND>;
  constexpr int D = Dm::D, Dp = Dm::Dp;
  constexpr int R = rblk(ND);
  constexpr int J = rblk(ND);
  const int G = H / K, hps = G / nsplit;
  const int nqb = (T + QB - 1) / QB;
  at::parallel_for(0, int64_t(B) * K * nsplit, 1, [&](int64_t beg, int64_t end) {
    std::vector<uint16_t> qbuf(QB * Dp), dobuf(QB * Dp);
    std::vector<uint32_t> kp(size_t(Spad) * Dm::PP), vp(size_t(Spad) * Dm::PP);
    std::vector<float> kf(size_t(Spad) * D), dKa(size_t(Spad) * D), dVa(size_t(Spad) * D);
    std::vector<float> Qf(QB * D), dOf(QB * D), dQb(QB * D), Pb(size_t(QB) * Spad), dSb(size_t(QB) * Spad), Di(QB);
    std::vector<int> rng;
    if (amx) amx_config();
    for (int64_t task = beg; task < end; ++task) {
      const int bg = int(task / nsplit), sp = int(task % nsplit), b = bg / K, g = bg % K;
      pack_pairs(k + int64_t(bg) * S * D, S, D, Dm::PP, kp.data(), Spad);
      pack_pairs(v + int64_t(bg) * S * D, S, D, Dm::PP, vp.data(), Spad);
      std::memset(kf.data(), 0, sizeof(float) * Spad * D);
      for (int x = 0; x < S * D; ++x) kf[x] = to_f(k[int64_t(bg) * S * D + x]);
      std::memset(dKa.data(), 0, sizeof(float) * Spad * D);
      std::memset(dVa.data(), 0, sizeof(float) * Spad * D);
      int rng_h = -1;
      for (int t = 0; t < hps; ++t) {  // fixed head order -> deterministic dK/dV accumulation
        const int h = g * G + sp * hps + t;
        const int64_t bh = int64_t(b) * H + h;
        const int hb = bv.sh ? h : 0;
        if (hb != rng_h) { key_ranges(T, S, causal, bv, b, h, rng); rng_h = hb; }
        for (int qb = 0; qb < nqb; ++qb) {
          const int i0 = qb * QB, nr = std::min(QB, T - i0);
          const int64_t off = (bh * T + i0) * D;
          load_rows(qbuf.data(), Dp, q + off, D, nr);
          load_rows(dobuf.data(), Dp, dO + off, D, nr);
          for (int r = 0; r < QB; ++r)
            for (int d = 0; d < D; ++d) { Qf[r * D + d] = to_f(qbuf[r * Dp + d]); dOf[r * D + d] = to_f(dobuf[r * Dp + d]); }
          for (int r = 0; r < nr; ++r) {
            __m512 acc = _mm512_setzero_ps();
            for (int n = 0; n < ND; ++n) {
              acc = _mm512_fmadd_ps(_mm512_loadu_ps(dOf.data() + r * D + n * 16), load16(o + off + r * D + n * 16), acc);
            }
            Di[r] = _mm512_reduce_add_ps(acc);
          }
          const int jlo = rng[2 * qb], jhi = rng[2 * qb + 1];
          const int kb0 = jlo / 16, kb1 = (jhi + 15) / 16, j0 = kb0 * 16, j1 = kb1 * 16;
          if (kb1 > kb0) {
            qk_block<ND>(amx, qbuf.data(), kp.data(), kb0, kb1, Pb.data(), Spad);
            qk_block<ND>(amx, dobuf.data(), vp.data(), kb0, kb1, dSb.data(), Spad);
          }
          for (int r = 0; r < QB; ++r) {
            float* pr = Pb.data() + size_t(r) * Spad;
            float* dr = dSb.data() + size_t(r) * Spad;
            if (r >= nr) { for (int j = j0; j < j1; ++j) pr[j] = dr[j] = 0.f; continue; }
            const int i = i0 + r;
            const float* br = bv.p ? bv.row(b, h, i) : nullptr;
            const int rowend = causal ? std::min(jhi, i + 1) : jhi;
            const __m512 L = _mm512_set1_ps(lse[bh * T + i]), dI = _mm512_set1_ps(Di[r]), sc = _mm512_set1_ps(scale);
            for (int j = j0; j < j1; j += 16) {
              __m512 x = masked_logits(pr, br, j, rowend, S, scale);
              __m512 p = exp512(_mm512_sub_ps(x, L));
              __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dr + j), dI)), sc);
              _mm512_storeu_ps(pr + j, p);
              _mm512_storeu_ps(dr + j, ds);
            }
          }
          // dV += P^T dO, dK += dS^T Q  (scale folded into dS)
          for (int jg = j0; jg < j1; jg += J) {
            const int rs = causal ? std::max(0, jg - i0) : 0;
            if (rs >= nr) continue;
            atx_tile<ND, J>(Pb.data(), Spad, rs, nr, dOf.data(), dVa.data(), jg);
            atx_tile<ND, J>(dSb.data(), Spad, rs, nr, Qf.data(), dKa.data(), jg);
          }
          // dQ = dS K
          for (int r0 = 0; r0 < QB; r0 += R) {
            const int je = causal ? std::min(j1, i0 + r0 + R) : j1;
            axb_tile<ND, R>(dSb.data() + size_t(r0) * Spad, Spad, kf.data(), j0, std::max(j0, je), dQb.data() + r0 * D);
          }
          for (int r = 0; r < nr; ++r)
            for (int d = 0; d < D; ++d) dq[off + r * D + d] = from_f<uint16_t>(dQb[r * D + d]);
        }
      }
      if (nsplit == 1) {
        for (int x = 0; x < S * D; ++x) { dk[int64_t(bg) * S * D + x] = from_f<uint16_t>(dKa[x]); dv[int64_t(bg) * S * D + x] = from_f<uint16_t>(dVa[x]); }
      } else {
        float* pk = part + (int64_t(bg) * nsplit + sp) * 2 * S * D;
        std::memcpy(pk, dKa.data(), sizeof(float) * S * D);
        std::memcpy(pk + S * D, dVa.data(), sizeof(float) * S * D);
      }
    }
    if (amx) amx_release();
  });
  if (nsplit > 1) {
    at::parallel_for(0, int64_t(B) * K, 1, [&](int64_t beg, int64_t end) {
      for (int64_t bg = beg; bg < end; ++bg)
        for (int x = 0; x < S * D; ++x) {
          float sk = 0.f, sv = 0.f;
          for (int sp = 0; sp < nsplit; ++sp) {  // fixed order
            const float* pk = part + (bg * nsplit + sp) * 2 * S * D;
            sk += pk[x]; sv += pk[S * D + x];
          }
          dk[bg * S * D + x] = from_f<uint16_t>(sk); dv[bg * S * D + x] = from_f<uint16_t>(sv);
        }
    });
  }
}

BiasView make_bias(const torch::Tensor& bias, torch::Tensor& keep, int B, int H, int T, int S) {
  BiasView bv;
  if (!bias.defined() || bias.numel() == 0) return bv;
  TORCH_CHECK(bias.dim() == 4, "bias must be 4-d (B|1, H|1, T, S)");
  TORCH_CHECK((bias.size(0) == B || bias.size(0) == 1) && (bias.size(1) == H || bias.size(1) == 1) &&
                  bias.size(2) == T && bias.size(3) == S, "bias shape mismatch");
  keep = bias.to(torch::kFloat32).contiguous();
  bv.p = keep.data_ptr<float>();
  bv.sb = keep.size(0) == 1 ? 0 : keep.stride(0);
  bv.sh = keep.size(1) == 1 ? 0 : keep.stride(1);
  bv.st = keep.stride(2);
  return bv;
}

void check_qkv(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16, "q,k,v must be bf16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q,k,v must be 4-d");
  TORCH_CHECK(k.sizes() == v.sizes(), "k,v shape mismatch");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q,k shape mismatch");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "H % K != 0");
  const int D = q.size(3);
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 128, "D must be a multiple of 16 in [16,128]");
  TORCH_CHECK(q.size(2) <= 4096 && k.size(2) <= 4096, "T,S too large for whole-row buffers");
}

#define DISPATCH_ND(D, FN, ...)                  \
  switch ((D) / 16) {                            \
    case 1: FN<1>(__VA_ARGS__); break;           \
    case 2: FN<2>(__VA_ARGS__); break;           \
    case 3: FN<3>(__VA_ARGS__); break;           \
    case 4: FN<4>(__VA_ARGS__); break;           \
    case 5: FN<5>(__VA_ARGS__); break;           \
    case 6: FN<6>(__VA_ARGS__); break;           \
    case 7: FN<7>(__VA_ARGS__); break;           \
    case 8: FN<8>(__VA_ARGS__); break;           \
    default: TORCH_CHECK(false, "bad D");        \
  }

}  // namespace

bool attention_available() { return true; }

bool attention_amx() { return amx_permitted(); }

std::vector<torch::Tensor> attn_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, torch::Tensor bias,
                                    bool allow_amx) {
  check_qkv(q, k, v);
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  const int B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), K = k.size(1), S = k.size(2);
  const int Spad = (S + 15) / 16 * 16;
  torch::Tensor keep;
  BiasView bv = make_bias(bias, keep, B, H, T, S);
  auto o = torch::empty_like(q);
  auto lse = torch::empty({B, H, T}, q.options().dtype(torch::kFloat32));
  const float scale = 1.0f / std::sqrt(float(D));
  DISPATCH_ND(D, fwd_impl, (const uint16_t*)q.data_ptr(), (const uint16_t*)k.data_ptr(), (const uint16_t*)v.data_ptr(),
              (uint16_t*)o.data_ptr(), lse.data_ptr<float>(), B, H, K, T, S, Spad, causal, bv, scale,
              allow_amx && amx_permitted());
  return {o, lse};
}

std::vector<torch::Tensor> attn_bwd(torch::Tensor dO, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o,
                                    torch::Tensor lse, bool causal, torch::Tensor bias, bool allow_amx) {
  check_qkv(q, k, v);
  TORCH_CHECK(dO.sizes() == q.sizes() && o.sizes() == q.sizes(), "dO/o shape");
  dO = dO.to(torch::kBFloat16).contiguous(); o = o.to(torch::kBFloat16).contiguous();
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  lse = lse.to(torch::kFloat32).contiguous();
  const int B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), K = k.size(1), S = k.size(2);
  const int Spad = (S + 15) / 16 * 16;
  torch::Tensor keep;
  BiasView bv = make_bias(bias, keep, B, H, T, S);
  auto dq = torch::empty_like(q);
  auto dk = torch::empty_like(k), dv = torch::empty_like(v);
  const int nsplit = choose_nsplit(B, K, H / K);
  torch::Tensor part;
  if (nsplit > 1) part = torch::empty({int64_t(B) * K * nsplit * 2 * S * D}, q.options().dtype(torch::kFloat32));
  const float scale = 1.0f / std::sqrt(float(D));
  DISPATCH_ND(D, bwd_impl, (const uint16_t*)dO.data_ptr(), (const uint16_t*)q.data_ptr(), (const uint16_t*)k.data_ptr(),
              (const uint16_t*)v.data_ptr(), (const uint16_t*)o.data_ptr(), lse.data_ptr<float>(),
              (uint16_t*)dq.data_ptr(), (uint16_t*)dk.data_ptr(), (uint16_t*)dv.data_ptr(),
              nsplit > 1 ? part.data_ptr<float>() : nullptr, B, H, K, T, S, Spad, causal, bv, scale, nsplit,
              allow_amx && amx_permitted());
  return {dq, dk, dv};
}

#else  // no AVX-512 BF16: the model keeps PyTorch's attention

bool attention_available() { return false; }

bool attention_amx() { return false; }

std::vector<torch::Tensor> attn_fwd(torch::Tensor, torch::Tensor, torch::Tensor, bool, torch::Tensor, bool) {
  TORCH_CHECK(false, "fused attention needs a CPU with AVX512-BF16");
}

std::vector<torch::Tensor> attn_bwd(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                    torch::Tensor, bool, torch::Tensor, bool) {
  TORCH_CHECK(false, "fused attention needs a CPU with AVX512-BF16");
}

#endif
