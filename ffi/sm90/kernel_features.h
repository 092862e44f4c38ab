/*! \file kernel_features.h
    \brief The optional features a pass's Hopper kernels take: kernel_configs.json "features"
           and "feature_combinations", which the generated sm90_tiles.h states once per pass
           (kForwardFeatures, kBackwardFeatures) for dispatch and instantiation alike.
*/
#pragma once

namespace jax_flash::sm90 {

struct KernelFeatures {
  bool softcap = false;
  bool segment_ids = false;
  bool mask = false;
  bool bias = false;
  bool softcap_with_segment_ids = false;
  bool softcap_with_mask = false;

  //! The same without mask and bias arrays.
  constexpr KernelFeatures without_arrays() const {
    KernelFeatures features = *this;
    features.mask = features.bias = features.softcap_with_mask = false;
    return features;
  }
};

}  // namespace jax_flash::sm90
