/*! \file named_barriers.h
    \brief Hardware named barriers of the Hopper kernels. IDs are offsets past the ones CUTLASS
           reserves (cutlass::arch::NamedBarrier adds that offset); each kernel has its own set.
*/
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace jax_flash::sm90 {

//! The named barriers a kernel may use past CUTLASS's reserved ones.
inline constexpr uint32_t kUserNamedBarriers =
    cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers -
    cutlass::arch::NamedBarrier::ReservedNamedBarrierCount;

//! The forward's barriers, laid out by its number of consumer warpgroups: each warpgroup's
//! output store and GEMM-issue turn, the borrowed output buffer, and with kSoftmaxTurns each
//! warpgroup's softmax turn (three warpgroups leave no room for those).
template <int kConsumerWarpGroups, bool kSoftmaxTurns>
struct ForwardBarriers {
  //! + storing group (epilogue_fwd.h): its previous store finished reading its output tile, and
  //! then its threads wrote their O rows there
  static constexpr uint32_t kOutputFirst = 0;
  //! + consumer warpgroup index: that warpgroup may issue its GEMMs
  static constexpr uint32_t kWarpGroupTurnFirst = kOutputFirst + kConsumerWarpGroups;
  //! Consumers: every warpgroup's GEMMs of the tile are complete, so the K/V stage or the Q tile
  //! that they read may take the output (kernel_traits_fwd.h, kOwnOutputTiles)
  static constexpr uint32_t kOutputBorrowed = kWarpGroupTurnFirst + kConsumerWarpGroups;
  //! + consumer warpgroup index: that warpgroup may run its softmax step
  static constexpr uint32_t kSoftmaxTurnFirst = kOutputBorrowed + 1;
  static_assert(kSoftmaxTurnFirst + (kSoftmaxTurns ? kConsumerWarpGroups : 0) <=
                    kUserNamedBarriers,
                "the forward's named barriers exceed the hardware's");
};

enum class BackwardBarrier : uint32_t {
  kPdS = 0,            //!< MMA warpgroups: P^T / dS^T of this step are in shared memory
  kDqEmptyFirst = 1,   //!< + MMA warpgroup: its dQ staging buffer may be written
  kDqFullFirst = 3,    //!< + MMA warpgroup: its dQ staging buffer holds a partial sum
  kEpilogue = 5,       //!< MMA warpgroups: done with K and V / dK and dV tiles written
};

}  // namespace jax_flash::sm90
