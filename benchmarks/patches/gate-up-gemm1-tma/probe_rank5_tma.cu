// Session 55: does CuTe build one TMA descriptor that loads a GEMM1 weight tile of [gate; up] halves in the
// 32-row interleave the SwiGLU epilogues pair (gate rows 32j..32j+31, then up rows I+32j.., per 64 rows)?
// It compiles (nvcc -std=c++17 -arch=sm_90a -I<cutlass>/include): a rank-5 box (64 K, 32, 2, 4 blocks, 1
// expert) over gmem dims (K, 32, 2, I/32, E). local_tile of the hierarchical N mode by 256 gives ceil(I/128)
// tiles (I = 96 -> 1, 160 -> 2). Running it needs a GPU (cuTensorMapEncodeTiled). See NOTES.md session 55.
#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cstdio>
using namespace cute;
using T = cutlass::bfloat16_t;
int main() {
  int I = 768, H = 2048, E = 4;
  auto layout = make_layout(make_shape(make_shape(Int<32>{}, Int<2>{}, I / 32), H, E),
                            make_stride(make_stride(int64_t(H), int64_t(I) * H, int64_t(32) * H), Int<1>{}, int64_t(2) * I * H));
  using Atom = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, Int<256>, Int<64>>());
  auto slayout = tile_to_shape(Atom{}, make_shape(Int<256>{}, Int<64>{}));
  T* ptr = nullptr;
  auto tensor = make_tensor(make_gmem_ptr(ptr), layout);
  auto tma = make_tma_copy(SM90_TMA_LOAD{}, tensor, slayout, make_shape(Int<256>{}, Int<64>{}), Int<1>{});
  print(tma); printf("\n");
  auto mB = tma.get_tma_tensor(shape(layout));
  print(mB); printf("\n");
}
