/*! \file attention_cpu.h
    \brief Host entry points of the CPU kernels: FlashAttention-2 forward and backward, blocked
           online softmax with float32 accumulation (float64 for float64 problems), O(T*H) extra
           memory per head. They are the reference semantics for the GPU kernels.
*/
#pragma once

#include <cstdint>
#include <functional>

#include "../common/attention_params.h"
#include "../common/status.h"

namespace jax_flash::cpu {

//! Where the kernels run their parallel work; the FFI glue adapts XLA's intra-op thread pool.
class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  //! Threads that may run scheduled tasks concurrently with the caller.
  virtual int64_t num_workers() const = 0;
  //! Runs `task` on a worker, or inline when no worker is available.
  virtual void schedule(std::function<void()> task) = 0;
};

Status RunForward(const ForwardParams& params, TaskRunner& runner);
Status RunBackward(const BackwardParams& params, TaskRunner& runner);

}  // namespace jax_flash::cpu
