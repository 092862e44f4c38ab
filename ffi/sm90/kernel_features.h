/*! \file kernel_features.h
    \brief The optional features a pass's Hopper kernels take: kernel_configs.json "features"
           and "feature_combinations", which the generated sm90_tiles.h states once per pass
           (kForwardFeatures, kBackwardFeatures) for dispatch and instantiation alike.
*/
#pragma once

namespace jax_flash::sm90 {

//! One bit per optional feature of a call; a set of them is a FeatureSet.
enum FeatureBit : unsigned {
  kSoftcapBit = 1u,
  kSegmentIdsBit = 2u,
  kMaskBit = 4u,
  kBiasBit = 8u,
};
inline constexpr unsigned kFeatureSets = 16;  //!< every subset of the four bits

struct KernelFeatures {
  //! The features taken alone.
  unsigned features = 0;
  //! The combinations of two or more features taken together (kernel_configs.json
  //! "feature_combinations"); zero entries are unused.
  unsigned combinations[kFeatureSets] = {};
  //! Features taken only beside a mask or bias array (another tile runs them without).
  unsigned only_with_arrays = 0;

  //! Whether kernels are compiled for calls that use exactly the features in `set`: none,
  //! one of `features`, or a listed combination.
  constexpr bool compiles(unsigned set) const {
    if ((set & ~features) != 0) return false;
    if ((set & only_with_arrays) != 0 && (set & (kMaskBit | kBiasBit)) == 0) return false;
    if ((set & (set - 1)) == 0) return true;  // none or one feature
    for (unsigned combination : combinations) {
      if (combination == set) return true;
    }
    return false;
  }

  //! The same without mask and bias arrays, alone or in combinations.
  constexpr KernelFeatures without_arrays() const {
    KernelFeatures result = *this;
    result.features &= ~(kMaskBit | kBiasBit);
    for (unsigned& combination : result.combinations) {
      if (combination & (kMaskBit | kBiasBit)) combination = 0;
    }
    return result;
  }

  //! The same with `bits` taken only beside a mask or bias array.
  constexpr KernelFeatures with_arrays_only(unsigned bits) const {
    KernelFeatures result = *this;
    result.only_with_arrays |= bits;
    return result;
  }
};

}  // namespace jax_flash::sm90
