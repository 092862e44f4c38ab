/*! \file launch_fwd_merge.cu
    \brief RunForwardMerge: checks the merge's extents and launches a group of threads per
           (item, merged row, kMergeColumns columns), its shape chosen by the number of parts.
*/
#include <algorithm>
#include <climits>
#include <string>

#include "element_types.h"
#include "kernel_fwd_merge.h"
#include "launch_kernel.cuh"

namespace jax_flash::sm90 {

namespace {

//! Rows of one item: T * K * G.
int64_t merged_rows(const ForwardMergeParams& p) {
  return int64_t(p.query_rows) * p.kv_heads * p.group;
}

//! The most items one launch takes (the grid's y); more take several launches.
constexpr int64_t kMaxLaunchItems = 65535;

template <class Element, class Shape>
Status launch_merge_shape(const ForwardMergeParams& p, const LaunchContext& context) {
  const int64_t rows = merged_rows(p);
  const int64_t item_threads = rows * (p.head_dim / kMergeColumns) * Shape::lanes;
  // Blocks of one warp at least, and no more threads than an item has.
  const int64_t rule_threads =
      (p.items * item_threads + kMergeThreads - 1) / kMergeThreads < context.sm_count
          ? kMergeFewThreads
          : kMergeThreads;
  const int block_threads = int(std::min(rule_threads, (item_threads + 31) / 32 * 32));
  const unsigned item_blocks = unsigned((item_threads + block_threads - 1) / block_threads);
  const auto kernel =
      p.group > 1         ? forward_merge_kernel<Element, Shape, MergeLayout::kRows>
      : p.query_rows == 1 ? forward_merge_kernel<Element, Shape, MergeLayout::kCallOneRow>
                          : forward_merge_kernel<Element, Shape, MergeLayout::kCall>;
  ForwardMergeKernelParams kp;
  kp.column_groups = cutlass::FastDivmod(p.head_dim / kMergeColumns);
  kp.heads = cutlass::FastDivmod(p.kv_heads * p.group);
  kp.group = cutlass::FastDivmod(p.group);
  for (int64_t first = 0; first < p.items; first += kMaxLaunchItems) {
    kp.merge = p;
    kp.merge.items = std::min(p.items - first, kMaxLaunchItems);
    kp.merge.out_parts += first * p.parts * rows * p.head_dim;
    kp.merge.lse_parts += first * p.parts * rows;
    kp.merge.out = static_cast<Element*>(p.out) + first * rows * p.head_dim;
    kp.merge.lse += first * rows;
    const Status status = launch_kernel(kernel, dim3(item_blocks, unsigned(kp.merge.items)),
                                        block_threads, 0, kp, context, "forward merge");
    if (!status.ok()) return status;
  }
  return Status::Ok();
}

//! The merge's shape by its number of parts: each lane's parts in one round of loads up to 64
//! parts. On an H200, 16 parts (16-bit then) merged in 1.9 us in groups of 4 lanes, in 2.5 us with
//! one lane per row; groups of 8 lanes were no faster there and slower at 2 parts
//! (bench/RESULTS.md).
template <ElementType kDtype>
Status launch_forward_merge(const ForwardMergeParams& p, const LaunchContext& context) {
  using Element = typename CutlassElement<kDtype>::type;
  if (p.parts <= 2) return launch_merge_shape<Element, MergeShape<1, 2>>(p, context);
  if (p.parts <= 4) return launch_merge_shape<Element, MergeShape<1, 4>>(p, context);
  if (p.parts <= 8) return launch_merge_shape<Element, MergeShape<2, 4>>(p, context);
  if (p.parts <= 16) return launch_merge_shape<Element, MergeShape<4, 4>>(p, context);
  if (p.parts <= 32) return launch_merge_shape<Element, MergeShape<4, 8>>(p, context);
  return launch_merge_shape<Element, MergeShape<4, 16>>(p, context);
}

}  // namespace

Status RunForwardMerge(const ForwardMergeParams& p, const LaunchContext& context) {
  if (p.items < 0 || p.parts < 1 || p.query_rows < 0 || p.kv_heads < 0 || p.group < 1 ||
      p.head_dim < 1) {
    return Status::InvalidArgument("jax_flash: the forward merge needs at least one part, one "
                                   "query head per key/value head and a positive head dim");
  }
  if (p.head_dim % kMergeColumns != 0) {
    return Status::InvalidArgument("jax_flash: the forward merge takes head dims that are "
                                   "multiples of " + std::to_string(kMergeColumns) +
                                   ", got " + std::to_string(p.head_dim));
  }
  // The kernel indexes one item's parts, rows and threads in 32-bit integers.
  const int64_t rows = merged_rows(p);
  if (rows * p.parts > INT32_MAX ||
      rows * (p.head_dim / kMergeColumns) * kMergeMaxLanes + kMergeThreads > INT32_MAX) {
    return Status::InvalidArgument("jax_flash: the forward merge has too many rows");
  }
  if (p.items * rows == 0) return Status::Ok();
  switch (p.dtype) {
    case ElementType::kBFloat16: return launch_forward_merge<ElementType::kBFloat16>(p, context);
    case ElementType::kFloat16: return launch_forward_merge<ElementType::kFloat16>(p, context);
    default:
      return Status::InvalidArgument("jax_flash: the forward merge takes bfloat16 and float16 "
                                     "outputs");
  }
}

}  // namespace jax_flash::sm90
