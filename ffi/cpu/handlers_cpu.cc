/*! \file handlers_cpu.cc
    \brief The "cpu" platform FFI handlers: validate, build parameters, run the CPU kernels.
*/
#include <utility>

#include "../common/ffi_glue.h"
#include "attention_cpu.h"

namespace jax_flash {
namespace {

class XlaTaskRunner final : public cpu::TaskRunner {
 public:
  explicit XlaTaskRunner(ffi::ThreadPool pool) : pool_(std::move(pool)) {}
  int64_t num_workers() const override { return pool_.num_threads(); }
  void schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  mutable ffi::ThreadPool pool_;
};

//! The CPU kernels read a mask array itself: one given only as the Hopper kernels' block
//! classes and bits is refused, not dropped.
Status CheckMaskForm(const ForwardParams& p) {
  if (p.mask_bits.present()) {
    return Status::InvalidArgument("jax_flash: the CPU kernels take the mask array itself, not "
                                   "its block classes and bits (mask_blocks, mask_bits)");
  }
  return Status::Ok();
}

ffi::Error ForwardCpu(ffi::ThreadPool pool, AttentionAttrs attrs, ffi::AnyBuffer q,
                      ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::RemainingArgs optional_args,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse) {
  ForwardParams params;
  Status status = MakeForwardParams(attrs, q, k, v, optional_args, out, lse, &params);
  if (status.ok()) status = CheckMaskForm(params);
  if (!status.ok()) return ToFfiError(status);
  XlaTaskRunner runner(std::move(pool));
  return ToFfiError(cpu::RunForward(params, runner));
}

ffi::Error BackwardCpu(ffi::ThreadPool pool, AttentionAttrs attrs, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                       ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::RemainingArgs optional_args,
                       ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                       ffi::Result<ffi::AnyBuffer> dv, ffi::RemainingRets optional_rets) {
  BackwardParams params;
  Status status = MakeBackwardParams(attrs, q, k, v, out, lse, dout, dlse, optional_args, dq, dk,
                                     dv, optional_rets, /*platform_rets=*/0, &params);
  if (status.ok()) status = CheckMaskForm(params.fwd);
  if (!status.ok()) return ToFfiError(status);
  XlaTaskRunner runner(std::move(pool));
  return ToFfiError(cpu::RunBackward(params, runner));
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardCpu, jax_flash::ForwardCpu,
                              jax_flash::BindForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBackwardCpu, jax_flash::BackwardCpu,
                              jax_flash::BindBackward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
