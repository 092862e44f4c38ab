/*! \file tile_schedule.cu
    \brief make_schedule: the host's choice of the tile walk (sections of heads, block order) for
           the persistent forward and the backward. Host code only, in a unit of its own so that
           the kernels' instantiation units do not each compile it.
*/
#include <algorithm>
#include <cstdint>
#include <string>

#include "launch_common.cuh"

namespace jax_flash::sm90 {

Status make_schedule(int64_t num_blocks, int64_t num_heads, int64_t num_heads_total,
                     int64_t bytes_per_head, bool heads_within_a_wave, bool reverse_blocks,
                     bool balance_sections, bool items_adjacent, const LaunchContext& context,
                     const char* kernel_name, TileSchedulerParams* sched) {
  const int64_t num_tiles = num_heads_total * num_blocks;
  if (num_tiles > INT32_MAX - 2 * int64_t(context.sm_count)) {
    return Status::InvalidArgument(std::string("jax_flash: too many blocks x heads x batch (") +
                                   std::to_string(num_tiles) + ") for the Hopper " +
                                   kernel_name + " kernel");
  }
  sched->num_blocks = int32_t(num_blocks);
  sched->num_heads_total = int32_t(num_heads_total);
  sched->num_tiles = int32_t(num_tiles);
  sched->reverse_blocks = reverse_blocks;
  const int64_t heads = std::max<int64_t>(num_heads, 1);
  sched->inner_extent = int32_t(items_adjacent ? num_heads_total / heads : heads);
  sched->items_adjacent = items_adjacent;
  int64_t heads_per_section = (int64_t(context.l2_bytes) / 2) / std::max<int64_t>(bytes_per_head, 1);
  if (heads_within_a_wave) {
    heads_per_section = std::min<int64_t>(heads_per_section, context.sm_count / num_blocks);
  }
  if (balance_sections) {
    // A persistent grid deals its tiles statically, and longest first then balances the CTAs
    // only over a section several rounds long: one shorter than a round deals the long blocks
    // to the same CTAs round after round. Sections may therefore
    // grow past L2 up to a quarter of the grid in heads: a round then still runs four or more
    // CTAs per head side by side, on blocks of about the same length, reading the same data
    // together.
    heads_per_section = std::max<int64_t>(heads_per_section, context.sm_count / 4);
  }
  sched->heads_per_section = int32_t(std::clamp<int64_t>(heads_per_section, 1, num_heads_total));
  return Status::Ok();
}

}  // namespace jax_flash::sm90
