/*! \file launch.h
    \brief Host entry points of the Hopper kernels. Plain C++ (no CuTe), so the FFI handlers are
           compiled by the host compiler; the kernel templates are instantiated in generated
           translation units, one per (head dim tile, dtype).
*/
#pragma once

#include <cuda_runtime_api.h>

#include "../common/attention_params.h"
#include "../common/status.h"

namespace jax_flash::sm90 {

//! What a launch needs to know about its device and stream.
struct LaunchContext {
  cudaStream_t stream = nullptr;
  int device = 0;
  int sm_count = 0;
  int l2_bytes = 0;
};

//! Runs the forward on the smallest compiled tile whose head dim covers the problem's.
//! Validates what the kernels require (dtype, head dim, alignment) and reports CUDA errors.
Status RunForward(const ForwardParams& params, const LaunchContext& context);

//! One compiled forward configuration; defined in launch_fwd.cuh, instantiated per tile.
template <ElementType kDtype, int kTileHeadDim>
Status RunForwardTile(const ForwardParams& params, const LaunchContext& context);

}  // namespace jax_flash::sm90
