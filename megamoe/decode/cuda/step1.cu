// The 1-token decode step as a library: its kernel (step1_kernel.cuh, where the design is described) compiled once
// per probe mode, and the C entry points megamoe/decode/cuda_step1.py calls through ctypes (shared memory, the
// instances, the one-time preparation, the launch).

#include "step1_kernel.cuh"

namespace {

// The kernel instances: the step (0) and each probe mode compiled into its own; the flags kRuntimeFlags names are
// read from Params::mode at run time in any of them. cuda_step1.INSTANCES is this list (a test compares them).
constexpr int kInstances[] = {0, kModeEmpty, kModeTouch, kModeAhead, kModeNoWait, kModeRelaxed, kModeRegs,
                              kModeRegs | kModeNoWait, kModeRegsL1, kModeLL, kModeLL | kModeRegsL1, kModeLLCombine,
                              kModeLL | kModeLLCombine, kModeLL | kModeLLCombine | kModeRegsL1};
constexpr int kRuntimeFlags = kModeBare | kModeNoScales | kModePrefetch | kModeNoLoad | kModePlain;
using Kernel = void (*)(Params);

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

// Shared memory the kernel needs besides its ring, for the geometry (bytes).
int megamoe_step1_fixed_smem(int H, int I) {
  const int bytes =
      (H + kPad) + kMaxTopK * (I + kPad) + 4 * (2 * kMaxTerms * 64 + 64 + H / 128 + kMaxTopK * I / 32 + 4);
  return (bytes + 7) / 8 * 8 + 8 * kMaxTopK + int(sizeof(Items)) + 4;  // + input_ready, the routing, a count
}

int megamoe_step1_stage_bytes() { return kStageBytes + 16; }  // a stage and its two mbarriers

int megamoe_step1_max_terms() { return kMaxTerms; }

int megamoe_step1_threads() { return kThreads; }

int megamoe_step1_parts() { return kParts; }

// The kernel's dynamic shared memory limit and a check of its register count; once, before the first launch (and
// outside a CUDA graph capture). 0, a CUDA error code, or -(registers per thread) when setmaxnreg cannot work.
int megamoe_step1_prepare(int device, int smem_bytes) {
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return int(err);
  for (const int mode : kInstances) {
    const Kernel kernel = kernel_for(mode);
    const cudaError_t set = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (set != cudaSuccess) return int(set);
    if (mode == kModeEmpty) continue;  // it returns at once: no setmaxnreg
    // setmaxnreg only moves registers within the CTA's allocation: the computing warpgroups' increase must fit in
    // what the last warpgroup gives back, or their setmaxnreg.inc would wait forever. -registers per thread if not.
    cudaFuncAttributes attr;
    const cudaError_t got = cudaFuncGetAttributes(&attr, kernel);
    if (got != cudaSuccess) return int(got);
    if (kComputeThreads * (kComputeRegs - attr.numRegs) > 128 * (attr.numRegs - kOtherRegs)) return -attr.numRegs;
  }
  return 0;
}

// The probe modes compiled into kernel instances (besides 0, the step): `out` gets up to `cap` of them; their count.
int megamoe_step1_instances(int* out, int cap) {
  int n = 0;
  for (const int mode : kInstances) {
    if (n < cap) out[n] = mode;
    ++n;
  }
  return n;
}

// Launch on `stream`; 0 or the CUDA error code. A cooperative launch: every CTA must be resident at once.
int megamoe_step1_launch(const void* l1_codes, const void* l1_scales, const void* l2_codes, const void* l2_scales,
                         const void* x_q, const void* x_sf, const void* topk_idx, const void* topk_w,
                         void* num_touched, void* touched, void* seg_start, void* seg_count, void* row_token,
                         void* row_weight, void* slot_row, void* l2_q, void* l2_sf, void* slot_out, void* y,
                         void* sync, void* stamps, void* trace, float clamp, int H, int I, int K, int expert_lo,
                         int num_local, int stages, int mode, int inflight, int lag, int grid, int smem_bytes,
                         int device, void* stream) {
  Params p{static_cast<const uint8_t*>(l1_codes), static_cast<const uint8_t*>(l1_scales),
           static_cast<const uint8_t*>(l2_codes), static_cast<const uint8_t*>(l2_scales),
           static_cast<const uint8_t*>(x_q), static_cast<const float*>(x_sf),
           static_cast<const int64_t*>(topk_idx), static_cast<const float*>(topk_w),
           static_cast<int32_t*>(num_touched), static_cast<int32_t*>(touched), static_cast<int32_t*>(seg_start),
           static_cast<int32_t*>(seg_count), static_cast<int32_t*>(row_token), static_cast<float*>(row_weight),
           static_cast<int32_t*>(slot_row), static_cast<uint8_t*>(l2_q), static_cast<float*>(l2_sf),
           static_cast<uint16_t*>(slot_out), static_cast<uint16_t*>(y), static_cast<uint32_t*>(sync),
           static_cast<int64_t*>(stamps), static_cast<int64_t*>(trace), clamp, H, I, K, expert_lo, num_local, stages,
           mode, inflight, lag};
  const cudaError_t err = cudaSetDevice(device);  // this library's runtime keeps its own current device
  if (err != cudaSuccess) return int(err);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = (mode & kModePlain) ? 0 : 1;
  const Kernel kernel = kernel_for(mode & ~kRuntimeFlags);
  if (kernel == nullptr) return int(cudaErrorInvalidValue);  // (cuda_step1.step1 refuses such a mode first)
  return int(cudaLaunchKernelEx(&cfg, kernel, p));
}

}  // extern "C"
