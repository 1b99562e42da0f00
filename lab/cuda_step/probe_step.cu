// The 1-token CUDA step's probe instances: the step's kernel with its probe hooks (probe_kernel/, the library's at
// 1a7f0ec) compiled once per probe mode with the lab's hooks (probes.cuh), and the C entry points
// lab/cuda_step/step.py calls through ctypes. Instance 0 is the step itself as the studies measured it.

#include "probes.cuh"

namespace {

// The kernel instances: the step (0) and each probe mode compiled into its own; the flags kRuntimeFlags names are
// read from Params::mode at run time in any of them. step.INSTANCES is this list (a test compares them).
constexpr int kInstances[] = {0, kModeEmpty, kModeTouch, kModeAhead, kModeNoWait, kModeRelaxed, kModeRegs,
                              kModeRegs | kModeNoWait, kModeRegsL1, kModeLL, kModeLL | kModeRegsL1, kModeLLCombine,
                              kModeLL | kModeLLCombine, kModeLL | kModeLLCombine | kModeRegsL1};
constexpr int kRuntimeFlags = kModeBare | kModeNoScales | kModePrefetch | kModeNoLoad | kModePlain;

template <int kIndex = 0>
Kernel kernel_for(int probe_bits) {  // the instance of exactly these probe bits, or nullptr
  if constexpr (kIndex == int(sizeof(kInstances) / sizeof(kInstances[0]))) {
    return nullptr;
  } else {
    return probe_bits == kInstances[kIndex] ? step1_kernel<kInstances[kIndex]> : kernel_for<kIndex + 1>(probe_bits);
  }
}

}  // namespace

extern "C" {

// Every instance's dynamic shared memory limit and register check (cuda_step_kernel.cuh's prepare_instance), once
// before the first launch: 0, a CUDA error code, or -(registers per thread) of an instance setmaxnreg cannot serve.
int lab_step_prepare(int device, int smem_bytes) {
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return int(err);
  for (const int mode : kInstances)
    if (const int bad = prepare_instance(kernel_for(mode), smem_bytes, mode != kModeEmpty))  // empty: no setmaxnreg
      return bad;
  return 0;
}

// The probe modes compiled into kernel instances (besides 0, the step): `out` gets up to `cap` of them; their count.
int lab_step_instances(int* out, int cap) {
  int n = 0;
  for (const int mode : kInstances) {
    if (n < cap) out[n] = mode;
    ++n;
  }
  return n;
}

// Launch instance `mode` (its compiled flags; plus any of kRuntimeFlags) on `stream`: the step's tensors as the
// library's launch takes them, then `stamps` and `trace` (or null), `inflight` and `lag` (Params). 0 or the CUDA error.
int lab_step_launch(const void* const* tensors, void* stamps, void* trace, float clamp, int H, int I, int K,
                    int expert_lo, int num_local, int stages, int mode, int inflight, int lag, int grid,
                    int smem_bytes, int device, void* stream) {
  Params p = step_params(tensors, clamp, H, I, K, expert_lo, num_local, stages, lag);
  p.stamps = static_cast<int64_t*>(stamps);
  p.trace = static_cast<int64_t*>(trace);
  p.mode = mode;
  p.inflight = inflight;
  const Kernel kernel = kernel_for(mode & ~kRuntimeFlags);
  if (kernel == nullptr) return int(cudaErrorInvalidValue);  // (step.step refuses such a mode first)
  return launch_instance(kernel, p, grid, smem_bytes, device, stream, !(mode & kModePlain));
}

}  // extern "C"
