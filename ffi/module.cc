/*! \file module.cc
    \brief The nanobind extension: hands the FFI handlers to Python as capsules, per platform,
           and reports how the extension was built.
*/
#include <nanobind/nanobind.h>

#include <type_traits>

#include "common/ffi_glue.h"
#if defined(JAX_FLASH_WITH_CUDA)
#include "sm90/launch.h"
#endif

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBackwardCpu);
#if defined(JAX_FLASH_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashForwardMergeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBiasClassesCuda);
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Encapsulate(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict cpu;
  cpu["jax_flash_fwd"] = Encapsulate(JaxFlashForwardCpu);
  cpu["jax_flash_bwd"] = Encapsulate(JaxFlashBackwardCpu);
  nb::dict platforms;
  platforms["cpu"] = cpu;
#if defined(JAX_FLASH_WITH_CUDA)
  nb::dict cuda;
  cuda["jax_flash_fwd"] = Encapsulate(JaxFlashForwardCuda);
  cuda["jax_flash_bwd"] = Encapsulate(JaxFlashBackwardCuda);
  cuda["jax_flash_fwd_merge"] = Encapsulate(JaxFlashForwardMergeCuda);
  cuda["jax_flash_bias_classes"] = Encapsulate(JaxFlashBiasClassesCuda);
  platforms["CUDA"] = cuda;
#endif
  return platforms;
}

nb::dict BuildInfo() {
  nb::dict info;
  info["xla_ffi_api_version"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  info["jaxlib_version"] = JAX_FLASH_BUILD_JAXLIB_VERSION;
#if defined(JAX_FLASH_WITH_CUDA)
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["cuda_status"] = JAX_FLASH_BUILD_CUDA_STATUS;
  return info;
}

#if defined(JAX_FLASH_WITH_CUDA)
//! Bytes of the workspace result the Hopper backward takes for a problem of these sizes (query
//! rows, query heads, head dim over `batch` items, key rows) and a bias gradient of
//! `dbias_elements` elements (0: none).
int64_t BackwardWorkspaceBytes(int64_t batch, int64_t seqlen_q, int64_t num_heads,
                               int64_t head_dim, bool bfloat16, bool deterministic,
                               int64_t dbias_elements, int64_t seqlen_k) {
  jax_flash::BackwardParams params;
  jax_flash::AttentionShape& shape = params.fwd.shape;
  shape.batch.rank = 1;
  shape.batch.extent[0] = batch;
  shape.seqlen_q = seqlen_q;
  shape.seqlen_k = seqlen_k;
  shape.num_heads = num_heads;
  shape.num_kv_heads = 1;
  shape.head_dim = head_dim;
  shape.dtype = bfloat16 ? jax_flash::ElementType::kBFloat16 : jax_flash::ElementType::kFloat16;
  params.deterministic = deterministic;
  jax_flash::sm90::BackwardWorkspaceLayout layout;
  const jax_flash::Status status =
      jax_flash::sm90::GetBackwardWorkspaceLayout(params, dbias_elements, &layout);
  if (!status.ok()) throw nb::value_error(status.message().c_str());
  return layout.bytes;
}
#endif

}  // namespace

NB_MODULE(_jax_flash_ext, m) {
  m.doc() = "jax_flash XLA FFI handlers";
  m.def("registrations", &Registrations,
        "FFI handler capsules keyed by platform name, then by target name.");
  m.def("build_info", &BuildInfo, "How this extension was built.");
#if defined(JAX_FLASH_WITH_CUDA)
  m.def("backward_workspace_bytes", &BackwardWorkspaceBytes, nb::arg("batch"),
        nb::arg("seqlen_q"), nb::arg("num_heads"), nb::arg("head_dim"), nb::arg("bfloat16"),
        nb::arg("deterministic"), nb::arg("dbias_elements"), nb::arg("seqlen_k"),
        "Bytes of the Hopper backward's workspace result for these sizes.");
#endif
}
