// The 1-token decode step as a library: its kernel (cuda_step_kernel.cuh, where the design is described) compiled
// once, as the step itself (kProbe 0), and the C entry points megamoe/decode/cuda_step.py calls through ctypes
// (shared memory, the one-time preparation, the launch). The lab compiles the probe modes' instances over the same
// header (lab/cuda_step/probe_step.cu).

#include "cuda_step_kernel.cuh"

namespace {

const Kernel kStep = step1_kernel<0>;

}  // namespace

extern "C" {

// Shared memory the kernel needs besides its ring, for the geometry (bytes).
int megamoe_cuda_step_fixed_smem(int H, int I) { return fixed_smem_bytes(H, I); }

int megamoe_cuda_step_stage_bytes() { return kStageBytes + 16; }  // a stage and its two mbarriers

int megamoe_cuda_step_max_terms() { return kMaxTerms; }

int megamoe_cuda_step_parts() { return kParts; }

// The kernel's dynamic shared memory limit and a check of its register count; once, before the first launch (and
// outside a CUDA graph capture). 0, a CUDA error code, or -(registers per thread) when setmaxnreg cannot work.
int megamoe_cuda_step_prepare(int device, int smem_bytes) {
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return int(err);
  return prepare_instance(kStep, smem_bytes);
}

// Launch the step on `stream`: `tensors` Params' kTensors pointers in its order (weights, staged token, route's
// outputs, l2_q, l2_sf, slot_out, y, the counts); `lag` gate/up rounds between an item's last gate/up tiles and its
// down tiles (Schedule). 0 or the CUDA error code.
int megamoe_cuda_step_launch(const void* const* tensors, float clamp, int H, int I, int K, int expert_lo,
                             int num_local, int stages, int lag, int grid, int smem_bytes, int device, void* stream) {
  const Params p = step_params(tensors, clamp, H, I, K, expert_lo, num_local, stages, lag);
  return launch_instance(kStep, p, grid, smem_bytes, device, stream);
}

}  // extern "C"
