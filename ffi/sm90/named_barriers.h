/*! \file named_barriers.h
    \brief Hardware named barriers used among the consumer warpgroups. IDs are offsets past the
           ones CUTLASS reserves (cutlass::arch::NamedBarrier adds that offset).
*/
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

enum class ForwardBarrier : uint32_t {
  kOutputReady = 0,       //!< all consumers wrote their O rows to shared memory
  kOutputFree = 1,        //!< the previous block's output store finished reading shared memory
  kWarpGroupTurnFirst = 2,  //!< + consumer warpgroup index: that warpgroup may issue its GEMMs
};

}  // namespace jax_flash::sm90
