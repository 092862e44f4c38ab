/*! \file handlers_cuda.cc
    \brief The "CUDA" platform FFI handler of the forward pass: validate, build parameters,
           launch the Hopper kernel on XLA's stream. Host compiler only.
*/
#include <cuda_runtime_api.h>

#include <array>
#include <mutex>
#include <string>

#include "../common/ffi_glue.h"
#include "launch.h"

namespace jax_flash {
namespace {

//! Device properties the launches need, read once per device.
Status GetLaunchContext(cudaStream_t stream, int32_t device, sm90::LaunchContext* context) {
  struct DeviceInfo {
    std::once_flag once;
    Status status;
    int sm_count = 0;
    int l2_bytes = 0;
  };
  static std::array<DeviceInfo, 64> devices;
  if (device < 0 || device >= static_cast<int32_t>(devices.size())) {
    return Status::InvalidArgument("jax_flash: unsupported CUDA device ordinal " +
                                   std::to_string(device));
  }
  DeviceInfo& info = devices[device];
  std::call_once(info.once, [&] {
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&info.l2_bytes, cudaDevAttrL2CacheSize, device);
    if (err != cudaSuccess) {
      info.status = Status::Internal(std::string("jax_flash: cannot query CUDA device: ") +
                                     cudaGetErrorString(err));
    } else if (major != 9 || minor != 0) {
      info.status = Status::InvalidArgument(
          "jax_flash: the CUDA kernels are built for Hopper (sm_90a); device " +
          std::to_string(device) + " has compute capability " + std::to_string(major) + "." +
          std::to_string(minor));
    }
  });
  if (!info.status.ok()) return info.status;
  context->stream = stream;
  context->device = device;
  context->sm_count = info.sm_count;
  context->l2_bytes = info.l2_bytes;
  return Status::Ok();
}

ffi::Error ForwardCuda(cudaStream_t stream, int32_t device, AttentionAttrs attrs, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::RemainingArgs optional_args,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse) {
  ForwardParams params;
  Status status = MakeForwardParams(attrs, q, k, v, optional_args, out, lse, &params);
  sm90::LaunchContext context;
  if (status.ok()) status = GetLaunchContext(stream, device, &context);
  if (status.ok()) status = sm90::RunForward(params, context);
  return ToFfiError(status);
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardCuda, jax_flash::ForwardCuda,
                              jax_flash::BindForward(xla::ffi::Ffi::Bind()
                                                         .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                         .Ctx<xla::ffi::DeviceOrdinal>()));
