/*! \file launch_bias_classes.cu
    \brief RunBiasClasses: checks the extents and launches one CTA per block of the bias.
*/
#include <cstdint>
#include <string>

#include "element_types.h"
#include "kernel_bias_classes.h"
#include "launch_kernel.cuh"

namespace jax_flash::sm90 {

template <class Element>
Status launch_bias_classes(const BiasClassesParams& p, int blocks, const LaunchContext& context) {
  // 16-byte loads where every row and every block's first column start on 16 bytes.
  constexpr int kPerVector = 16 / sizeof(Element);
  const bool vector_loads = reinterpret_cast<uintptr_t>(p.bias) % 16 == 0 &&
                            p.cols % kPerVector == 0 && p.block_cols % kPerVector == 0;
  return vector_loads
             ? launch_kernel(bias_classes_kernel<Element, true>, blocks, kBiasClassesThreads, 0,
                             p, context, "bias classes")
             : launch_kernel(bias_classes_kernel<Element, false>, blocks, kBiasClassesThreads, 0,
                             p, context, "bias classes");
}

Status RunBiasClasses(const BiasClassesParams& p, const LaunchContext& context) {
  if (p.items < 0 || p.rows < 0 || p.cols < 0 || p.block_rows < 1 || p.block_cols < 1 ||
      p.row_blocks != (p.rows + p.block_rows - 1) / p.block_rows ||
      p.col_blocks != (p.cols + p.block_cols - 1) / p.block_cols) {
    return Status::InvalidArgument("jax_flash: the bias classes need positive block sizes and "
                                   "one class per block");
  }
  const int64_t blocks = p.items * p.row_blocks * p.col_blocks;
  if (blocks == 0) return Status::Ok();
  if (blocks > (int64_t(1) << 31) - 1) {
    return Status::InvalidArgument("jax_flash: the bias has too many blocks to classify");
  }
  switch (p.dtype) {
    case ElementType::kBFloat16:
      return launch_bias_classes<CutlassElement<ElementType::kBFloat16>::type>(p, int(blocks),
                                                                                context);
    case ElementType::kFloat16:
      return launch_bias_classes<CutlassElement<ElementType::kFloat16>::type>(p, int(blocks),
                                                                               context);
    default:
      return Status::InvalidArgument("jax_flash: the bias classes take a bfloat16 or float16 "
                                     "bias (the Hopper kernels' dtypes)");
  }
}

}  // namespace jax_flash::sm90
