/*! \file launch_kernel.cuh
    \brief The kernel launch every Hopper launch ends with, and its error report. Light (no
           CuTe tensors), for the small kernels' units too.
*/
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "launch.h"

namespace jax_flash::sm90 {

//! Raises the kernel's dynamic shared memory limit and launches it on the context's stream.
template <class Kernel, class Params>
Status launch_kernel(Kernel kernel, dim3 grid, int threads, int smem_bytes, const Params& params,
                     const LaunchContext& context, const char* kernel_name) {
  cudaError_t err = cudaSuccess;
  if (smem_bytes > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  }
  if (err == cudaSuccess) {
    kernel<<<grid, threads, smem_bytes, context.stream>>>(params);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    return Status::Internal(std::string("jax_flash: Hopper ") + kernel_name +
                            " launch failed: " + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace jax_flash::sm90
