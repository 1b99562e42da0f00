// The 1-token decode step as a library: its kernel (cuda_step_kernel.cuh, where the design is described) and the C
// entry points megamoe/decode/cuda_step.py calls through ctypes (shared memory, the one-time preparation, the launch).

#include "cuda_step_kernel.cuh"

extern "C" {

// Shared memory the kernel needs besides its ring, for the geometry (bytes): the layout at the kernel's start.
int megamoe_cuda_step_fixed_smem(int H, int I) {
  const int bytes =
      (H + kPad) + kMaxTopK * (I + kPad) + 4 * (2 * kMaxTerms * 64 + 64 + H / 128 + kMaxTopK * I / 32 + 4);
  return (bytes + 7) / 8 * 8 + 8 * kMaxTopK + int(sizeof(Items)) + 4;  // + input_ready, the routing, a count
}

int megamoe_cuda_step_stage_bytes() { return kStageBytes + 16; }  // a stage and its two mbarriers

int megamoe_cuda_step_max_terms() { return kMaxTerms; }

int megamoe_cuda_step_parts() { return kParts; }

// The kernel's dynamic shared memory limit and a check of its register count; once, before the first launch (and
// outside a CUDA graph capture). 0, a CUDA error code, or -(registers per thread) when setmaxnreg cannot work.
int megamoe_cuda_step_prepare(int device, int smem_bytes) {
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(step1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return int(err);
  // setmaxnreg only moves registers within the CTA's allocation: the computing warpgroups' increase must fit in what
  // the last warpgroup gives back, or their setmaxnreg.inc would wait forever. -registers per thread if not.
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, step1_kernel);
  if (err != cudaSuccess) return int(err);
  if (kComputeThreads * (kComputeRegs - attr.numRegs) > 128 * (attr.numRegs - kOtherRegs)) return -attr.numRegs;
  return 0;
}

// Launch the step on `stream`, cooperative (every CTA resident at once): `tensors` the 20 pointers of Params in its
// order (weights, staged token, route's outputs, l2_q, l2_sf, slot_out, y, the counts); `lag` gate/up rounds between
// an item's last gate/up tiles and its down tiles (Schedule). 0 or the CUDA error code.
int megamoe_cuda_step_launch(const void* const* tensors, float clamp, int H, int I, int K, int expert_lo,
                             int num_local, int stages, int lag, int grid, int smem_bytes, int device, void* stream) {
  auto in = [&](int i) { return static_cast<const uint8_t*>(tensors[i]); };
  auto out = [&](int i) { return const_cast<void*>(tensors[i]); };
  const Params p{in(0), in(1), in(2), in(3), in(4), reinterpret_cast<const float*>(in(5)),
                 reinterpret_cast<const int64_t*>(in(6)), reinterpret_cast<const float*>(in(7)),
                 static_cast<int32_t*>(out(8)), static_cast<int32_t*>(out(9)), static_cast<int32_t*>(out(10)),
                 static_cast<int32_t*>(out(11)), static_cast<int32_t*>(out(12)), static_cast<float*>(out(13)),
                 static_cast<int32_t*>(out(14)), static_cast<uint8_t*>(out(15)), static_cast<float*>(out(16)),
                 static_cast<uint16_t*>(out(17)), static_cast<uint16_t*>(out(18)), static_cast<uint32_t*>(out(19)),
                 clamp, H, I, K, expert_lo, num_local, stages, lag};
  const cudaError_t err = cudaSetDevice(device);  // this library's runtime keeps its own current device
  if (err != cudaSuccess) return int(err);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return int(cudaLaunchKernelEx(&cfg, step1_kernel, p));
}

}  // extern "C"
