/*! \file handlers_cuda.cc
    \brief The "CUDA" platform FFI handlers of both passes, of the merge of a split forward
           and of a bias's block classes: validate, build parameters, launch the Hopper
           kernels on XLA's stream. The backward's workspace arrives as its last result
           (allocated by XLA like a temporary). Host compiler only.
*/
#include <cuda_runtime_api.h>

#include <array>
#include <climits>
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

ffi::Error BackwardCuda(cudaStream_t stream, int32_t device, AttentionAttrs attrs, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::RemainingArgs optional_args,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::RemainingRets optional_rets) {
  BackwardParams params;
  Status status = MakeBackwardParams(attrs, q, k, v, out, lse, dout, dlse, optional_args, dq, dk,
                                     dv, optional_rets, /*platform_rets=*/1, &params);
  sm90::LaunchContext context;
  if (status.ok()) status = GetLaunchContext(stream, device, &context);
  sm90::BackwardWorkspaceLayout layout;
  if (status.ok()) status = sm90::GetBackwardWorkspaceLayout(params, &layout);
  void* workspace = nullptr;
  if (status.ok()) {
    // The workspace is the last result: XLA allocates it with the call's other buffers.
    auto buffer = optional_rets.get<ffi::AnyBuffer>(optional_rets.size() - 1);
    if (!buffer.has_value()) {
      status = Status::InvalidArgument("jax_flash: cannot decode the backward workspace");
    } else if (int64_t((*buffer)->size_bytes()) < layout.bytes) {
      status = Status::InvalidArgument(
          "jax_flash: the backward workspace has " + std::to_string((*buffer)->size_bytes()) +
          " bytes, the Hopper backward needs " + std::to_string(layout.bytes));
    } else {
      workspace = (*buffer)->untyped_data();
    }
  }
  if (status.ok()) status = sm90::RunBackward(params, layout, workspace, context);
  return ToFfiError(status);
}

ffi::Error ForwardMergeCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer out_parts,
                            ffi::AnyBuffer lse_parts, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> lse) {
  ForwardMergeOperands m;
  Status status = DescribeForwardMerge(out_parts, lse_parts, out, lse, &m);
  sm90::LaunchContext context;
  if (status.ok()) status = GetLaunchContext(stream, device, &context);
  if (status.ok() && (m.parts > INT32_MAX || m.query_rows > INT32_MAX ||
                      m.kv_heads > INT32_MAX || m.group > INT32_MAX ||
                      m.head_dim > INT32_MAX)) {
    status = Status::InvalidArgument("jax_flash: the forward merge's extents exceed int32");
  }
  if (status.ok()) {
    sm90::ForwardMergeParams params;
    params.out_parts = static_cast<const float*>(m.out_parts.data);
    params.lse_parts = static_cast<const float*>(m.lse_parts.data);
    params.out = m.out.data;
    params.lse = static_cast<float*>(m.lse.data);
    params.items = m.items;
    params.parts = int32_t(m.parts);
    params.query_rows = int32_t(m.query_rows);
    params.kv_heads = int32_t(m.kv_heads);
    params.group = int32_t(m.group);
    params.head_dim = int32_t(m.head_dim);
    params.dtype = m.out.dtype;
    status = sm90::RunForwardMerge(params, context);
  }
  return ToFfiError(status);
}

ffi::Error BiasClassesCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer bias,
                           int64_t block_m, int64_t block_n, float drops_at, float row_holds,
                           ffi::Result<ffi::AnyBuffer> classes) {
  BiasClassesOperands c;
  Status status = DescribeBiasClasses(bias, classes, block_m, block_n, &c);
  sm90::LaunchContext context;
  if (status.ok()) status = GetLaunchContext(stream, device, &context);
  if (status.ok() && (c.rows > INT32_MAX || c.cols > INT32_MAX || c.block_rows > INT32_MAX ||
                      c.block_cols > INT32_MAX)) {
    status = Status::InvalidArgument("jax_flash: the bias's extents exceed int32");
  }
  if (status.ok()) {
    sm90::BiasClassesParams params;
    params.bias = c.bias;
    params.classes = static_cast<int8_t*>(c.classes);
    params.items = c.items;
    params.rows = int32_t(c.rows);
    params.cols = int32_t(c.cols);
    params.block_rows = int32_t(c.block_rows);
    params.block_cols = int32_t(c.block_cols);
    params.row_blocks = int32_t(c.row_blocks);
    params.col_blocks = int32_t(c.col_blocks);
    params.drops_at = drops_at;
    params.row_holds = row_holds;
    params.dtype = c.dtype;
    status = sm90::RunBiasClasses(params, context);
  }
  return ToFfiError(status);
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardCuda, jax_flash::ForwardCuda,
                              jax_flash::BindForward(xla::ffi::Ffi::Bind()
                                                         .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                         .Ctx<xla::ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBackwardCuda, jax_flash::BackwardCuda,
                              jax_flash::BindBackward(xla::ffi::Ffi::Bind()
                                                          .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                          .Ctx<xla::ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardMergeCuda, jax_flash::ForwardMergeCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()   // out_parts
                                  .Arg<xla::ffi::AnyBuffer>()   // lse_parts
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBiasClassesCuda, jax_flash::BiasClassesCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()  // bias
                                  .Attr<int64_t>("block_m")
                                  .Attr<int64_t>("block_n")
                                  .Attr<float>("drops_at")
                                  .Attr<float>("row_holds")
                                  .Ret<xla::ffi::AnyBuffer>());  // classes
