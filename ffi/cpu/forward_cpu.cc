/*! \file forward_cpu.cc
    \brief FlashAttention-2 forward on the CPU.

    Work item: (batch item, query head, block of kLanes query rows), run in parallel. The
    block's scaled queries are packed once as an H x kLanes tile Q^T; the visible keys are then
    visited in blocks of kKeyBlock rows:
        S^T = K_blk Q^T                      (keys x queries, queries on the vector lanes;
                                              soft-capped, biased, masked: tiles_cpu.h)
        m' = max(m, colmax S^T), alpha = exp(m - m'), P^T = exp(S^T - m')
        l = alpha l + colsum P^T,  O^T = alpha O^T + V_blk^T P^T
    and finally out = O^T / l (transposed back), lse = m + log l. With the queries on the
    lanes the softmax statistics are plain vector operations, and the K and V blocks are used
    in their natural row-major layout (copied to contiguous float rows, never transposed).
    Both l and O^T take one partial sum per key block (V_blk^T P^T goes to a fresh tile first):
    one running sum over thousands of keys would accumulate rounding errors over all of them,
    while per block they pile up over kKeyBlock terms plus S / kKeyBlock partial sums only,
    which keeps long rows as accurate as xla's (the extra add replaces the rescaling pass).
    The visible keys are those of the window and the key length, narrowed with segment ids to
    the union of the block's kv spans (for a packed row of sorted documents: the documents of
    the block's rows). Items of one head are consecutive, so the threads working on a head
    share its K and V in cache. Extra memory per thread: a few kLanes x max(H, kKeyBlock) tiles.
*/
#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "attention_cpu.h"
#include "kernels_cpu.h"
#include "tiles_cpu.h"

namespace jax_flash::cpu {
namespace {

//! Keys per step of the forward's key loop (rows of the S^T tile).
constexpr int64_t kKeyBlock = 128;

template <typename A>
class Forward {
 public:
  static constexpr int64_t L = kLanes<A>;
  using V = VecOf<A>;
  static constexpr int W = Simd<A>::kWidth;

  explicit Forward(const ForwardParams& params)
      : pr_(params), p_(params), nqb_(CeilDiv(pr_.T, L)) {
    const AttentionOptions& o = p_.options;
    // Causal-like windows make later query blocks heavier: hand those out first.
    heavy_last_ = o.window_right >= 0 && o.window_left < 0;
  }

  int64_t num_items() const { return pr_.nb * pr_.N * nqb_; }

  void Run(int64_t item, Workspace& ws) const {
    // Consecutive items share a head, so that its K and V stay in the caches of the threads
    // working on it.
    const int64_t bn = item / nqb_;
    const int64_t rank = item % nqb_;
    const int64_t qb = heavy_last_ ? nqb_ - 1 - rank : rank;
    Block(bn / pr_.N, bn % pr_.N, qb * L, ws);
  }

 private:
  void Block(int64_t b, int64_t n, int64_t i0, Workspace& ws) const {
    const int64_t H = pr_.H;
    const int64_t rows = std::min<int64_t>(L, pr_.T - i0);
    const int64_t q_len = SeqLen(p_.q_seqlens, pr_.batch, b, pr_.T);
    const int64_t kv_len = SeqLen(p_.kv_seqlens, pr_.batch, b, pr_.S);
    const int64_t ni = std::clamp<int64_t>(q_len - i0, 0, rows);
    int64_t jlo = 0, jhi = 0;
    if (ni > 0) {
      KeyRange(p_.options, i0, i0 + ni, kv_len, &jlo, &jhi);
      IntersectSpans(p_.kv_span, pr_.batch, b, i0, i0 + ni, &jlo, &jhi);
    }

    A* m = ws.Get<A>(0, L);
    A* l = ws.Get<A>(1, L);
    A* ot = ws.Get<A>(2, H * L);
    if (jlo >= jhi) {
      for (int64_t t = 0; t < L; ++t) l[t] = A(0);
      Finish(b, n, i0, rows, 0, m, l, ot);
      return;
    }
    A* qt = ws.Get<A>(3, H * L);
    A* st = ws.Get<A>(4, kKeyBlock * L);
    A* row_buffer = ws.Get<A>(5, H);
    A* k_buffer = ws.Get<A>(6, kKeyBlock * H);
    A* v_buffer = ws.Get<A>(7, kKeyBlock * H);
    A* pv = ws.Get<A>(8, H * L);
    A* alpha = ws.Get<A>(9, L);

    PackTransposed<A>(pr_, p_.q, b, i0, ni, n, static_cast<A>(p_.options.scale), row_buffer, qt);
    for (int64_t t = 0; t < L; ++t) {
      m[t] = kNegInf<A>;
      l[t] = A(0);
    }
    for (int64_t t = 0; t < H * L; ++t) ot[t] = A(0);

    const int64_t kvh = n / pr_.G;
    for (int64_t j0 = jlo; j0 < jhi; j0 += kKeyBlock) {
      const int64_t nk = std::min<int64_t>(kKeyBlock, jhi - j0);
      CopyRows<A>(pr_, p_.k, b, j0, nk, kvh, A(1), k_buffer);
      LogitsQueryLanes<A>(pr_, b, n, i0, ni, j0, nk, k_buffer, H, qt, st);
      SoftmaxStep(st, nk, m, l, alpha);
      CopyRows<A>(pr_, p_.v, b, j0, nk, kvh, A(1), v_buffer);
      // PV^T[d][i] = sum_j V[j][d] P^T[j][i], then O^T = alpha O^T + PV^T
      Gemm<A>(pv, L, H, v_buffer, 1, H, st, L, nk, false);
      V a[4];
      for (int v = 0; v < 4; ++v) a[v] = Load<V>(alpha + v * W);
      for (int64_t d = 0; d < H; ++d) {
        A* row = ot + d * L;
        const A* add = pv + d * L;
        for (int v = 0; v < 4; ++v) {
          Store(row + v * W, Load<V>(row + v * W) * a[v] + Load<V>(add + v * W));
        }
      }
    }
    Finish(b, n, i0, rows, ni, m, l, ot);
  }

  //! Online softmax over one S^T tile (in place: becomes P^T); rescales l and returns the
  //! factor for O^T in `alpha_out`.
  void SoftmaxStep(A* st, int64_t nk, A* m, A* l, A* alpha_out) const {
    const V neg_inf = Splat<V>(kNegInf<A>);
    V mx[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
    for (int64_t j = 0; j < nk; ++j) {
      for (int v = 0; v < 4; ++v) mx[v] = Max(mx[v], Load<V>(st + j * L + v * W));
    }
    V base[4], alpha[4], sum[4];
    for (int v = 0; v < 4; ++v) {
      const V old_max = Load<V>(m + v * W);
      const V new_max = Max(old_max, mx[v]);
      Store(m + v * W, new_max);
      // A row that has seen only -inf so far keeps l = 0 and O = 0: subtract 0 instead.
      base[v] = new_max == neg_inf ? V{} : new_max;
      alpha[v] = Exp(old_max - base[v]);
      sum[v] = V{};
    }
    for (int64_t j = 0; j < nk; ++j) {
      A* row = st + j * L;
      for (int v = 0; v < 4; ++v) {
        const V e = Exp(Load<V>(row + v * W) - base[v]);
        Store(row + v * W, e);
        sum[v] += e;
      }
    }
    for (int v = 0; v < 4; ++v) {
      Store(l + v * W, Load<V>(l + v * W) * alpha[v] + sum[v]);
      Store(alpha_out + v * W, alpha[v]);
    }
  }

  //! Writes rows [i0, i0 + rows): live rows (< ni) with l > 0 get O / l and m + log l, the
  //! others 0 and -inf.
  void Finish(int64_t b, int64_t n, int64_t i0, int64_t rows, int64_t ni, const A* m,
              const A* l, const A* ot) const {
    const int64_t H = pr_.H;
    const Operand& out = p_.out;
    const Operand& lse = p_.lse;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t o = pr_.RowOffset(out, b, i0 + i, n);
      const int64_t lo = pr_.HeadRowOffset(lse, b, n, i0 + i);
      if (i < ni && l[i] != A(0)) {
        const A inv = A(1) / l[i];
        for (int64_t d = 0; d < H; ++d) StoreAs<A>(out.data, out.dtype, o + d, ot[d * L + i] * inv);
        static_cast<A*>(lse.data)[lo] = m[i] + std::log(l[i]);
      } else {
        for (int64_t d = 0; d < H; ++d) StoreAs<A>(out.data, out.dtype, o + d, A(0));
        static_cast<A*>(lse.data)[lo] = kNegInf<A>;
      }
    }
  }

  Problem pr_;
  const ForwardParams& p_;
  const int64_t nqb_;
  bool heavy_last_ = false;
};

template <typename A>
Status RunForwardTyped(const ForwardParams& params, TaskRunner& runner) {
  const Forward<A> forward(params);
  return ParallelFor(runner, forward.num_items(),
                     [&forward](int64_t item, Workspace& ws) { forward.Run(item, ws); });
}

}  // namespace

Status RunForward(const ForwardParams& params, TaskRunner& runner) {
  if (params.query_groups > 1) {
    return Status::InvalidArgument("jax_flash: the CPU forward packs the query heads of a single "
                                   "query row only (query_groups > 1 with several rows is the "
                                   "Hopper kernels')");
  }
  try {
    const ElementType expected_lse = params.shape.dtype == ElementType::kFloat64
                                         ? ElementType::kFloat64
                                         : ElementType::kFloat32;
    if (params.lse.dtype != expected_lse) {
      return Status::InvalidArgument("jax_flash: lse dtype does not match the problem dtype");
    }
    switch (params.shape.dtype) {
      case ElementType::kFloat64: return RunForwardTyped<double>(params, runner);
      case ElementType::kFloat32:
      case ElementType::kBFloat16:
      case ElementType::kFloat16: return RunForwardTyped<float>(params, runner);
      default: return Status::InvalidArgument("jax_flash: unsupported dtype for the CPU forward");
    }
  } catch (const std::exception& e) {
    return Status::Internal(std::string("jax_flash: CPU forward failed: ") + e.what());
  } catch (...) {
    return Status::Internal("jax_flash: CPU forward failed");
  }
}

}  // namespace jax_flash::cpu
