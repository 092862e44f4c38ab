/*! \file tiles_cpu.h
    \brief Tile-level steps shared by the forward and the backward: operand views, packing of
           query-side tiles, logits tiles with bias and visibility applied.

    Logits are computed identically in every pass: the query row is multiplied by the scale
    when it is packed (rounded to the accumulation type), the dot product runs over the head
    dimension in the micro-kernel's chunks (kSumChunk terms, one fused multiply-add each),
    then the soft-cap is applied (one out-of-line routine, SoftCapRows) and the bias is added
    after. The backward therefore recomputes exactly the forward's logits. Entries invisible
    under the window, the mask or the segment ids become -inf last.
*/
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels_cpu.h"

namespace jax_flash::cpu {

template <typename A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();

//! Sizes of one call plus accessors for the (batch..., rows, heads, H) operands.
struct Problem {
  explicit Problem(const ForwardParams& params)
      : p(params),
        batch(params.shape.batch),
        T(params.shape.seqlen_q),
        S(params.shape.seqlen_k),
        N(params.shape.num_heads),
        K(params.shape.num_kv_heads),
        H(params.shape.head_dim),
        G(params.shape.num_heads / params.shape.num_kv_heads),
        nb(params.shape.batch.count()),
        dtype(params.shape.dtype) {}

  //! Offset of element (row, head, 0) of batch item b of a (batch..., rows, heads, H) operand.
  int64_t RowOffset(const Operand& op, int64_t b, int64_t row, int64_t head) const {
    return op.batch_offset(batch, b) + row * op.stride[0] + head * op.stride[1];
  }
  //! Offset of element (head, row) of batch item b of a (batch..., heads, rows) operand.
  int64_t HeadRowOffset(const Operand& op, int64_t b, int64_t head, int64_t row) const {
    return op.batch_offset(batch, b) + head * op.stride[0] + row * op.stride[1];
  }
  //! Offset of element (head, i, j) of a bias/mask-shaped operand (strides 0 where broadcast).
  int64_t LogitOffset(const Operand& op, int64_t b, int64_t head, int64_t i, int64_t j) const {
    return op.batch_offset(batch, b) + head * op.stride[0] + i * op.stride[1] + j * op.stride[2];
  }
  //! Segment ids of batch item b indexed by row (their rows are contiguous, or a single row),
  //! or nullptr without segment ids.
  const int32_t* SegmentIds(const Operand& ids, int64_t b) const {
    if (!ids.present()) return nullptr;
    return static_cast<const int32_t*>(ids.data) + ids.batch_offset(batch, b);
  }

  const ForwardParams& p;
  const BatchShape& batch;
  const int64_t T, S, N, K, H, G, nb;
  const ElementType dtype;
};

//! Converted, scaled copy of rows [row0, row0 + rows) of head `head` of a (batch..., rows,
//! heads, H) operand: `rows` x H, row stride H. Tiles are copied even when the operand already
//! has the accumulation type: contiguous rows keep the broadcasts of the micro-kernel in few
//! pages and clear of cache-set aliasing (row strides of K*H elements are often multiples of
//! 4 KiB), for the price of one pass over the rows.
template <typename A>
void CopyRows(const Problem& pr, const Operand& op, int64_t b, int64_t row0, int64_t rows,
              int64_t head, A scale, A* dst) {
  const int64_t base = pr.RowOffset(op, b, row0, head);
  for (int64_t r = 0; r < rows; ++r) {
    ConvertRow<A>(op.data, pr.dtype, base + r * op.stride[0], pr.H, scale, dst + r * pr.H);
  }
}

//! tile[d][i] = scale * op[row0 + i, head, d] for i < rows, 0 for rows <= i < kLanes:
//! an H x kLanes tile with the rows on the lanes.
template <typename A>
void PackTransposed(const Problem& pr, const Operand& op, int64_t b, int64_t row0, int64_t rows,
                    int64_t head, A scale, A* row_buffer, A* tile) {
  constexpr int64_t L = kLanes<A>;
  const int64_t H = pr.H;
  const int64_t base = pr.RowOffset(op, b, row0, head);
  for (int64_t i = 0; i < rows; ++i) {
    ConvertRow<A>(op.data, pr.dtype, base + i * op.stride[0], H, scale, row_buffer);
    for (int64_t d = 0; d < H; ++d) tile[d * L + i] = row_buffer[d];
  }
  if (rows < L) {
    for (int64_t d = 0; d < H; ++d) {
      for (int64_t i = rows; i < L; ++i) tile[d * L + i] = A(0);
    }
  }
}

//! The soft-cap rounded to the accumulation type, 0 when off. A positive cap below A's
//! smallest normal number becomes that number, so that 1 / cap stays finite.
template <typename A>
A SoftCap(const Problem& pr) {
  const double cap = pr.p.options.softcap;
  if (!(cap > 0)) return A(0);
  return std::max(static_cast<A>(cap), std::numeric_limits<A>::min());
}

//! Soft-caps rows [0, rows) of a logits tile right after its product (see SoftCapRows).
template <typename A>
inline void CapLogits(const Problem& pr, A* tile, int64_t rows, A* dtanh) {
  const A cap = SoftCap<A>(pr);
  if (cap > A(0)) SoftCapRows<A>(tile, rows, cap, dtanh);
}

//! tile[r][:] *= factors[r][:] for rows r < rows of kLanes elements (the backward's dS times
//! the derivative of the soft-cap).
template <typename A>
inline void MultiplyRows(A* tile, const A* factors, int64_t rows) {
  using V = VecOf<A>;
  constexpr int W = Simd<A>::kWidth;
  for (int64_t o = 0; o < rows * kLanes<A>; o += W) {
    Store(tile + o, Load<V>(tile + o) * Load<V>(factors + o));
  }
}

//! Sets the lanes of one tile row outside [lo, hi] to -inf.
template <typename A>
inline void KeepLanes(A* row, int64_t lo, int64_t hi) {
  constexpr int64_t L = kLanes<A>;
  for (int64_t t = 0; t < L; ++t) row[t] = (t < lo || t > hi) ? kNegInf<A> : row[t];
}

//! Segment ids: sets tile[r][t] (r < rows, row stride kLanes) to -inf where row_ids[r] differs
//! from lane_ids[t], for the lanes t < lanes; the lanes past them (padding or junk) may become
//! -inf too. The lane ids are gathered once into vectors, and a tile whose rows and lanes all
//! share one id is left alone.
template <typename A>
void KeepSameSegment(A* tile, int64_t rows, const int32_t* row_ids, const int32_t* lane_ids,
                     int64_t lanes) {
  using V = VecOf<A>;
  using I = typename Simd<A>::Int;
  using IV = typename Simd<A>::IVec;
  constexpr int64_t L = kLanes<A>;
  constexpr int W = Simd<A>::kWidth;
  if (rows <= 0 || lanes <= 0) return;
  const int32_t first = lane_ids[0];
  alignas(kTileAlign) I ids[L];
  bool uniform = true;
  for (int64_t t = 0; t < L; ++t) {
    ids[t] = t < lanes ? lane_ids[t] : first;
    uniform = uniform && ids[t] == first;
  }
  for (int64_t r = 0; uniform && r < rows; ++r) uniform = row_ids[r] == first;
  if (uniform) return;
  IV lane[4];
  for (int v = 0; v < 4; ++v) lane[v] = Load<IV>(ids + v * W);
  const V neg_inf = Splat<V>(kNegInf<A>);
  for (int64_t r = 0; r < rows; ++r) {
    A* row = tile + r * L;
    const IV id = Splat<IV>(static_cast<I>(row_ids[r]));
    for (int v = 0; v < 4; ++v) {
      Store(row + v * W, lane[v] == id ? Load<V>(row + v * W) : neg_inf);
    }
  }
}

//! Logits tile with the queries on the lanes: st[j][i] for keys j0 + j (j < nk) and queries
//! i0 + i (i < ni live rows; other lanes hold finite junk that no result reads). The key
//! rows come from `k_rows` (row stride k_stride) and the scaled queries from the packed qt.
//! The soft-cap applies, then the bias is added; invisible entries (window, mask, segment ids)
//! become -inf. Keys past kv_len must not be in [j0, j0 + nk). Under soft-capping, `dtanh`
//! (nk x kLanes, or nullptr) receives 1 - tanh^2 of each entry; it is left alone otherwise.
template <typename A>
void LogitsQueryLanes(const Problem& pr, int64_t b, int64_t n, int64_t i0, int64_t ni, int64_t j0,
                      int64_t nk, const A* k_rows, int64_t k_stride, const A* qt, A* st,
                      A* dtanh = nullptr) {
  constexpr int64_t L = kLanes<A>;
  const ForwardParams& p = pr.p;
  Gemm<A>(st, L, nk, k_rows, k_stride, 1, qt, L, pr.H, false);
  CapLogits<A>(pr, st, nk, dtanh);
  if (p.bias.present()) {
    for (int64_t i = 0; i < ni; ++i) {
      AddBias<A>(p.bias.data, p.bias.dtype, pr.LogitOffset(p.bias, b, n, i0 + i, j0),
                 p.bias.stride[2], nk, st + i, L);
    }
  }
  const AttentionOptions& o = pr.p.options;
  if (WindowCutsBlock(o, i0, i0 + ni, j0, j0 + nk)) {
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t key = j0 + j;  // visible to rows key - right <= i <= key + left
      const int64_t lo = o.window_right >= 0 ? key - o.window_right - i0 : 0;
      const int64_t hi = o.window_left >= 0 ? key + o.window_left - i0 : L;
      KeepLanes<A>(st + j * L, lo, hi);
    }
  }
  if (p.mask.present()) {
    const bool* mask = static_cast<const bool*>(p.mask.data);
    const int64_t ms = p.mask.stride[2];
    for (int64_t i = 0; i < ni; ++i) {
      const bool* row = mask + pr.LogitOffset(p.mask, b, n, i0 + i, j0);
      for (int64_t j = 0; j < nk; ++j) {
        if (!row[j * ms]) st[j * L + i] = kNegInf<A>;
      }
    }
  }
  if (p.q_segment_ids.present()) {
    KeepSameSegment<A>(st, nk, pr.SegmentIds(p.kv_segment_ids, b) + j0,
                       pr.SegmentIds(p.q_segment_ids, b) + i0, ni);
  }
}

//! Logits tile with the keys on the lanes: s[i][j] for queries i0 + i (i < ni) and keys
//! j0 + j (j < nj live lanes; lanes nj.. are -inf). `q_rows` are the scaled query rows
//! (row stride H), kt the packed H x kLanes key tile. Soft-cap, bias and visibility as in
//! LogitsQueryLanes; `dtanh` is ni x kLanes.
template <typename A>
void LogitsKeyLanes(const Problem& pr, int64_t b, int64_t n, int64_t i0, int64_t ni, int64_t j0,
                    int64_t nj, const A* q_rows, const A* kt, A* s, A* dtanh = nullptr) {
  constexpr int64_t L = kLanes<A>;
  const ForwardParams& p = pr.p;
  Gemm<A>(s, L, ni, q_rows, pr.H, 1, kt, L, pr.H, false);
  CapLogits<A>(pr, s, ni, dtanh);
  if (p.bias.present()) {
    for (int64_t i = 0; i < ni; ++i) {
      AddBias<A>(p.bias.data, p.bias.dtype, pr.LogitOffset(p.bias, b, n, i0 + i, j0),
                 p.bias.stride[2], nj, s + i * L, 1);
    }
  }
  const AttentionOptions& o = pr.p.options;
  if (nj < L || WindowCutsBlock(o, i0, i0 + ni, j0, j0 + nj)) {
    for (int64_t i = 0; i < ni; ++i) {
      const int64_t row = i0 + i;  // sees keys row - left <= j <= row + right
      const int64_t lo = o.window_left >= 0 ? row - o.window_left - j0 : 0;
      int64_t hi = o.window_right >= 0 ? row + o.window_right - j0 : L;
      hi = std::min<int64_t>(hi, nj - 1);
      KeepLanes<A>(s + i * L, lo, hi);
    }
  }
  if (p.mask.present()) {
    const bool* mask = static_cast<const bool*>(p.mask.data);
    const int64_t ms = p.mask.stride[2];
    for (int64_t i = 0; i < ni; ++i) {
      const bool* row = mask + pr.LogitOffset(p.mask, b, n, i0 + i, j0);
      A* srow = s + i * L;
      for (int64_t j = 0; j < nj; ++j) {
        if (!row[j * ms]) srow[j] = kNegInf<A>;
      }
    }
  }
  if (p.q_segment_ids.present()) {
    KeepSameSegment<A>(s, ni, pr.SegmentIds(p.q_segment_ids, b) + i0,
                       pr.SegmentIds(p.kv_segment_ids, b) + j0, nj);
  }
}

}  // namespace jax_flash::cpu
