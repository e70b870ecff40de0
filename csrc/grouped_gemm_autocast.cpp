// Autocast for the grouped GEMM ops: inside torch.autocast they run as torch's matrix products
// do (autocast's lower_precision_fp policy): floating operands other than float64 are cast to the
// autocast dtype (bfloat16 unless the region says otherwise) through autocast's cast cache, then
// the op runs with autocast off. Training code written for torch.mm under autocast (float32
// weights, or float32 activations from a LayerNorm next to bfloat16 weights) then runs cake's
// kernels unchanged. The casts sit above autograd, so gradients reach the float32 tensors in
// their own dtype. The *_out ops (caller-owned outputs of a fixed dtype) are left alone.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace cake {
namespace {

using GemmFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using WgradFn =
    at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType);

template <class Fn>
c10::TypedOperatorHandle<Fn> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

template <c10::DeviceType kDevice>
struct Autocast {
  static c10::DispatchKey autocast_key() {
    return at::autocast::get_autocast_dispatch_key_from_device_type(kDevice);
  }
  static at::Tensor cast(const at::Tensor& t) {
    const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(kDevice);
    return at::autocast::cached_cast(dtype, t, kDevice);
  }

  // fwd (x, w, offs) and dgrad (grad_out, w, offs) share a signature.
  template <const char* kName>
  static at::Tensor gemm(const at::Tensor& a, const at::Tensor& w, const at::Tensor& offs) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key());
    static const auto op = op_handle<GemmFn>(kName);
    return op.call(cast(a), cast(w), offs);
  }

  static at::Tensor wgrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& offs,
                          int64_t num_groups, at::ScalarType out_dtype) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key());
    static const auto op = op_handle<WgradFn>("cake::grouped_gemm_wgrad");
    const auto a = cast(grad_out), b = cast(x);
    // out_dtype is x's dtype or float32 (the op's rule); x's dtype follows x through the cast.
    const bool names_input = out_dtype == x.scalar_type() && out_dtype != at::kFloat;
    return op.call(a, b, offs, num_groups, names_input ? b.scalar_type() : out_dtype);
  }
};

constexpr char kFwd[] = "cake::grouped_gemm_fwd";
constexpr char kDgrad[] = "cake::grouped_gemm_dgrad";

template <c10::DeviceType kDevice>
void register_autocast(torch::Library& m) {
  m.impl("grouped_gemm_fwd", &Autocast<kDevice>::template gemm<kFwd>);
  m.impl("grouped_gemm_dgrad", &Autocast<kDevice>::template gemm<kDgrad>);
  m.impl("grouped_gemm_wgrad", &Autocast<kDevice>::wgrad);
}

}  // namespace

TORCH_LIBRARY_IMPL(cake, AutocastCUDA, m) { register_autocast<c10::DeviceType::CUDA>(m); }
TORCH_LIBRARY_IMPL(cake, AutocastCPU, m) { register_autocast<c10::DeviceType::CPU>(m); }

}  // namespace cake
