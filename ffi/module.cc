/*! \file module.cc
    \brief The nanobind extension: hands the FFI handlers to Python as capsules, per platform,
           and reports how the extension was built.
*/
#include <nanobind/nanobind.h>

#include <type_traits>

#include "common/ffi_glue.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBackwardCpu);
#if defined(JAX_FLASH_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashForwardCuda);
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
  // The GPU backward runs through jax_flash's blockwise path until a Hopper backward exists.
  cuda["jax_flash_fwd"] = Encapsulate(JaxFlashForwardCuda);
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
  return info;
}

}  // namespace

NB_MODULE(_jax_flash_ext, m) {
  m.doc() = "jax_flash XLA FFI handlers";
  m.def("registrations", &Registrations,
        "FFI handler capsules keyed by platform name, then by target name.");
  m.def("build_info", &BuildInfo, "How this extension was built.");
}
