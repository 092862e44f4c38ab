/*! \file element_types.h
    \brief The CUTLASS element type of each 16-bit input type, and the one accumulation type of
           every product. Light (no CuTe tensors), for the small kernels' units too.
*/
#pragma once

#include <cutlass/numeric_types.h>

#include "../common/attention_params.h"

namespace jax_flash::sm90 {

//! Every product accumulates in float32, whatever the 16-bit input type.
using ElementAccum = float;

template <ElementType kDtype>
struct CutlassElement;
template <>
struct CutlassElement<ElementType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<ElementType::kFloat16> {
  using type = cutlass::half_t;
};

}  // namespace jax_flash::sm90
