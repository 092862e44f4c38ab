/*! \file ffi_glue.cc
    \brief Buffer validation and parameter construction for the FFI handlers. The Python layer
           validates first and raises at trace time; these checks are the second line, so that
           a malformed call returns an ffi::Error instead of reading out of bounds.
*/
#include "ffi_glue.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace jax_flash {
namespace {

// Messages are built from std::string and std::to_string only: with an std::ostringstream
// here, a shape error segfaulted the process under jaxlib 0.11.2 (CPU and CUDA handlers alike;
// most likely the stream's locale machinery bound to the C++ library jaxlib brings along)
// instead of returning the error.
std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string text = "(";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + (dims.size() == 1 ? ",)" : ")");
}

bool ToElementType(ffi::DataType dtype, ElementType* out) {
  switch (dtype) {
    case ffi::DataType::F64: *out = ElementType::kFloat64; return true;
    case ffi::DataType::F32: *out = ElementType::kFloat32; return true;
    case ffi::DataType::BF16: *out = ElementType::kBFloat16; return true;
    case ffi::DataType::F16: *out = ElementType::kFloat16; return true;
    case ffi::DataType::PRED: *out = ElementType::kBool; return true;
    case ffi::DataType::S32: *out = ElementType::kInt32; return true;
    case ffi::DataType::S8: *out = ElementType::kInt8; return true;
    case ffi::DataType::U32: *out = ElementType::kUInt32; return true;
    default: return false;
  }
}

bool IsFloating(ElementType t) {
  return t == ElementType::kFloat64 || t == ElementType::kFloat32 || t == ElementType::kBFloat16 ||
         t == ElementType::kFloat16;
}

//! How the non-batch axes of a buffer are checked against the expected extents.
enum class InnerCheck {
  kExact,          //!< every axis equals the expected extent
  kExactOrOne,     //!< every axis equals the expected extent or 1 (broadcast)
};

//! How the batch axes of a buffer relate to the problem's batch shape.
enum class BatchCheck {
  kFull,         //!< equal to the problem's batch shape (results that are not reduced)
  kFullOrOne,    //!< each axis equal or 1 (operands broadcast; reduced results sum over it)
};

struct BufferView {
  ffi::DataType dtype;
  ffi::Span<const int64_t> dims;
  void* data;
};

BufferView ViewOf(const ffi::AnyBuffer& buffer) {
  return {buffer.element_type(), buffer.dimensions(), buffer.untyped_data()};
}

//! Checks one buffer and describes it as an Operand. `inner` holds the expected extents of the
//! buffer's own trailing axes; the leading axes must match `batch` as `batch_check` says.
Status Describe(const char* name, const BufferView& view, const BatchShape& batch,
                std::initializer_list<int64_t> inner, InnerCheck inner_check,
                BatchCheck batch_check, Operand* operand) {
  const int inner_rank = static_cast<int>(inner.size());
  const int rank = static_cast<int>(view.dims.size());
  if (rank != batch.rank + inner_rank) {
    return Status::InvalidArgument(std::string("jax_flash: ") + name + " must have rank " +
                                   std::to_string(batch.rank + inner_rank) + ", got shape " +
                                   DimsToString(view.dims));
  }
  if (!ToElementType(view.dtype, &operand->dtype)) {
    return Status::InvalidArgument(std::string("jax_flash: ") + name +
                                   " has unsupported XLA dtype id " +
                                   std::to_string(static_cast<int>(view.dtype)));
  }
  for (int i = 0; i < batch.rank; ++i) {
    const int64_t extent = view.dims[i];
    const bool ok = extent == batch.extent[i] ||
                    (batch_check == BatchCheck::kFullOrOne && extent == 1);
    if (!ok) {
      return Status::InvalidArgument(std::string("jax_flash: ") + name + " batch axis " +
                                     std::to_string(i) + " has extent " + std::to_string(extent) +
                                     ", expected " + std::to_string(batch.extent[i]) +
                                     (batch_check == BatchCheck::kFullOrOne ? " or 1" : "") +
                                     " (shape " + DimsToString(view.dims) + ")");
    }
  }
  // Batch map: strides in own batch items, 0 on broadcast axes.
  int64_t item_stride = 1;
  for (int i = batch.rank - 1; i >= 0; --i) {
    const int64_t extent = view.dims[i];
    operand->batch.stride[i] = (extent == 1) ? 0 : item_stride;
    item_stride *= extent;
  }
  int64_t element_stride = 1;
  const int64_t* expected = inner.begin();
  for (int j = inner_rank - 1; j >= 0; --j) {
    const int64_t extent = view.dims[batch.rank + j];
    const bool ok = extent == expected[j] || (inner_check == InnerCheck::kExactOrOne && extent == 1);
    if (!ok) {
      std::string want;
      for (int t = 0; t < inner_rank; ++t) {
        want += (t ? ", " : "") + std::to_string(expected[t]);
        if (inner_check == InnerCheck::kExactOrOne) want += "|1";
      }
      return Status::InvalidArgument(std::string("jax_flash: ") + name + " has shape " +
                                     DimsToString(view.dims) + ", expected trailing axes (" +
                                     want + ")");
    }
    operand->extent[j] = extent;
    operand->stride[j] = (extent == 1) ? 0 : element_stride;
    element_stride *= extent;
  }
  operand->batch_stride = element_stride;
  operand->data = view.data;
  return Status::Ok();
}

Status CheckDtype(const char* name, const Operand& operand, ElementType expected) {
  if (operand.dtype != expected) {
    return Status::InvalidArgument(std::string("jax_flash: ") + name + " has dtype " +
                                   ElementTypeName(operand.dtype) + ", expected " +
                                   ElementTypeName(expected));
  }
  return Status::Ok();
}

#define JF_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::jax_flash::Status _status = (expr);   \
    if (!_status.ok()) return _status;      \
  } while (0)

//! Describes a query-rows operand (q, out), the call's (T, N, H), in the kernel's view of `s`:
//! with query_groups G > 1, rows t*G + g of N / G heads (AttentionAttrs). Row t*G + g of head
//! k is the call's (t, k*G + g): rows step by a call head's stride within a query row (and by
//! a whole query row between rows t, ForwardParams::query_groups), heads by G of those.
Status DescribeQueryRows(const char* name, const BufferView& view, const BatchShape& batch,
                         const AttentionShape& s, int64_t query_groups, BatchCheck batch_check,
                         Operand* operand) {
  JF_RETURN_IF_ERROR(Describe(name, view, batch,
                              {s.seqlen_q / query_groups, s.num_heads * query_groups, s.head_dim},
                              InnerCheck::kExact, batch_check, operand));
  if (query_groups > 1) {
    operand->stride[0] = operand->stride[1];
    operand->stride[1] *= query_groups;
    operand->extent[0] = s.seqlen_q;
    operand->extent[1] = s.num_heads;
  }
  return Status::Ok();
}

//! Reads the batch shape from a full-shaped result buffer (out or dq).
Status BatchShapeOf(const char* name, ffi::Span<const int64_t> dims, BatchShape* batch) {
  const int rank = static_cast<int>(dims.size());
  if (rank < 4) {
    return Status::InvalidArgument(std::string("jax_flash: ") + name +
                                   " must have rank >= 4 (batch..., T, N, H), got shape " +
                                   DimsToString(dims));
  }
  if (rank - 3 > kMaxBatchRank) {
    return Status::InvalidArgument(std::string("jax_flash: ") + name + " has " +
                                   std::to_string(rank - 3) + " batch axes; at most " +
                                   std::to_string(kMaxBatchRank) + " are supported");
  }
  batch->rank = rank - 3;
  for (int i = 0; i < batch->rank; ++i) batch->extent[i] = dims[i];
  return Status::Ok();
}

//! Fills shape/options and checks q, k, v and the optional operands; shared by both passes.
Status DescribeInputs(const AttentionAttrs& attrs, const BatchShape& batch,
                      ffi::Span<const int64_t> out_dims, const ffi::AnyBuffer& q,
                      const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                      const ffi::RemainingArgs& optional_args, ForwardParams* p) {
  AttentionShape& s = p->shape;
  s.batch = batch;
  const int r = batch.rank;
  const int64_t groups = attrs.query_groups;
  if (groups < 1 || out_dims[r + 1] % groups != 0) {
    return Status::InvalidArgument("jax_flash: query_groups (" + std::to_string(groups) +
                                   ") must be positive and divide the query heads (" +
                                   std::to_string(out_dims[r + 1]) + ")");
  }
  s.seqlen_q = out_dims[r] * groups;
  s.num_heads = out_dims[r + 1] / groups;
  s.head_dim = out_dims[r + 2];
  const auto k_dims = k.dimensions();
  if (static_cast<int>(k_dims.size()) != r + 3) {
    return Status::InvalidArgument("jax_flash: key must have rank " + std::to_string(r + 3) +
                                   ", got shape " + DimsToString(k_dims));
  }
  s.seqlen_k = k_dims[r];
  s.num_kv_heads = k_dims[r + 1];
  if (s.num_heads <= 0 || s.num_kv_heads <= 0 || s.head_dim <= 0) {
    return Status::InvalidArgument("jax_flash: heads and head dim must be positive");
  }
  if (s.num_heads % s.num_kv_heads != 0) {
    return Status::InvalidArgument("jax_flash: query heads (" + std::to_string(s.num_heads) +
                                   ") must be a multiple of key/value heads (" +
                                   std::to_string(s.num_kv_heads) + ")");
  }
  JF_RETURN_IF_ERROR(DescribeQueryRows("query", ViewOf(q), batch, s, groups,
                                       BatchCheck::kFullOrOne, &p->q));
  JF_RETURN_IF_ERROR(Describe("key", ViewOf(k), batch, {s.seqlen_k, s.num_kv_heads, s.head_dim},
                              InnerCheck::kExact, BatchCheck::kFullOrOne, &p->k));
  JF_RETURN_IF_ERROR(Describe("value", ViewOf(v), batch, {s.seqlen_k, s.num_kv_heads, s.head_dim},
                              InnerCheck::kExact, BatchCheck::kFullOrOne, &p->v));
  s.dtype = p->q.dtype;
  if (!IsFloating(s.dtype)) {
    return Status::InvalidArgument(std::string("jax_flash: query dtype ") +
                                   ElementTypeName(s.dtype) + " is not a floating dtype");
  }
  JF_RETURN_IF_ERROR(CheckDtype("key", p->k, s.dtype));
  JF_RETURN_IF_ERROR(CheckDtype("value", p->v, s.dtype));

  if (attrs.window_left < -1 || attrs.window_right < -1) {
    return Status::InvalidArgument("jax_flash: window_left/window_right must be >= -1 "
                                   "(-1 = unbounded), got " + std::to_string(attrs.window_left) +
                                   ", " + std::to_string(attrs.window_right));
  }
  if (!(attrs.softcap >= 0.0) || std::isinf(attrs.softcap)) {
    return Status::InvalidArgument("jax_flash: softcap must be finite and >= 0 (0 = off), got " +
                                   std::to_string(attrs.softcap));
  }
  // The Hopper kernels take row maxima of raw products, which order the scaled logits only
  // for a scale >= 0; Python folds a negative scale into the query.
  if (!(attrs.scale >= 0.0) || std::isinf(attrs.scale)) {
    return Status::InvalidArgument("jax_flash: scale must be finite and >= 0, got " +
                                   std::to_string(attrs.scale));
  }
  p->options.scale = attrs.scale;
  p->options.softcap = attrs.softcap;
  // Windows that cut nothing become unbounded (-1), so that the kernels' index arithmetic on
  // them (32-bit on the GPU) never overflows: query i sees key j where
  // i - left <= j <= i + right, so left >= T and right >= S cut nothing.
  p->options.window_left = attrs.window_left >= s.seqlen_q ? -1 : attrs.window_left;
  p->options.window_right = attrs.window_right >= s.seqlen_k ? -1 : attrs.window_right;

  if (attrs.has_mask_blocks && attrs.has_mask) {
    return Status::InvalidArgument("jax_flash: a mask comes as the array (the CPU kernels) or as "
                                   "its block classes and bits (mask_blocks, mask_bits: the "
                                   "Hopper kernels), not both");
  }
  if (attrs.has_bias_blocks && !attrs.has_bias) {
    return Status::InvalidArgument("jax_flash: bias_blocks come only with a bias");
  }
  const size_t expected_optional = static_cast<size_t>(attrs.has_bias) + attrs.has_bias_blocks +
                                   attrs.has_mask +
                                   (attrs.has_mask_blocks ? 2 : 0) +
                                   attrs.has_q_seqlens + attrs.has_kv_seqlens +
                                   (attrs.has_segment_ids ? 4 : 0);
  if (optional_args.size() != expected_optional) {
    return Status::InvalidArgument("jax_flash: expected " + std::to_string(expected_optional) +
                                   " optional operands from the has_* attributes, got " +
                                   std::to_string(optional_args.size()));
  }
  size_t next = 0;
  auto take = [&](const char* name, BufferView* view) -> Status {
    auto buffer = optional_args.get<ffi::AnyBuffer>(next++);
    if (!buffer.has_value()) {
      return Status::InvalidArgument(std::string("jax_flash: cannot decode ") + name);
    }
    *view = ViewOf(*buffer);
    return Status::Ok();
  };
  BufferView view{};
  // Block classes and bits: their extents depend on the pass and its tile, which the kernels
  // check (here: any).
  auto take_tile_part = [&](const char* name, ElementType dtype, Operand* operand) -> Status {
    JF_RETURN_IF_ERROR(take(name, &view));
    const size_t r = static_cast<size_t>(batch.rank);
    const bool ranked = view.dims.size() == r + 3;  // else Describe reports the rank
    JF_RETURN_IF_ERROR(Describe(name, view, batch,
                                {s.num_heads, ranked ? view.dims[r + 1] : 1,
                                 ranked ? view.dims[r + 2] : 1},
                                InnerCheck::kExactOrOne, BatchCheck::kFullOrOne, operand));
    return CheckDtype(name, *operand, dtype);
  };
  if (attrs.has_bias) {
    JF_RETURN_IF_ERROR(take("bias", &view));
    JF_RETURN_IF_ERROR(Describe("bias", view, batch, {s.num_heads, s.seqlen_q, s.seqlen_k},
                                InnerCheck::kExactOrOne, BatchCheck::kFullOrOne, &p->bias));
    if (!IsFloating(p->bias.dtype)) {
      return Status::InvalidArgument(std::string("jax_flash: bias dtype ") +
                                     ElementTypeName(p->bias.dtype) + " is not floating");
    }
  }
  if (attrs.has_bias_blocks) {
    JF_RETURN_IF_ERROR(take_tile_part("bias_blocks", ElementType::kInt8, &p->bias_blocks));
  }
  if (attrs.has_mask) {
    JF_RETURN_IF_ERROR(take("mask", &view));
    JF_RETURN_IF_ERROR(Describe("mask", view, batch, {s.num_heads, s.seqlen_q, s.seqlen_k},
                                InnerCheck::kExactOrOne, BatchCheck::kFullOrOne, &p->mask));
    JF_RETURN_IF_ERROR(CheckDtype("mask", p->mask, ElementType::kBool));
  }
  if (attrs.has_mask_blocks) {
    JF_RETURN_IF_ERROR(take_tile_part("mask_blocks", ElementType::kInt8, &p->mask_blocks));
    JF_RETURN_IF_ERROR(take_tile_part("mask_bits", ElementType::kUInt32, &p->mask_bits));
  }
  if (attrs.has_q_seqlens) {
    JF_RETURN_IF_ERROR(take("query_seq_lengths", &view));
    JF_RETURN_IF_ERROR(Describe("query_seq_lengths", view, batch, {}, InnerCheck::kExact,
                                BatchCheck::kFullOrOne, &p->q_seqlens));
    JF_RETURN_IF_ERROR(CheckDtype("query_seq_lengths", p->q_seqlens, ElementType::kInt32));
  }
  if (attrs.has_kv_seqlens) {
    JF_RETURN_IF_ERROR(take("key_value_seq_lengths", &view));
    JF_RETURN_IF_ERROR(Describe("key_value_seq_lengths", view, batch, {}, InnerCheck::kExact,
                                BatchCheck::kFullOrOne, &p->kv_seqlens));
    JF_RETURN_IF_ERROR(CheckDtype("key_value_seq_lengths", p->kv_seqlens, ElementType::kInt32));
  }
  if (attrs.has_segment_ids) {
    auto take_int32 = [&](const char* name, std::initializer_list<int64_t> inner,
                          Operand* operand) -> Status {
      JF_RETURN_IF_ERROR(take(name, &view));
      JF_RETURN_IF_ERROR(Describe(name, view, batch, inner, InnerCheck::kExact,
                                  BatchCheck::kFullOrOne, operand));
      return CheckDtype(name, *operand, ElementType::kInt32);
    };
    JF_RETURN_IF_ERROR(take_int32("q_segment_ids", {s.seqlen_q}, &p->q_segment_ids));
    JF_RETURN_IF_ERROR(take_int32("kv_segment_ids", {s.seqlen_k}, &p->kv_segment_ids));
    JF_RETURN_IF_ERROR(take_int32("kv_span", {s.seqlen_q, 2}, &p->kv_span));
    JF_RETURN_IF_ERROR(take_int32("q_span", {s.seqlen_k, 2}, &p->q_span));
  }
  return Status::Ok();
}

ElementType LseType(ElementType dtype) {
  return dtype == ElementType::kFloat64 ? ElementType::kFloat64 : ElementType::kFloat32;
}

}  // namespace

const char* ElementTypeName(ElementType dtype) {
  switch (dtype) {
    case ElementType::kFloat64: return "float64";
    case ElementType::kFloat32: return "float32";
    case ElementType::kBFloat16: return "bfloat16";
    case ElementType::kFloat16: return "float16";
    case ElementType::kBool: return "bool";
    case ElementType::kInt32: return "int32";
    case ElementType::kInt8: return "int8";
    case ElementType::kUInt32: return "uint32";
  }
  return "unknown";
}

Status MakeForwardParams(const AttentionAttrs& attrs, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, const ffi::RemainingArgs& optional_args,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                         ForwardParams* p) {
  *p = ForwardParams{};
  BatchShape batch;
  JF_RETURN_IF_ERROR(BatchShapeOf("output", out->dimensions(), &batch));
  JF_RETURN_IF_ERROR(
      DescribeInputs(attrs, batch, out->dimensions(), q, k, v, optional_args, p));
  const AttentionShape& s = p->shape;
  const int64_t groups = attrs.query_groups;
  JF_RETURN_IF_ERROR(DescribeQueryRows("output", ViewOf(*out), batch, s, groups,
                                       BatchCheck::kFull, &p->out));
  // A split's parts (jax_flash/_split_kv.py) may come out in the accumulation dtype, which
  // their merge reads: no rounding before it.
  if (p->out.dtype != LseType(s.dtype)) {
    JF_RETURN_IF_ERROR(CheckDtype("output", p->out, s.dtype));
  }
  const int64_t query_rows = s.seqlen_q / groups;
  JF_RETURN_IF_ERROR(Describe("lse", ViewOf(*lse), batch, {s.num_heads * groups, query_rows},
                              InnerCheck::kExact, BatchCheck::kFull, &p->lse));
  JF_RETURN_IF_ERROR(CheckDtype("lse", p->lse, LseType(s.dtype)));
  if (attrs.block_m < 0) {
    return Status::InvalidArgument("jax_flash: block_m must be >= 0 (0: the default tile), got " +
                                   std::to_string(attrs.block_m));
  }
  p->block_m = attrs.block_m;
  if (groups > 1) {
    // The kernel's (K, T*G) view: exact for one query row; several are laid out (K, G, T),
    // which query_groups tells the kernels.
    p->lse.extent[0] = s.num_heads;
    p->lse.extent[1] = s.seqlen_q;
    p->lse.stride[0] = s.seqlen_q;
    p->lse.stride[1] = 1;
    if (query_rows > 1) p->query_groups = groups;
  }
  return Status::Ok();
}

Status MakeBackwardParams(const AttentionAttrs& attrs, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                          ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                          const ffi::RemainingArgs& optional_args, ffi::Result<ffi::AnyBuffer> dq,
                          ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                          const ffi::RemainingRets& optional_rets, size_t platform_rets,
                          BackwardParams* p) {
  *p = BackwardParams{};
  if (attrs.query_groups != 1) {
    return Status::InvalidArgument("jax_flash: the backward takes the call's query heads "
                                   "unpacked (query_groups must be 1)");
  }
  if (attrs.block_m != 0) {
    return Status::InvalidArgument("jax_flash: the backward has one tile per head dim "
                                   "(block_m must be 0)");
  }
  p->deterministic = attrs.deterministic;
  ForwardParams& f = p->fwd;
  BatchShape batch;
  JF_RETURN_IF_ERROR(BatchShapeOf("dq", dq->dimensions(), &batch));
  JF_RETURN_IF_ERROR(DescribeInputs(attrs, batch, dq->dimensions(), q, k, v, optional_args, &f));
  const AttentionShape& s = f.shape;
  const ElementType lse_type = LseType(s.dtype);
  JF_RETURN_IF_ERROR(Describe("output", ViewOf(out), batch, {s.seqlen_q, s.num_heads, s.head_dim},
                              InnerCheck::kExact, BatchCheck::kFullOrOne, &f.out));
  JF_RETURN_IF_ERROR(CheckDtype("output", f.out, s.dtype));
  JF_RETURN_IF_ERROR(Describe("lse", ViewOf(lse), batch, {s.num_heads, s.seqlen_q},
                              InnerCheck::kExact, BatchCheck::kFullOrOne, &f.lse));
  JF_RETURN_IF_ERROR(CheckDtype("lse", f.lse, lse_type));
  JF_RETURN_IF_ERROR(Describe("dout", ViewOf(dout), batch, {s.seqlen_q, s.num_heads, s.head_dim},
                              InnerCheck::kExact, BatchCheck::kFullOrOne, &p->dout));
  JF_RETURN_IF_ERROR(CheckDtype("dout", p->dout, s.dtype));
  JF_RETURN_IF_ERROR(Describe("dlse", ViewOf(dlse), batch, {s.num_heads, s.seqlen_q},
                              InnerCheck::kExact, BatchCheck::kFullOrOne, &p->dlse));
  JF_RETURN_IF_ERROR(CheckDtype("dlse", p->dlse, lse_type));
  JF_RETURN_IF_ERROR(Describe("dq", ViewOf(*dq), batch, {s.seqlen_q, s.num_heads, s.head_dim},
                              InnerCheck::kExact, BatchCheck::kFull, &p->dq));
  JF_RETURN_IF_ERROR(CheckDtype("dq", p->dq, s.dtype));
  JF_RETURN_IF_ERROR(Describe("dk", ViewOf(*dk), batch, {s.seqlen_k, s.num_kv_heads, s.head_dim},
                              InnerCheck::kExact, BatchCheck::kFull, &p->dk));
  JF_RETURN_IF_ERROR(CheckDtype("dk", p->dk, s.dtype));
  JF_RETURN_IF_ERROR(Describe("dv", ViewOf(*dv), batch, {s.seqlen_k, s.num_kv_heads, s.head_dim},
                              InnerCheck::kExact, BatchCheck::kFull, &p->dv));
  JF_RETURN_IF_ERROR(CheckDtype("dv", p->dv, s.dtype));
  if (attrs.has_dbias && !attrs.has_bias) {
    return Status::InvalidArgument("jax_flash: has_dbias needs a bias (has_bias)");
  }
  if (optional_rets.size() != (attrs.has_dbias ? 1u : 0u) + platform_rets) {
    return Status::InvalidArgument(
        "jax_flash: dbias must be returned exactly when has_dbias is set (and this platform's "
        "backward takes " + std::to_string(platform_rets) + " more results), got " +
        std::to_string(optional_rets.size()) + " results after dv");
  }
  if (attrs.has_dbias) {
    auto dbias = optional_rets.get<ffi::AnyBuffer>(0);
    if (!dbias.has_value()) return Status::InvalidArgument("jax_flash: cannot decode dbias");
    const Operand& bias = f.bias;
    // dbias keeps bias's own extents; it sums over every axis where bias broadcasts.
    JF_RETURN_IF_ERROR(Describe("dbias", ViewOf(**dbias), batch,
                                {bias.extent[0], bias.extent[1], bias.extent[2]},
                                InnerCheck::kExact, BatchCheck::kFullOrOne, &p->dbias));
    JF_RETURN_IF_ERROR(CheckDtype("dbias", p->dbias, bias.dtype));
  }
  return Status::Ok();
}

Status DescribeForwardMerge(ffi::AnyBuffer out_parts, ffi::AnyBuffer lse_parts,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                            ForwardMergeOperands* m) {
  *m = ForwardMergeOperands{};
  const auto part_dims = out_parts.dimensions();
  const auto lse_part_dims = lse_parts.dimensions();
  const auto out_dims = out->dimensions();
  if (part_dims.size() != 5 || lse_part_dims.size() != 4 || out_dims.size() != 4) {
    return Status::InvalidArgument(
        "jax_flash: the forward merge takes out_parts (items, parts, rows, heads, head dim), "
        "lse_parts (items, parts, K, T*G) and an output (items, T, N, head dim), got shapes " +
        DimsToString(part_dims) + ", " + DimsToString(lse_part_dims) + " and " +
        DimsToString(out_dims));
  }
  m->items = part_dims[0];
  m->parts = part_dims[1];
  m->head_dim = part_dims[4];
  m->query_rows = out_dims[1];
  m->kv_heads = lse_part_dims[2];
  const int64_t heads = out_dims[2];
  if (m->kv_heads < 1 || heads % m->kv_heads != 0) {
    return Status::InvalidArgument("jax_flash: the forward merge's output heads (" +
                                   std::to_string(heads) + ") must be a multiple of lse_parts' "
                                   "key/value heads (" + std::to_string(m->kv_heads) + ")");
  }
  m->group = heads / m->kv_heads;
  BatchShape items;
  items.rank = 1;
  items.extent[0] = m->items;
  const int64_t packed_rows = m->query_rows * m->group;  // of a key/value head in a part
  JF_RETURN_IF_ERROR(Describe("out_parts", ViewOf(out_parts), items,
                              {m->parts, packed_rows, m->kv_heads, m->head_dim},
                              InnerCheck::kExact, BatchCheck::kFull, &m->out_parts));
  JF_RETURN_IF_ERROR(Describe("lse_parts", ViewOf(lse_parts), items,
                              {m->parts, m->kv_heads, packed_rows}, InnerCheck::kExact,
                              BatchCheck::kFull, &m->lse_parts));
  JF_RETURN_IF_ERROR(Describe("output", ViewOf(*out), items,
                              {m->query_rows, heads, m->head_dim}, InnerCheck::kExact,
                              BatchCheck::kFull, &m->out));
  JF_RETURN_IF_ERROR(Describe("lse", ViewOf(*lse), items, {heads, m->query_rows},
                              InnerCheck::kExact, BatchCheck::kFull, &m->lse));
  const ElementType dtype = m->out.dtype;
  if (dtype != ElementType::kBFloat16 && dtype != ElementType::kFloat16) {
    return Status::InvalidArgument(std::string("jax_flash: the forward merge's output has "
                                               "dtype ") +
                                   ElementTypeName(dtype) + ", expected bfloat16 or float16");
  }
  JF_RETURN_IF_ERROR(CheckDtype("out_parts", m->out_parts, LseType(dtype)));
  JF_RETURN_IF_ERROR(CheckDtype("lse_parts", m->lse_parts, LseType(dtype)));
  JF_RETURN_IF_ERROR(CheckDtype("lse", m->lse, LseType(dtype)));
  return Status::Ok();
}

Status DescribeBiasClasses(ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> classes,
                           int64_t block_m, int64_t block_n, BiasClassesOperands* c) {
  *c = BiasClassesOperands{};
  const auto dims = bias.dimensions();
  const auto class_dims = classes->dimensions();
  const size_t rank = dims.size();
  if (rank < 2) {
    return Status::InvalidArgument("jax_flash: the bias must have rank 2 or more (..., queries, "
                                   "keys), got shape " + DimsToString(dims));
  }
  if (!ToElementType(bias.element_type(), &c->dtype) || !IsFloating(c->dtype)) {
    return Status::InvalidArgument("jax_flash: the bias must be floating");
  }
  if (classes->element_type() != ffi::DataType::S8) {
    return Status::InvalidArgument("jax_flash: the bias classes must be int8");
  }
  if (block_m < 1 || block_n < 1) {
    return Status::InvalidArgument("jax_flash: the bias classes need positive block sizes, got " +
                                   std::to_string(block_m) + " x " + std::to_string(block_n));
  }
  c->rows = dims[rank - 2];
  c->cols = dims[rank - 1];
  c->block_rows = c->rows > 1 ? block_m : 1;
  c->block_cols = c->cols > 1 ? block_n : 1;
  c->row_blocks = (c->rows + c->block_rows - 1) / c->block_rows;
  c->col_blocks = (c->cols + c->block_cols - 1) / c->block_cols;
  c->items = 1;
  bool ok = class_dims.size() == rank && class_dims[rank - 2] == c->row_blocks &&
            class_dims[rank - 1] == c->col_blocks;
  for (size_t i = 0; i + 2 < rank; ++i) {
    c->items *= dims[i];
    ok = ok && class_dims[i] == dims[i];
  }
  if (!ok) {
    return Status::InvalidArgument("jax_flash: the bias classes of a bias shaped " +
                                   DimsToString(dims) + " in " + std::to_string(block_m) + " x " +
                                   std::to_string(block_n) + " blocks must be shaped (..., " +
                                   std::to_string(c->row_blocks) + ", " +
                                   std::to_string(c->col_blocks) + "), got " +
                                   DimsToString(class_dims));
  }
  c->bias = bias.untyped_data();
  c->classes = classes->untyped_data();
  return Status::Ok();
}

ffi::Error ToFfiError(const Status& status) {
  switch (status.code()) {
    case Status::Code::kOk: return ffi::Error::Success();
    case Status::Code::kInvalidArgument: return ffi::Error::InvalidArgument(status.message());
    case Status::Code::kInternal: return ffi::Error::Internal(status.message());
  }
  return ffi::Error::Internal(status.message());
}

}  // namespace jax_flash
