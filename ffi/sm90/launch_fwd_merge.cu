/*! \file launch_fwd_merge.cu
    \brief RunForwardMerge: checks the merge's extents and launches one warp per (item, row).
*/
#include <climits>
#include <string>

#include "element_types.h"
#include "kernel_fwd_merge.h"
#include "launch_kernel.cuh"

namespace jax_flash::sm90 {

namespace {

template <ElementType kDtype>
Status launch_forward_merge(const ForwardMergeParams& p, const LaunchContext& context) {
  using Element = typename CutlassElement<kDtype>::type;
  constexpr int kWarpsPerBlock = kMergeThreads / 32;
  const int64_t blocks = (p.items * p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return launch_kernel(forward_merge_kernel<Element>, int(blocks), kMergeThreads, 0, p, context,
                       "forward merge");
}

}  // namespace

Status RunForwardMerge(const ForwardMergeParams& p, const LaunchContext& context) {
  if (p.items < 0 || p.parts < 1 || p.rows < 0 || p.head_dim < 1) {
    return Status::InvalidArgument("jax_flash: the forward merge needs at least one part and a "
                                   "positive head dim");
  }
  if (p.head_dim % kMergeColumnsPerLoad != 0) {
    return Status::InvalidArgument("jax_flash: the forward merge takes head dims that are "
                                   "multiples of " + std::to_string(kMergeColumnsPerLoad) +
                                   ", got " + std::to_string(p.head_dim));
  }
  // The kernel indexes one item's parts and rows in 32-bit integers, and its grid in blocks.
  constexpr int64_t kMaxBlocks = (int64_t(1) << 31) - 1;
  if (int64_t(p.parts) * p.rows > INT32_MAX ||
      (p.items * p.rows + kMergeThreads / 32 - 1) / (kMergeThreads / 32) > kMaxBlocks) {
    return Status::InvalidArgument("jax_flash: the forward merge has too many rows");
  }
  if (p.items * p.rows == 0) return Status::Ok();
  switch (p.dtype) {
    case ElementType::kBFloat16: return launch_forward_merge<ElementType::kBFloat16>(p, context);
    case ElementType::kFloat16: return launch_forward_merge<ElementType::kFloat16>(p, context);
    default:
      return Status::InvalidArgument("jax_flash: the forward merge takes bfloat16 and float16 "
                                     "outputs");
  }
}

}  // namespace jax_flash::sm90
