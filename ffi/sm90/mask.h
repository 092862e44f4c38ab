/*! \file mask.h
    \brief Per-element work on one logits block held in WGMMA accumulators, in either operand
           orientation: rows are queries (forward, S = Q K^T) or keys (backward, S^T = K Q^T):
           masking by lengths and windows, by segment ids and by a mask array (invisible pairs
           become -inf, so their probabilities are exactly 0), the addition of a bias array and
           of the logits' gradients into the bias's.
*/
#pragma once

#include <cute/tensor.hpp>

#include "seqlen.h"
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

//! The visibility rule of block_range.h seen from the rows of a block: column `col` of row
//! `row` is visible iff row < row_limit, col < col_limit and, where bounded (>= 0),
//! row - lower <= col <= row + upper. With keys as rows the two lengths and the two window
//! sides swap roles.
struct RowVisibility {
  int32_t row_limit, col_limit;
  int32_t lower, upper;  //!< -1: unbounded

  template <bool kRowsAreKeys>
  CUTE_DEVICE static RowVisibility of(AttentionProblem const& p, SeqLengths const& lens) {
    if constexpr (kRowsAreKeys) {
      return {lens.kv_len, lens.q_len, p.window_right, p.window_left};
    } else {
      return {lens.q_len, lens.kv_len, p.window_left, p.window_right};
    }
  }
};

//! The segment arrays of one batch item seen from the rows of a block, with RowVisibility's
//! roles: the rows' spans and ids, the columns' ids. Read only for blocks that need them.
template <bool kRowsAreKeys>
struct SegmentAxes {
  AttentionProblem const& p;
  int32_t batch;

  CUTE_DEVICE const int32_t* row_spans() const {
    return (kRowsAreKeys ? p.segments.q_span : p.segments.kv_span).of(p.batch, batch);
  }
  CUTE_DEVICE const int32_t* row_ids() const {
    return (kRowsAreKeys ? p.segments.kv_ids : p.segments.q_ids).of(p.batch, batch);
  }
  CUTE_DEVICE const int32_t* col_ids() const {
    return (kRowsAreKeys ? p.segments.q_ids : p.segments.kv_ids).of(p.batch, batch);
  }
  CUTE_DEVICE int row_extent() const { return kRowsAreKeys ? p.seqlen_k : p.seqlen_q; }
  CUTE_DEVICE int col_extent() const { return kRowsAreKeys ? p.seqlen_q : p.seqlen_k; }
};

template <int kRows, int kCols, class TiledMma>
struct BlockMask {
  int thread_idx;

  CUTE_DEVICE explicit BlockMask(int thread_idx_) : thread_idx(thread_idx_) {}

  //! Block-relative (row, col) of every element this thread holds, in the rowcol view of its
  //! accumulator; folds to constants plus the thread's offset.
  CUTE_DEVICE auto coordinates() const {
    auto tScS = TiledMma{}.get_thread_slice(thread_idx).partition_C(
        make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
    return make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));
  }

  //! Masks the rowcol view `s` of the block whose first row and column are row_start and
  //! col_start. With `row_spans` (the batch item's exact segment spans along the rows, see
  //! attention_params.h), also the columns outside each row's span: they hold other ids.
  //! Each element costs a comparison per side that can cut the block and a select: a block cut
  //! on one side only (causal rows, or lengths, in either pass) takes the loop that compares
  //! that side alone.
  template <class TensorS>
  CUTE_DEVICE void apply(TensorS& s, RowVisibility const& vis, int row_start, int col_start,
                         const int32_t* row_spans = nullptr) const {
    const bool cut_before = vis.lower >= 0 || row_spans != nullptr;
    const bool cut_after = vis.upper >= 0 || row_spans != nullptr ||
                           col_start + kCols > vis.col_limit || row_start + kRows > vis.row_limit;
    if (cut_before && cut_after) {
      apply_sides<true, true>(s, vis, row_start, col_start, row_spans);
    } else if (cut_after) {
      apply_sides<false, true>(s, vis, row_start, col_start, row_spans);
    } else if (cut_before) {
      apply_sides<true, false>(s, vis, row_start, col_start, row_spans);
    }
  }

  //! apply, comparing the columns against the rows' first visible one where kBefore and
  //! against their end where kAfter.
  template <bool kBefore, bool kAfter, class TensorS>
  CUTE_DEVICE void apply_sides(TensorS& s, RowVisibility const& vis, int row_start,
                               int col_start, const int32_t* row_spans) const {
    auto coords = coordinates();
    // Bounds are taken relative to the thread's first column, so each comparison is against a
    // compile-time column step: no register per column.
    const int thread_col = get<1>(coords(0, 0));
    const int col_offset = col_start + thread_col;
    const int col_limit = vis.col_limit - col_offset;  // columns >= this are past the limit
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int row = row_start + get<0>(coords(r, 0));
      int col_begin = -thread_col;
      int col_end = row < vis.row_limit ? col_limit : 0;  // a row past its limit sees nothing
      if (vis.upper >= 0) col_end = min(col_end, row + vis.upper + 1 - col_offset);
      if (vis.lower >= 0) col_begin = row - vis.lower - col_offset;
      if (row_spans != nullptr && row < vis.row_limit) {
        const int2 span = *reinterpret_cast<const int2*>(row_spans + 2 * row);
        col_begin = max(col_begin, span.x - col_offset);
        col_end = min(col_end, span.y - col_offset);
      }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int col_step = get<1>(coords(0, c)) - thread_col;  // a constant after folding
        if ((kBefore && col_step < col_begin) || (kAfter && col_step >= col_end)) {
          s(r, c) = -INFINITY;
        }
      }
    }
  }

  //! Whether segment ids cut the block whose first column is col_start: unless `reach` says
  //! that every column of it (up to the visible ones) shares every row's segment.
  template <class Reach>
  CUTE_DEVICE static bool cuts_by_segments(RowVisibility const& vis, Reach const& reach,
                                           int col_start) {
    return !reach.every_covers(col_start, min(col_start + kCols, vis.col_limit));
  }

  //! Masks one block, whose first row and column are row_start and col_start: by lengths and
  //! windows where `cut_by_window` (BlockRange::needs_mask), and by segment ids unless `reach`
  //! (a SegmentReach over the rows, or NoSegmentReach) says that every column of the block
  //! shares every row's segment. Blocks that need neither are left alone; returns whether
  //! the block needed either.
  template <bool kRowsAreKeys, class TensorS, class Reach>
  CUTE_DEVICE bool apply_block(TensorS& s, RowVisibility const& vis, bool cut_by_window,
                               Reach const& reach, SegmentAxes<kRowsAreKeys> const& segments,
                               int row_start, int col_start) const {
    const bool cut_by_segments = cuts_by_segments(vis, reach, col_start);
    if (!cut_by_segments && !cut_by_window) return false;
    apply(s, vis, row_start, col_start,
          cut_by_segments && reach.exact ? segments.row_spans() : nullptr);
    if (cut_by_segments && !reach.exact) {
      apply_segment_ids(s, segments.row_ids(), row_start, segments.row_extent(),
                        segments.col_ids(), col_start, segments.col_extent());
    }
    return true;
  }

  //! Masks the pairs of a partial block that a mask array drops, from its rows' bits (see
  //! MaskArray): `bits` holds row 0 of the (batch item, head), row_stride words apart (0: one
  //! row for all), words_per_row words each.
  //! Rows at or past row_limit are not read (their pairs are dropped with the rows in the
  //! forward and masked by lengths in the backward); columns past the last word read as
  //! dropped (lengths mask them too).
  template <class TensorS>
  CUTE_DEVICE void apply_mask_array(TensorS& s, const uint32_t* bits, int row_stride,
                                    int words_per_row, int row_start, int row_limit,
                                    int col_start) const {
    auto coords = coordinates();
    // The bits from the thread's first column on, realigned (funnel shifts) so that each
    // column step, a compile-time constant after folding, reads a fixed bit of a register.
    constexpr int kWords = (kCols + 31) / 32;
    const int thread_col = get<1>(coords(0, 0));
    const int first = col_start + thread_col;
    const int first_word = first >> 5;
    const int shift = first & 31;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int row = row_start + get<0>(coords(r, 0));
      if (row >= row_limit) continue;
      const uint32_t* row_bits = bits + int64_t(row) * row_stride;
      uint32_t raw[kWords + 1];
      CUTE_UNROLL
      for (int i = 0; i <= kWords; ++i) {
        raw[i] = first_word + i < words_per_row ? __ldg(row_bits + first_word + i) : 0u;
      }
      uint32_t kept[kWords];
      CUTE_UNROLL
      for (int i = 0; i < kWords; ++i) kept[i] = __funnelshift_r(raw[i], raw[i + 1], shift);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int step = get<1>(coords(0, c)) - thread_col;
        if (((kept[step >> 5] >> (step & 31)) & 1u) == 0) s(r, c) = -INFINITY;
      }
    }
  }

  //! Calls visit(r, c, address) for each element (r, c) of the thread's part of the block
  //! (rowcol view `coords`) that lies before row_limit and col_limit, address pointing into the
  //! array whose element (row 0, column 0) is `origin`, with strides row_step and col_step. Each
  //! row's address advances by the column steps of the accumulator layout (compile-time
  //! constants times col_step), with no per-element multiplication; a block that lies wholly
  //! inside the limits (the usual case) skips the per-element bounds tests.
  template <class Coords, class T, class Visit>
  CUTE_DEVICE static void for_each_element(Coords const& coords, T* origin, int64_t row_step,
                                           int64_t col_step, int row_start, int row_limit,
                                           int col_start, int col_limit, Visit&& visit) {
    constexpr int kThreadRows = decltype(size<0>(coords))::value;
    constexpr int kThreadCols = decltype(size<1>(coords))::value;
    const int thread_col = get<1>(coords(0, 0));
    const int first = col_start + thread_col;
    auto walk = [&](auto checked) {
      CUTE_UNROLL
      for (int r = 0; r < kThreadRows; ++r) {
        const int row = row_start + get<0>(coords(r, 0));
        if (checked && row >= row_limit) continue;
        T* address = origin + row * row_step + first * col_step;
        int previous = 0;
        CUTE_UNROLL
        for (int c = 0; c < kThreadCols; ++c) {
          const int step = get<1>(coords(0, c)) - thread_col;  // a constant after folding
          address += (step - previous) * col_step;
          previous = step;
          if (!checked || first + step < col_limit) visit(r, c, address);
        }
      }
    };
    if (row_start + kRows <= row_limit && col_start + kCols <= col_limit) {
      walk(std::false_type{});
    } else {
      walk(std::true_type{});
    }
  }

  //! Adds a bias array to the block, times `units` (the logits' units: 1 / scale for raw
  //! products, which the mainloops scale afterwards; log2 e for capped logits; negated, it
  //! takes the bias back out). A bias past the float range becomes +-inf, which acts as a
  //! mask.
  //! `bias` is element (row 0, column 0) of the (batch item, head), row_step and col_step its
  //! strides along the block's rows and columns (queries and keys forward, swapped backward).
  //! Rows at or past row_limit and columns at or past col_limit are not read: they lie past
  //! the sequences, and lengths mask them. With `paired` (BiasArray), two adjacent columns
  //! are read as one 32-bit word.
  template <class TensorS, class Element>
  CUTE_DEVICE void add_bias(TensorS& s, const Element* bias, int64_t row_step, int64_t col_step,
                            bool paired, float units, int row_start, int row_limit,
                            int col_start, int col_limit) const {
    auto coords = coordinates();
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(bias);
    auto element = [](uint16_t bits) { return float(Element::bitcast(bits)); };
    const int thread_col = get<1>(coords(0, 0));
    const int first = col_start + thread_col;
    if (paired && col_start + kCols <= col_limit) {
      // Columns come in adjacent pairs (steps 2i, 2i + 1 of the accumulator layout).
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        const int row = row_start + get<0>(coords(r, 0));
        if (row >= row_limit) continue;
        const uint16_t* row_bias = raw + row * row_step + first;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); c += 2) {
          const int step = get<1>(coords(0, c)) - thread_col;
          const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(row_bias + step));
          s(r, c) = fmaf(element(uint16_t(word & 0xffffu)), units, s(r, c));
          s(r, c + 1) = fmaf(element(uint16_t(word >> 16)), units, s(r, c + 1));
        }
      }
      return;
    }
    for_each_element(coords, raw, row_step, col_step, row_start, row_limit, col_start, col_limit,
                     [&](int r, int c, const uint16_t* address) {
                       s(r, c) = fmaf(element(__ldg(address)), units, s(r, c));
                     });
  }

  //! Adds the block's logit gradients (rowcol view `ds`) into a float32 bias gradient (see
  //! BiasGradient) that keeps the columns (col_step != 0; one summed over the columns is
  //! gathered by add_row_sums instead): `dbias` is element (row 0, column 0) of the (batch item,
  //! head), row_step and col_step its strides along the block's rows and columns. Where it sums
  //! over the rows (row_step 0) they are summed in registers and across lanes first, so that
  //! one atomic addition per column and warp reaches memory: in a WGMMA accumulator, lanes that
  //! differ in their three high bits hold other rows of the same columns. Rows at or past
  //! row_limit and columns at or past col_limit lie past the sequences (past dbias) and are
  //! left out.
  template <class TensorS>
  CUTE_DEVICE void add_bias_gradient(TensorS const& ds, float* dbias, int64_t row_step,
                                     int64_t col_step, int row_start, int row_limit,
                                     int col_start, int col_limit) const {
    auto coords = coordinates();
    if (row_step == 1 && col_step % 4 == 0 && row_start % 4 == 0 && row_limit % 4 == 0 &&
        reinterpret_cast<uintptr_t>(dbias) % 16 == 0) {
      add_bias_gradient_in_quads(ds, dbias, col_step, row_start, row_limit, col_start,
                                 col_limit);
      return;
    }
    if (row_step != 0) {
      for_each_element(coords, dbias, row_step, col_step, row_start, row_limit, col_start,
                       col_limit, [&](int r, int c, float* address) { atomicAdd(address, ds(r, c)); });
      return;
    }
    CUTE_UNROLL
    for (int c = 0; c < decltype(size<1>(ds))::value; ++c) {
      const int col = col_start + get<1>(coords(0, c));
      float sum = 0.f;
      CUTE_UNROLL
      for (int r = 0; r < decltype(size<0>(ds))::value; ++r) {
        if (row_start + get<0>(coords(r, 0)) < row_limit) sum += ds(r, c);
      }
      for (int x = 4; x <= 16; x *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
      if (thread_idx % 32 < 4 && col < col_limit) atomicAdd(dbias + col * col_step, sum);
    }
  }

  //! add_bias_gradient where the rows are contiguous in dbias and come in aligned quads (row
  //! step 1; column step, first row and row limit multiples of 4; dbias 16-byte aligned): one
  //! 16-byte vector addition per four rows instead of four atomic additions, a quarter of the
  //! operations the L2 serialises on the shared addresses. In a WGMMA accumulator a lane holds
  //! rows k and k + 8 (rowcol rows 2m and 2m + 1) of two adjacent columns, and lanes l, l ^ 4,
  //! l ^ 8, l ^ 12 (rows k ^ 1, k ^ 2, k ^ 3) the rest of its row quad: two rounds of
  //! shuffles transpose those 4 x 4 values so that each lane holds one quad of one column.
  template <class TensorS>
  CUTE_DEVICE void add_bias_gradient_in_quads(TensorS const& ds, float* dbias, int64_t col_step,
                                              int row_start, int row_limit, int col_start,
                                              int col_limit) const {
    auto coords = coordinates();
    const int lane = thread_idx % 32;
    const bool bit0 = (lane >> 2) & 1;  // row bit 0 within the quad; after the transpose, the column
    const bool bit1 = (lane >> 3) & 1;  // row bit 1; after the transpose, the half (row + 8)
    CUTE_UNROLL
    for (int m = 0; m < decltype(size<0>(ds))::value / 2; ++m) {
      // This lane's row of the pair; its quad starts bit0 + 2 * bit1 rows above.
      const int quad_row = row_start + get<0>(coords(2 * m, 0)) - ((lane >> 2) & 3);
      const int row = quad_row + 8 * bit1;
      CUTE_UNROLL
      for (int j = 0; j < decltype(size<1>(ds))::value / 2; ++j) {
        // x[h][b]: half h (row + 8h), column 2j + b.
        float x[2][2] = {{ds(2 * m, 2 * j), ds(2 * m, 2 * j + 1)},
                         {ds(2 * m + 1, 2 * j), ds(2 * m + 1, 2 * j + 1)}};
        // Round 1 swaps the row's bit 0 with the column: lane l ^ 4 takes the other column.
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const float got = __shfl_xor_sync(0xffffffffu, bit0 ? x[h][0] : x[h][1], 4);
          if (bit0) {
            x[h][0] = got;
          } else {
            x[h][1] = got;
          }
        }
        // Round 2 swaps the row's bit 1 with the half: lane l ^ 8 takes the other half.
        CUTE_UNROLL
        for (int b = 0; b < 2; ++b) {
          const float got = __shfl_xor_sync(0xffffffffu, bit1 ? x[0][b] : x[1][b], 8);
          if (bit1) {
            x[0][b] = got;
          } else {
            x[1][b] = got;
          }
        }
        // Now x[i1][i0] is row quad_row + 8 * bit1 + (2 * i1 + i0) of column 2j + bit0.
        const int col = col_start + get<1>(coords(0, 2 * j + int(bit0)));
        if (row < row_limit && col < col_limit) {
          float* address = dbias + row + col * col_step;
          asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address),
                       "f"(x[0][0]), "f"(x[0][1]), "f"(x[1][0]), "f"(x[1][1])
                       : "memory");
        }
      }
    }
  }

  //! Stores the block's logit gradients (rowcol view `ds`), rounded to Element, into a bias
  //! gradient with an element per logit (BiasGradient::direct), addressed as in
  //! add_bias_gradient.
  template <class TensorS, class Element>
  CUTE_DEVICE void store_bias_gradient(TensorS const& ds, Element* dbias, int64_t row_step,
                                       int64_t col_step, int row_start, int row_limit,
                                       int col_start, int col_limit) const {
    for_each_element(coordinates(), dbias, row_step, col_step, row_start, row_limit, col_start,
                     col_limit,
                     [&](int r, int c, Element* address) { *address = Element(ds(r, c)); });
  }

  //! For a bias gradient summed over the columns: adds the block's logit gradients (rowcol view
  //! `ds`) of each of the thread's rows, over its columns before col_limit, into `sums`, which
  //! the caller keeps over every block of the same rows (one addition to memory per row then,
  //! add_row_sums_to, instead of one per block).
  template <class TensorS, size_t kThreadRows>
  CUTE_DEVICE void add_row_sums(TensorS const& ds, cute::array<float, kThreadRows>& sums,
                                int col_start, int col_limit) const {
    auto coords = coordinates();
    const bool whole = col_start + kCols <= col_limit;
    CUTE_UNROLL
    for (int r = 0; r < int(kThreadRows); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < decltype(size<1>(ds))::value; ++c) {
        if (whole || col_start + get<1>(coords(0, c)) < col_limit) sums[r] += ds(r, c);
      }
    }
  }

  //! Adds the row sums of add_row_sums into the bias gradient: `dbias` is element (row 0,
  //! column 0) of the (batch item, head), row_step its stride along the rows (0: one element
  //! for every row). The sums are gathered across lanes first (in a WGMMA accumulator, lanes
  //! that differ in their two low bits hold other columns of the same rows, in their three high
  //! bits other rows), so that one atomic addition per element of dbias and warp reaches
  //! memory. Rows at or past row_limit lie past the sequence and are left out.
  template <size_t kThreadRows>
  CUTE_DEVICE void add_row_sums_to(cute::array<float, kThreadRows> const& sums, float* dbias,
                                   int64_t row_step, int row_start, int row_limit) const {
    auto coords = coordinates();
    const int lane = thread_idx % 32;
    auto sum_lanes = [](float value, int first_xor, int last_xor) {
      for (int x = first_xor; x <= last_xor; x *= 2) value += __shfl_xor_sync(0xffffffffu, value, x);
      return value;
    };
    if (row_step != 0) {
      CUTE_UNROLL
      for (int r = 0; r < int(kThreadRows); ++r) {
        const int row = row_start + get<0>(coords(r, 0));
        const float sum = sum_lanes(sums[r], 1, 2);
        if (lane % 4 == 0 && row < row_limit) atomicAdd(dbias + row * row_step, sum);
      }
      return;
    }
    float sum = 0.f;
    CUTE_UNROLL
    for (int r = 0; r < int(kThreadRows); ++r) {
      if (row_start + get<0>(coords(r, 0)) < row_limit) sum += sums[r];
    }
    sum = sum_lanes(sum, 1, 16);
    if (lane == 0) atomicAdd(dbias, sum);
  }

  //! Asks L1 for the bias lines of the block that add_bias (same arguments) will read, so that
  //! their loads, issued once the block's logits are complete, do not wait on L2.
  template <class Element>
  CUTE_DEVICE void prefetch_bias(const Element* bias, int64_t row_step, int64_t col_step,
                                 int row_start, int row_limit, int col_start,
                                 int col_limit) const {
    auto coords = coordinates();
    constexpr int kLineElements = 128 / int(sizeof(Element));
    const int thread_col = get<1>(coords(0, 0));
    const int first = col_start + thread_col;
    auto prefetch = [](const Element* address) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(address));
    };
    CUTE_UNROLL
    for (int r = 0; r < decltype(size<0>(coords))::value; ++r) {
      const int row = row_start + get<0>(coords(r, 0));
      if (row >= row_limit) continue;
      const Element* row_bias = bias + row * row_step + first * col_step;
      if (col_step <= 1) {
        // The row's columns are contiguous (or one element): a line per 128 bytes.
        CUTE_UNROLL
        for (int line = 0; line * kLineElements < kCols; ++line) {
          if (col_step == 1 || line == 0) prefetch(row_bias + line * kLineElements);
        }
      } else if (r == 0) {
        // Each column is its own line; the thread's other rows are a few elements away.
        CUTE_UNROLL
        for (int c = 0; c < decltype(size<1>(coords))::value; ++c) {
          const int step = get<1>(coords(0, c)) - thread_col;
          if (first + step < col_limit) prefetch(row_bias + step * col_step);
        }
      }
    }
  }

  //! Masks the pairs of the block whose segment ids differ, comparing them pair by pair: for
  //! spans that are not exact (ids not ordered; exact ones go through `apply`). row_ids and
  //! col_ids are the batch item's ids along each axis, read below row_limit and col_limit
  //! (the sequence extents; positions past them are masked by `apply`'s lengths).
  template <class TensorS>
  CUTE_DEVICE void apply_segment_ids(TensorS& s, const int32_t* row_ids, int row_start,
                                     int row_limit, const int32_t* col_ids, int col_start,
                                     int col_limit) const {
    auto coords = coordinates();
    constexpr int kThreadRows = decltype(size<0>(s))::value;
    int32_t row_id[kThreadRows];
    CUTE_UNROLL
    for (int r = 0; r < kThreadRows; ++r) {
      const int row = row_start + get<0>(coords(r, 0));
      row_id[r] = row < row_limit ? __ldg(row_ids + row) : 0;
    }
    // Column ids a few at a time: the compiler barrier keeps it from loading all of them ahead
    // (a register each) while the block's accumulators are live.
    constexpr int kColumnsPerGroup = 4;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      if (c % kColumnsPerGroup == 0) asm volatile("" ::: "memory");
      const int col = col_start + get<1>(coords(0, c));
      const int32_t col_id = col < col_limit ? __ldg(col_ids + col) : 0;
      CUTE_UNROLL
      for (int r = 0; r < kThreadRows; ++r) {
        if (row_id[r] != col_id) s(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace jax_flash::sm90
