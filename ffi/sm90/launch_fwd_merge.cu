/*! \file launch_fwd_merge.cu
    \brief RunForwardMerge: checks the merge's extents and launches a group of threads per
           (item, merged row, kMergeColumns columns), its shape chosen by the number of parts.
*/
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

template <class Element, class Shape>
Status launch_merge_shape(const ForwardMergeParams& p, const LaunchContext& context) {
  const int64_t threads = p.items * merged_rows(p) * (p.head_dim / kMergeColumns) * Shape::lanes;
  const int block_threads =
      (threads + kMergeThreads - 1) / kMergeThreads < context.sm_count ? kMergeFewThreads
                                                                        : kMergeThreads;
  const int blocks = int((threads + block_threads - 1) / block_threads);
  const auto launch = [&](auto kernel) {
    return launch_kernel(kernel, blocks, block_threads, 0, p, context, "forward merge");
  };
  if (p.group > 1) return launch(forward_merge_kernel<Element, Shape, MergeLayout::kRows>);
  return p.query_rows == 1
             ? launch(forward_merge_kernel<Element, Shape, MergeLayout::kCallOneRow>)
             : launch(forward_merge_kernel<Element, Shape, MergeLayout::kCall>);
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
  // The kernel indexes one item's parts and rows in 32-bit integers, and its grid in blocks.
  constexpr int64_t kMaxBlocks = (int64_t(1) << 31) - 1;
  const int64_t rows = merged_rows(p);
  if (rows * p.parts > INT32_MAX ||
      (p.items * rows * (p.head_dim / kMergeColumns) * kMergeMaxLanes + kMergeThreads - 1) /
              kMergeThreads >
          kMaxBlocks) {
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
