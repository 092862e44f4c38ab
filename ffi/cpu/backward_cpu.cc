/*! \file backward_cpu.cc
    \brief FlashAttention-2 backward on the CPU, deterministic.

    With P = exp(S - lse) recomputed from the saved log-sum-exp (the logits are recomputed
    bit-for-bit as in the forward) and D_i = rowsum(dO_i * O_i) - dlse_i:
        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ = scale dX K,  dK = scale dX^T Q,
    with dX = dS * (1 - t^2), t = tanh(X / softcap), X = scale Q K^T, under soft-capping
    (S = softcap t + bias), dX = dS otherwise; dbias takes dS.
    No result is accumulated by more than one task, and every sum runs in a fixed order, so
    the results do not depend on the number of threads or on scheduling.

    0. Row terms (parallel over (head, block of kLanes query rows)): D and the saved lse per
       query row; padded rows and rows that saw no key get lse = +inf (so P = 0) and D = 0.
       Rows with a large lse also get a normalisation factor for P (see RowTerms).
    Then one of two schemes, chosen from the shapes alone:
    Two passes (general):
    1. Key pass (parallel over (kv head, block of kLanes keys)): K^T and V^T of the block are
       packed once; for each query head of the group and each block of query rows, in order:
       S = (scale Q) K^T with the keys on the vector lanes, P, dP = dO V^T, dS, dX, then
       dV^T += dO^T P and dK^T += (scale Q)^T dX in per-task accumulators.
    2. Query pass (parallel over (head, block of kLanes query rows)), in the same work list as
       pass 1: S^T, P^T, dP^T, dS^T, dX^T with the queries on the lanes, dQ^T += K^T dX^T.
       Seven matrix products per tile pair in all.
    Fused (no bias, at least kFusedMinTasks (batch item, kv head) pairs): one task per pair
       runs the key pass over all its key blocks in order and also accumulates dQ += dX K for
       the group's query heads in a T x H scratch: five matrix products.
    Every pass visits the keys (queries) of a block's window and lengths only, narrowed with
    segment ids to the union of the block's kv spans (q spans); a block whose range is empty
    is skipped (the fused pass still walks every key block, writing zero dK/dV for those).
    dbias = dS summed over the axes where bias broadcasts. When dbias keeps the key axis, the
    key pass owns its columns: a task takes every (batch item, kv head) whose dS lands in the
    same dbias slice and sums them in a fixed order in a (rows x kLanes) scratch. When dbias
    sums over keys, the query pass stores per-row sums over keys, which are then reduced in
    order over the broadcast batch/head/row axes.
*/
#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "attention_cpu.h"
#include "kernels_cpu.h"
#include "tiles_cpu.h"

namespace jax_flash::cpu {
namespace {

//! Rows whose saved lse has at least this magnitude have P renormalised (see RowTerms): from
//! there on, half an ulp of lse, by which its rounding alone may shift exp(S - lse), is 64 units
//! of roundoff or more.
constexpr double kRenormalizeFrom = 64;
//! Query rows per tile in the key pass.
constexpr int64_t kRowBlock = 64;
//! Keys per tile in the query pass.
constexpr int64_t kKeyBlock = 64;
//! Fused pass: at least this many (batch item, kv head) tasks, at most this much dQ scratch
//! per task (bytes).
constexpr int64_t kFusedMinTasks = 16;
constexpr int64_t kFusedMaxScratch = int64_t{32} << 20;

enum class DbiasMode { kNone, kColumns, kRows };

template <typename A>
class Backward {
 public:
  static constexpr int64_t L = kLanes<A>;
  using V = VecOf<A>;
  static constexpr int W = Simd<A>::kWidth;

  explicit Backward(const BackwardParams& params)
      : bp_(params), p_(params.fwd), pr_(params.fwd), nqb_(CeilDiv(pr_.T, L)),
        nkb_(CeilDiv(pr_.S, L)) {
    const AttentionOptions& o = p_.options;
    capped_ = SoftCap<A>(pr_) > A(0);
    causal_like_ = o.window_right >= 0 && o.window_left < 0;
    anticausal_like_ = o.window_left >= 0 && o.window_right < 0;
    padded_h_ = CeilDiv(pr_.H, L) * L;
    if (bp_.dbias.present()) {
      mode_ = bp_.dbias.extent[2] == pr_.S ? DbiasMode::kColumns : DbiasMode::kRows;
      heads_reduced_ = bp_.dbias.extent[0] == 1;
      rows_dbias_ = bp_.dbias.extent[1];
    }
  }

  Status Run(TaskRunner& runner) {
    const int64_t rows_total = pr_.nb * pr_.N * pr_.T;
    delta_.assign(static_cast<size_t>(rows_total), A(0));
    lse_.assign(static_cast<size_t>(rows_total), A(0));
    norm_.assign(static_cast<size_t>(rows_total), A(1));
    if (mode_ == DbiasMode::kRows) row_sums_.assign(static_cast<size_t>(rows_total), A(0));
    BuildGroups();
    // The fused pass does 5 instead of 7 matrix products but parallelises over (batch item,
    // kv head) only and keeps dQ of a whole kv head group per task: use it when there are
    // enough such tasks, the scratch stays moderate and no dbias slice is shared between
    // tasks. The choice depends on the shapes only, never on the thread count, so results
    // stay independent of it.
    const int64_t groups = static_cast<int64_t>(group_begin_.size()) - 1;
    fused_ = groups == pr_.nb * pr_.K && groups >= kFusedMinTasks &&
             pr_.G * pr_.T * padded_h_ * static_cast<int64_t>(sizeof(A)) <= kFusedMaxScratch;

    Status status = ParallelFor(runner, pr_.nb * pr_.N * nqb_,
                                [this](int64_t item, Workspace& ws) { RowTerms(item, ws); });
    if (!status.ok()) return status;
    if (fused_) {
      status = ParallelFor(runner, groups,
                           [this](int64_t item, Workspace& ws) { FusedItem(item, ws); });
    } else {
      const int64_t key_items = groups * nkb_;
      const int64_t query_items = pr_.nb * pr_.N * nqb_;
      status = ParallelFor(runner, key_items + query_items,
                           [this, key_items](int64_t item, Workspace& ws) {
                             if (item < key_items) {
                               KeyItem(item, ws);
                             } else {
                               QueryItem(item - key_items, ws);
                             }
                           });
    }
    if (!status.ok()) return status;
    if (mode_ == DbiasMode::kRows) RunInKernelFloatMode([this] { ReduceRowSums(); });
    return Status::Ok();
  }

 private:
  int64_t RowIndex(int64_t b, int64_t n, int64_t i) const { return (b * pr_.N + n) * pr_.T + i; }

  //! Groups (batch item, kv head) pairs whose dS lands in the same dbias slice (only when the
  //! key pass writes dbias); otherwise every pair is its own group.
  void BuildGroups() {
    const bool grouped = mode_ == DbiasMode::kColumns;
    std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> groups;
    std::vector<std::pair<int64_t, int64_t>> order;
    for (int64_t b = 0; b < pr_.nb; ++b) {
      for (int64_t kvh = 0; kvh < pr_.K; ++kvh) {
        std::pair<int64_t, int64_t> key(b, kvh);
        if (grouped) {
          key = {map_batch(pr_.batch, bp_.dbias.batch, b), heads_reduced_ ? 0 : kvh};
        }
        auto it = groups.find(key);
        if (it == groups.end()) {
          order.push_back(key);
          it = groups.emplace(key, std::vector<std::pair<int64_t, int64_t>>()).first;
        }
        it->second.emplace_back(b, kvh);
      }
    }
    group_begin_.assign(1, 0);
    for (const auto& key : order) {
      for (const auto& member : groups[key]) {
        member_b_.push_back(member.first);
        member_kvh_.push_back(member.second);
      }
      group_begin_.push_back(static_cast<int64_t>(member_b_.size()));
    }
  }

  // ---- 0. row terms ------------------------------------------------------------------------

  //! D, lse and the normalisation factor of P for the query rows [i0, i0 + kLanes) of one
  //! head. P = exp(S - lse) is only as accurate as the saved lse, which is rounded to the
  //! accumulation type: that alone gives each row's P a common relative error of up to half an
  //! ulp of lse (about u |lse|), which a softmax normalised by its row maximum (xla's) does not
  //! have, and where lse cannot hold log(l) at all (logits of 1e30) tied maxima each get P = 1.
  //! Rows with |lse| >= kRenormalizeFrom therefore get norm = 1 / sum_j exp(S_ij - lse_i) from
  //! the same logits, and every pass uses P = norm * exp(S - lse), which sums to 1 again; the
  //! other rows keep norm = 1 and cost nothing more.
  void RowTerms(int64_t item, Workspace& ws) {
    const int64_t bn = item / nqb_, i0 = item % nqb_ * L;
    const int64_t b = bn / pr_.N, n = bn % pr_.N, H = pr_.H;
    const int64_t rows = std::min<int64_t>(L, pr_.T - i0);
    const int64_t q_len = SeqLen(p_.q_seqlens, pr_.batch, b, pr_.T);
    A* o_row = ws.Get<A>(0, H);
    A* do_row = ws.Get<A>(1, H);
    const A inf = std::numeric_limits<A>::infinity();
    bool renormalize[L] = {};
    bool any = false;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = RowIndex(b, n, i0 + i);
      const A lse = i0 + i < q_len ? LoadAs<A>(p_.lse.data, p_.lse.dtype,
                                               pr_.HeadRowOffset(p_.lse, b, n, i0 + i))
                                   : kNegInf<A>;
      if (!(lse > kNegInf<A>)) {  // no visible key (or NaN): contributes nothing
        lse_[r] = inf;
        delta_[r] = A(0);
        continue;
      }
      ConvertRow<A>(p_.out.data, pr_.dtype, pr_.RowOffset(p_.out, b, i0 + i, n), H, A(1), o_row);
      ConvertRow<A>(bp_.dout.data, pr_.dtype, pr_.RowOffset(bp_.dout, b, i0 + i, n), H, A(1),
                    do_row);
      A dot = A(0);
      for (int64_t d = 0; d < H; ++d) dot += o_row[d] * do_row[d];
      lse_[r] = lse;
      delta_[r] = dot - LoadAs<A>(bp_.dlse.data, bp_.dlse.dtype,
                                  pr_.HeadRowOffset(bp_.dlse, b, n, i0 + i));
      renormalize[i] = std::abs(lse) >= A(kRenormalizeFrom);
      any = any || renormalize[i];
    }
    if (any) Renormalize(b, n, i0, std::min<int64_t>(rows, q_len - i0), renormalize, ws);
  }

  //! norm_ = 1 / sum_j exp(S_ij - lse_i) over the visible keys for the flagged rows among the
  //! live rows [i0, i0 + ni), with the logits computed as in the query pass.
  void Renormalize(int64_t b, int64_t n, int64_t i0, int64_t ni, const bool* flagged,
                   Workspace& ws) {
    const int64_t H = pr_.H;
    const int64_t kv_len = SeqLen(p_.kv_seqlens, pr_.batch, b, pr_.S);
    int64_t jlo = 0, jhi = 0;
    KeyRange(p_.options, i0, i0 + ni, kv_len, &jlo, &jhi);
    IntersectSpans(p_.kv_span, pr_.batch, b, i0, i0 + ni, &jlo, &jhi);
    A* qt = ws.Get<A>(2, H * L);
    A* st = ws.Get<A>(3, kKeyBlock * L);
    A* k_rows = ws.Get<A>(4, kKeyBlock * H);
    A* row_buffer = ws.Get<A>(5, H);
    alignas(kTileAlign) A lanes[L];
    for (int64_t i = 0; i < L; ++i) {
      lanes[i] = i < ni ? lse_[RowIndex(b, n, i0 + i)] : std::numeric_limits<A>::infinity();
    }
    PackTransposed<A>(pr_, p_.q, b, i0, ni, n, static_cast<A>(p_.options.scale), row_buffer, qt);
    V sum[4] = {};
    const int64_t kvh = n / pr_.G;
    for (int64_t j0 = jlo; j0 < jhi; j0 += kKeyBlock) {
      const int64_t nk = std::min<int64_t>(kKeyBlock, jhi - j0);
      CopyRows<A>(pr_, p_.k, b, j0, nk, kvh, A(1), k_rows);
      LogitsQueryLanes<A>(pr_, b, n, i0, ni, j0, nk, k_rows, H, qt, st);
      for (int64_t j = 0; j < nk; ++j) {
        for (int v = 0; v < 4; ++v) {
          sum[v] += Exp(Load<V>(st + j * L + v * W) - Load<V>(lanes + v * W));
        }
      }
    }
    for (int v = 0; v < 4; ++v) Store(lanes + v * W, sum[v]);
    for (int64_t i = 0; i < ni; ++i) {
      if (flagged[i]) norm_[RowIndex(b, n, i0 + i)] = A(1) / lanes[i];
    }
  }

  // ---- 1. key pass -------------------------------------------------------------------------

  //! Per-thread tiles of the key pass.
  struct KeyTiles {
    A* kt;          //!< K^T of the key block, H x L
    A* vt;          //!< V^T of the key block, H x L
    A* s;           //!< S, then P: kRowBlock x L
    A* dp;          //!< dP, then dS, then dX: kRowBlock x L
    A* dtanh;       //!< soft-capping: 1 - t^2, kRowBlock x L; otherwise nullptr
    A* sq;          //!< scale * Q rows: kRowBlock x H
    A* do_rows;     //!< dO rows: kRowBlock x H
    A* row_buffer;  //!< H
    A* dbias;       //!< dbias columns of the block (rows_dbias_ x L) or nullptr
    A* knat = nullptr;      //!< fused pass: K rows of the block, L x padded_h_ (zero padded)
    A* dq = nullptr;        //!< fused pass: dQ accumulators of query head g, T x padded_h_
    A* row_sums = nullptr;  //!< fused pass, dbias summed over keys: T sums of dS of head g
  };

  //! The tiles both passes take from the thread's workspace (slots 1-8 and 11); the fused
  //! pass's own (knat, dq, row_sums) stay nullptr until it sets them.
  KeyTiles WorkspaceTiles(Workspace& ws, bool dbias_here) const {
    KeyTiles t;
    t.kt = ws.Get<A>(1, pr_.H * L);
    t.vt = ws.Get<A>(2, pr_.H * L);
    t.s = ws.Get<A>(3, kRowBlock * L);
    t.dp = ws.Get<A>(4, kRowBlock * L);
    t.sq = ws.Get<A>(5, kRowBlock * pr_.H);
    t.do_rows = ws.Get<A>(6, kRowBlock * pr_.H);
    t.row_buffer = ws.Get<A>(7, pr_.H);
    t.dbias = dbias_here ? ws.Get<A>(8, rows_dbias_ * L) : nullptr;
    t.dtanh = capped_ ? ws.Get<A>(11, kRowBlock * L) : nullptr;
    return t;
  }

  void KeyItem(int64_t item, Workspace& ws) const {
    const int64_t group = item / nkb_;
    const int64_t rank = item % nkb_;
    const int64_t kb = anticausal_like_ ? nkb_ - 1 - rank : rank;
    const int64_t j0 = kb * L;
    const int64_t own = std::min<int64_t>(L, pr_.S - j0);
    const int64_t first = group_begin_[group];
    const int64_t members = group_begin_[group + 1] - first;
    const int64_t H = pr_.H, G = pr_.G;
    const bool dbias_here = mode_ == DbiasMode::kColumns;
    // One member at a time (bounded memory) unless the group's members share several dbias
    // slices (one per query head of the group): then the heads go outermost, and every
    // member keeps its accumulators meanwhile.
    const bool member_outer = !dbias_here || heads_reduced_ || G == 1;
    const int64_t live = member_outer ? 1 : members;

    A* acc = ws.Get<A>(0, live * 2 * H * L);  // per live member: dK^T then dV^T, H x L each
    KeyTiles t = WorkspaceTiles(ws, dbias_here);
    if (dbias_here) std::fill(t.dbias, t.dbias + rows_dbias_ * L, A(0));
    std::fill(acc, acc + live * 2 * H * L, A(0));

    if (member_outer) {
      for (int64_t m = 0; m < members; ++m) {
        if (m > 0) std::fill(acc, acc + 2 * H * L, A(0));
        bool packed = false;
        for (int64_t g = 0; g < G; ++g) Head(first + m, g, j0, own, acc, acc + H * L, t, &packed);
        WriteKeyGradients(first + m, j0, own, acc, acc + H * L);
      }
      if (dbias_here) {
        // One dbias slice: heads summed, or a single query head per member (G == 1).
        WriteDbiasColumns(first, heads_reduced_ ? 0 : member_kvh_[first] * G, j0, own, t.dbias);
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t m = 0; m < members; ++m) {
          A* dkt = acc + m * 2 * H * L;
          bool packed = false;
          Head(first + m, g, j0, own, dkt, dkt + H * L, t, &packed);
        }
        WriteDbiasColumns(first, member_kvh_[first] * G + g, j0, own, t.dbias);
        std::fill(t.dbias, t.dbias + rows_dbias_ * L, A(0));
      }
      for (int64_t m = 0; m < members; ++m) {
        const A* dkt = acc + m * 2 * H * L;
        WriteKeyGradients(first + m, j0, own, dkt, dkt + H * L);
      }
    }
  }

  //! Adds the contributions of query head kvh * G + g of one member (batch item, kv head) to
  //! the dK^T / dV^T accumulators of the key block [j0, j0 + own), and dS to t.dbias.
  void Head(int64_t member, int64_t g, int64_t j0, int64_t own, A* dkt, A* dvt,
            const KeyTiles& t, bool* packed) const {
    const int64_t H = pr_.H;
    const int64_t b = member_b_[member], kvh = member_kvh_[member];
    const int64_t n = kvh * pr_.G + g;
    const int64_t kv_len = SeqLen(p_.kv_seqlens, pr_.batch, b, pr_.S);
    const int64_t q_len = SeqLen(p_.q_seqlens, pr_.batch, b, pr_.T);
    const int64_t nj = std::min<int64_t>(own, kv_len - j0);
    if (nj <= 0) return;
    int64_t ilo = 0, ihi = 0;
    QueryRange(p_.options, j0, j0 + nj, q_len, &ilo, &ihi);
    IntersectSpans(p_.q_span, pr_.batch, b, j0, j0 + nj, &ilo, &ihi);
    if (ilo >= ihi) return;
    if (!*packed) {
      PackTransposed<A>(pr_, p_.k, b, j0, nj, kvh, A(1), t.row_buffer, t.kt);
      PackTransposed<A>(pr_, p_.v, b, j0, nj, kvh, A(1), t.row_buffer, t.vt);
      if (t.knat != nullptr) {
        for (int64_t j = 0; j < nj; ++j) {
          A* row = t.knat + j * padded_h_;
          ConvertRow<A>(p_.k.data, pr_.dtype, pr_.RowOffset(p_.k, b, j0 + j, kvh), H, A(1), row);
          std::fill(row + H, row + padded_h_, A(0));
        }
      }
      *packed = true;
    }
    const A scale = static_cast<A>(p_.options.scale);
    for (int64_t i0 = ilo; i0 < ihi; i0 += kRowBlock) {
      const int64_t ni = std::min<int64_t>(kRowBlock, ihi - i0);
      CopyRows<A>(pr_, p_.q, b, i0, ni, n, scale, t.sq);
      CopyRows<A>(pr_, bp_.dout, b, i0, ni, n, A(1), t.do_rows);
      LogitsKeyLanes<A>(pr_, b, n, i0, ni, j0, nj, t.sq, t.kt, t.s, t.dtanh);
      // dP = dO V^T
      Gemm<A>(t.dp, L, ni, t.do_rows, H, 1, t.vt, L, H, false);
      const A* lse = lse_.data() + RowIndex(b, n, i0);
      const A* delta = delta_.data() + RowIndex(b, n, i0);
      const A* norm = norm_.data() + RowIndex(b, n, i0);
      for (int64_t i = 0; i < ni; ++i) {
        const V row_lse = Splat<V>(lse[i]);
        const V row_delta = Splat<V>(delta[i]);
        const V row_norm = Splat<V>(norm[i]);
        A* srow = t.s + i * L;
        A* dprow = t.dp + i * L;
        for (int v = 0; v < 4; ++v) {
          const V pv = Exp(Load<V>(srow + v * W) - row_lse) * row_norm;
          Store(srow + v * W, pv);
          Store(dprow + v * W, pv * (Load<V>(dprow + v * W) - row_delta));
        }
      }
      if (t.dbias != nullptr) {
        for (int64_t i = 0; i < ni; ++i) {
          A* target = t.dbias + (rows_dbias_ == 1 ? 0 : i0 + i) * L;
          const A* dsrow = t.dp + i * L;
          for (int v = 0; v < 4; ++v) {
            Store(target + v * W, Load<V>(target + v * W) + Load<V>(dsrow + v * W));
          }
        }
      }
      if (t.row_sums != nullptr) {
        alignas(kTileAlign) A lanes[L];
        for (int64_t i = 0; i < ni; ++i) {
          const A* dsrow = t.dp + i * L;
          Store(lanes, (Load<V>(dsrow) + Load<V>(dsrow + W)) +
                           (Load<V>(dsrow + 2 * W) + Load<V>(dsrow + 3 * W)));
          A sum = A(0);
          for (int w = 0; w < W; ++w) sum += lanes[w];
          t.row_sums[i0 + i] += sum;
        }
      }
      if (t.dtanh != nullptr) MultiplyRows<A>(t.dp, t.dtanh, ni);  // dS (dbias's) -> dX
      // dV^T[d][j] += sum_i dO[i][d] P[i][j];  dK^T[d][j] += sum_i (scale Q)[i][d] dX[i][j]
      Gemm<A>(dvt, L, H, t.do_rows, 1, H, t.s, L, ni, true);
      Gemm<A>(dkt, L, H, t.sq, 1, H, t.dp, L, ni, true);
      if (t.dq != nullptr) {
        // dQ[i][d] += sum_j dX[i][j] K[j][d], kLanes columns of d at a time
        for (int64_t c = 0; c < padded_h_; c += L) {
          Gemm<A>(t.dq + i0 * padded_h_ + c, padded_h_, ni, t.dp, L, 1, t.knat + c, padded_h_,
                  nj, true);
        }
      }
    }
  }

  // ---- fused pass (no bias, enough kv heads) -------------------------------------------------

  //! All key blocks of one (batch item, kv head), in order: dK and dV as in the key pass, and
  //! dQ of the group's query heads accumulated across the key blocks in T x padded_h_ scratch.
  //! dbias: the task owns its slices (columns written per key block), or adds its per-row
  //! sums over keys to row_sums_.
  void FusedItem(int64_t member, Workspace& ws) {
    const int64_t H = pr_.H, G = pr_.G, T = pr_.T;
    const int64_t b = member_b_[member], kvh = member_kvh_[member];
    const bool dbias_here = mode_ == DbiasMode::kColumns;
    A* acc = ws.Get<A>(0, 2 * H * L);
    KeyTiles t = WorkspaceTiles(ws, dbias_here);
    t.knat = ws.Get<A>(9, L * padded_h_);
    A* dq = ws.Get<A>(10, G * T * padded_h_);
    std::fill(dq, dq + G * T * padded_h_, A(0));
    A* row_sums = mode_ == DbiasMode::kRows ? row_sums_.data() + RowIndex(b, kvh * G, 0) : nullptr;
    for (int64_t kb = 0; kb < nkb_; ++kb) {
      const int64_t j0 = kb * L;
      const int64_t own = std::min<int64_t>(L, pr_.S - j0);
      std::fill(acc, acc + 2 * H * L, A(0));
      if (dbias_here) std::fill(t.dbias, t.dbias + rows_dbias_ * L, A(0));
      bool packed = false;
      for (int64_t g = 0; g < G; ++g) {
        t.dq = dq + g * T * padded_h_;
        t.row_sums = row_sums != nullptr ? row_sums + g * T : nullptr;  // heads kvh*G.. adjacent
        Head(member, g, j0, own, acc, acc + H * L, t, &packed);
        if (dbias_here && !heads_reduced_) {
          WriteDbiasColumns(member, kvh * G + g, j0, own, t.dbias);
          std::fill(t.dbias, t.dbias + rows_dbias_ * L, A(0));
        }
      }
      if (dbias_here && heads_reduced_) WriteDbiasColumns(member, 0, j0, own, t.dbias);
      WriteKeyGradients(member, j0, own, acc, acc + H * L);
    }
    const A scale = static_cast<A>(p_.options.scale);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = kvh * G + g;
      const A* src = dq + g * T * padded_h_;
      for (int64_t i = 0; i < T; ++i) {
        const int64_t o = pr_.RowOffset(bp_.dq, b, i, n);
        for (int64_t d = 0; d < H; ++d) {
          StoreAs<A>(bp_.dq.data, bp_.dq.dtype, o + d, scale * src[i * padded_h_ + d]);
        }
      }
    }
  }

  //! dk, dv rows [j0, j0 + own) of one member from its H x L accumulators.
  void WriteKeyGradients(int64_t member, int64_t j0, int64_t own, const A* dkt,
                         const A* dvt) const {
    const int64_t b = member_b_[member], kvh = member_kvh_[member];
    for (int64_t j = 0; j < own; ++j) {
      const int64_t ko = pr_.RowOffset(bp_.dk, b, j0 + j, kvh);
      const int64_t vo = pr_.RowOffset(bp_.dv, b, j0 + j, kvh);
      for (int64_t d = 0; d < pr_.H; ++d) {
        StoreAs<A>(bp_.dk.data, bp_.dk.dtype, ko + d, dkt[d * L + j]);
        StoreAs<A>(bp_.dv.data, bp_.dv.dtype, vo + d, dvt[d * L + j]);
      }
    }
  }

  //! Writes dbias[bb, head, :, j0:j0+own] from the (rows_dbias_ x L) scratch; bb is the dbias
  //! batch item of the group's first member (the same for all members).
  void WriteDbiasColumns(int64_t first_member, int64_t head, int64_t j0, int64_t own,
                         const A* scratch) const {
    const Operand& db = bp_.dbias;
    const int64_t base = db.batch_offset(pr_.batch, member_b_[first_member]) + head * db.stride[0];
    for (int64_t i = 0; i < rows_dbias_; ++i) {
      for (int64_t j = 0; j < own; ++j) {
        StoreAs<A>(db.data, db.dtype, base + i * db.stride[1] + (j0 + j) * db.stride[2],
                   scratch[i * L + j]);
      }
    }
  }

  // ---- 2. query pass -----------------------------------------------------------------------

  void QueryItem(int64_t item, Workspace& ws) {
    const int64_t bn = item / nqb_;
    const int64_t rank = item % nqb_;
    const int64_t qb = causal_like_ ? nqb_ - 1 - rank : rank;
    const int64_t b = bn / pr_.N, n = bn % pr_.N, H = pr_.H;
    const int64_t i0 = qb * L;
    const int64_t rows = std::min<int64_t>(L, pr_.T - i0);
    const int64_t q_len = SeqLen(p_.q_seqlens, pr_.batch, b, pr_.T);
    const int64_t kv_len = SeqLen(p_.kv_seqlens, pr_.batch, b, pr_.S);
    const int64_t ni = std::clamp<int64_t>(q_len - i0, 0, rows);
    int64_t jlo = 0, jhi = 0;
    if (ni > 0) {
      KeyRange(p_.options, i0, i0 + ni, kv_len, &jlo, &jhi);
      IntersectSpans(p_.kv_span, pr_.batch, b, i0, i0 + ni, &jlo, &jhi);
    }

    A* dqt = ws.Get<A>(0, H * L);
    std::fill(dqt, dqt + H * L, A(0));
    V row_sum[4] = {};
    if (jlo < jhi) {
      A* qt = ws.Get<A>(1, H * L);
      A* dot = ws.Get<A>(2, H * L);
      A* st = ws.Get<A>(3, kKeyBlock * L);
      A* dpt = ws.Get<A>(4, kKeyBlock * L);
      A* k_rows = ws.Get<A>(5, kKeyBlock * H);
      A* v_rows = ws.Get<A>(6, kKeyBlock * H);
      A* row_buffer = ws.Get<A>(7, H);
      A* lanes = ws.Get<A>(8, 3 * L);  // lse, D and norm, per lane
      A* dtanh = capped_ ? ws.Get<A>(9, kKeyBlock * L) : nullptr;
      PackTransposed<A>(pr_, p_.q, b, i0, ni, n, static_cast<A>(p_.options.scale), row_buffer, qt);
      PackTransposed<A>(pr_, bp_.dout, b, i0, ni, n, A(1), row_buffer, dot);
      for (int64_t i = 0; i < L; ++i) {
        lanes[i] = i < ni ? lse_[RowIndex(b, n, i0 + i)] : std::numeric_limits<A>::infinity();
        lanes[L + i] = i < ni ? delta_[RowIndex(b, n, i0 + i)] : A(0);
        lanes[2 * L + i] = i < ni ? norm_[RowIndex(b, n, i0 + i)] : A(0);
      }
      const int64_t kvh = n / pr_.G;
      for (int64_t j0 = jlo; j0 < jhi; j0 += kKeyBlock) {
        const int64_t nk = std::min<int64_t>(kKeyBlock, jhi - j0);
        CopyRows<A>(pr_, p_.k, b, j0, nk, kvh, A(1), k_rows);
        CopyRows<A>(pr_, p_.v, b, j0, nk, kvh, A(1), v_rows);
        LogitsQueryLanes<A>(pr_, b, n, i0, ni, j0, nk, k_rows, H, qt, st, dtanh);
        // dP^T = V dO^T
        Gemm<A>(dpt, L, nk, v_rows, H, 1, dot, L, H, false);
        for (int64_t j = 0; j < nk; ++j) {
          A* srow = st + j * L;
          A* dprow = dpt + j * L;
          for (int v = 0; v < 4; ++v) {
            const V pv = Exp(Load<V>(srow + v * W) - Load<V>(lanes + v * W)) *
                         Load<V>(lanes + 2 * L + v * W);
            const V ds = pv * (Load<V>(dprow + v * W) - Load<V>(lanes + L + v * W));
            Store(dprow + v * W, ds);
            row_sum[v] += ds;
          }
        }
        if (dtanh != nullptr) MultiplyRows<A>(dpt, dtanh, nk);  // dS^T (dbias's) -> dX^T
        // dQ^T[d][i] += sum_j K[j][d] dX^T[j][i]
        Gemm<A>(dqt, L, H, k_rows, 1, H, dpt, L, nk, true);
      }
    }
    const A scale = static_cast<A>(p_.options.scale);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t o = pr_.RowOffset(bp_.dq, b, i0 + i, n);
      for (int64_t d = 0; d < H; ++d) {
        StoreAs<A>(bp_.dq.data, bp_.dq.dtype, o + d, i < ni ? scale * dqt[d * L + i] : A(0));
      }
    }
    if (mode_ == DbiasMode::kRows) {
      alignas(kTileAlign) A sums[L];
      for (int v = 0; v < 4; ++v) Store(sums + v * W, row_sum[v]);
      A* dst = row_sums_.data() + RowIndex(b, n, i0);
      for (int64_t i = 0; i < rows; ++i) dst[i] = i < ni ? sums[i] : A(0);
    }
  }

  //! dbias (sums over keys): reduces the per-row sums over the broadcast batch, head and row
  //! axes, in order.
  void ReduceRowSums() {
    const Operand& db = bp_.dbias;
    const BatchShape& batch = pr_.batch;
    int64_t own_items = 1;
    for (int32_t a = 0; a < batch.rank; ++a) own_items *= db.batch.stride[a] != 0 ? batch.extent[a] : 1;
    const int64_t heads = db.extent[0], rows = db.extent[1];
    std::vector<A> total(static_cast<size_t>(own_items * heads * rows), A(0));
    for (int64_t b = 0; b < pr_.nb; ++b) {
      const int64_t bb = map_batch(batch, db.batch, b);
      for (int64_t n = 0; n < pr_.N; ++n) {
        A* dst = total.data() + (bb * heads + (heads == 1 ? 0 : n)) * rows;
        const A* src = row_sums_.data() + RowIndex(b, n, 0);
        for (int64_t i = 0; i < pr_.T; ++i) dst[rows == 1 ? 0 : i] += src[i];
      }
    }
    for (int64_t bb = 0; bb < own_items; ++bb) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < rows; ++i) {
          StoreAs<A>(db.data, db.dtype, bb * db.batch_stride + h * db.stride[0] + i * db.stride[1],
                     total[(bb * heads + h) * rows + i]);
        }
      }
    }
  }

  const BackwardParams& bp_;
  const ForwardParams& p_;
  Problem pr_;
  const int64_t nqb_, nkb_;
  bool causal_like_ = false, anticausal_like_ = false;
  bool capped_ = false;  //!< soft-capping: dS is multiplied by the tanh derivative
  DbiasMode mode_ = DbiasMode::kNone;
  bool fused_ = false;
  int64_t padded_h_ = 0;  //!< H rounded up to kLanes (fused pass dQ rows)
  bool heads_reduced_ = false;
  int64_t rows_dbias_ = 0;
  std::vector<A> delta_, lse_, norm_, row_sums_;
  std::vector<int64_t> group_begin_, member_b_, member_kvh_;
};

}  // namespace

Status RunBackward(const BackwardParams& params, TaskRunner& runner) {
  try {
    if (params.dbias.present() && !params.fwd.bias.present()) {
      return Status::InvalidArgument("jax_flash: dbias needs a bias");
    }
    switch (params.fwd.shape.dtype) {
      case ElementType::kFloat64: {
        Backward<double> backward(params);
        return backward.Run(runner);
      }
      case ElementType::kFloat32:
      case ElementType::kBFloat16:
      case ElementType::kFloat16: {
        Backward<float> backward(params);
        return backward.Run(runner);
      }
      default: return Status::InvalidArgument("jax_flash: unsupported dtype for the CPU backward");
    }
  } catch (const std::exception& e) {
    return Status::Internal(std::string("jax_flash: CPU backward failed: ") + e.what());
  } catch (...) {
    return Status::Internal("jax_flash: CPU backward failed");
  }
}

}  // namespace jax_flash::cpu
