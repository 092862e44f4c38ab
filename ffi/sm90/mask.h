/*! \file mask.h
    \brief Per-element masking of one S = Q K^T block in registers: keys past the key length and
           outside the window become -inf. Query rows past the query length are left alone; the
           softmax finalisation zeroes them.
*/
#pragma once

#include <cute/tensor.hpp>

#include "block_info.h"
#include "utils.h"

namespace jax_flash::sm90 {

using namespace cute;

template <int kBlockM, int kBlockN, class TiledMma>
struct ForwardMask {
  int thread_idx;

  CUTE_DEVICE explicit ForwardMask(int thread_idx_) : thread_idx(thread_idx_) {}

  //! Masks the rowcol view `s` of key block `n_block`.
  template <class TensorS>
  CUTE_DEVICE void apply(TensorS& s, BlockInfo<kBlockM, kBlockN> const& info,
                         ForwardProblem const& p, int n_block) const {
    // Block-relative (row, col) of every element this thread holds; folds to constants plus
    // the thread's offset.
    auto tScS = TiledMma{}.get_thread_slice(thread_idx).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    auto coords = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));
    // Bounds are taken relative to the thread's first column, so each comparison is against a
    // compile-time column step: no register per column (which made head dim 64 spill).
    const int thread_col = get<1>(coords(0, 0));
    const int col_offset = n_block * kBlockN + thread_col;
    const int col_limit = info.kv_len - col_offset;  // columns >= this are past the keys
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int row = info.m_start() + get<0>(coords(r, 0));
      int col_begin = -thread_col, col_end = col_limit;
      if (p.window_right >= 0) col_end = min(col_end, row + p.window_right + 1 - col_offset);
      if (p.window_left >= 0) col_begin = row - p.window_left - col_offset;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int col_step = get<1>(coords(0, c)) - thread_col;  // a constant after folding
        if (col_step < col_begin || col_step >= col_end) s(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace jax_flash::sm90
