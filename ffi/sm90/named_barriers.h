/*! \file named_barriers.h
    \brief Hardware named barriers of the Hopper kernels. IDs are offsets past the ones CUTLASS
           reserves (cutlass::arch::NamedBarrier adds that offset); each kernel has its own set.
*/
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

enum class ForwardBarrier : uint32_t {
  //! + storing group (epilogue_fwd.h): its previous store finished reading its output tile, and
  //! then its threads wrote their O rows there
  kOutputFirst = 0,
  kWarpGroupTurnFirst = 3,  //!< + consumer warpgroup index: that warpgroup may issue its GEMMs
  //! Consumers: every warpgroup's GEMMs of the tile are complete, so the K/V stage or the Q tile
  //! that they read may take the output (kernel_traits_fwd.h, kOwnOutputTiles)
  kOutputBorrowed = 6,
};

enum class BackwardBarrier : uint32_t {
  kPdS = 0,            //!< MMA warpgroups: P^T / dS^T of this step are in shared memory
  kDqEmptyFirst = 1,   //!< + MMA warpgroup: its dQ staging buffer may be written
  kDqFullFirst = 3,    //!< + MMA warpgroup: its dQ staging buffer holds a partial sum
  kEpilogue = 5,       //!< MMA warpgroups: done with K and V / dK and dV tiles written
};

}  // namespace jax_flash::sm90
