// How fast an SM runs the 1-token step's MMA (wgmma m64n8k32 e4m3, A in registers, B from shared memory, zero
// accumulator), by warpgroups per CTA and MMAs per commit: the floor under megamoe/decode/cuda/cuda_step.cu's stages.
// One CTA per SM, every warpgroup looping over batches of MMAs; clock64 around the loop.
//
//     nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o wgmma_rate lab/cuda_step/wgmma_rate_bench.cu && ./wgmma_rate
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ uint64_t b_desc(const void* p) {  // as cuda_step_ops.cuh: K-major, no swizzle, LBO 16
  uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(8) << 32);
}

template <int kBatch>
__global__ void __launch_bounds__(512, 1) mma_loop(int reps, int wgs, long long* cycles, float* sink) {
  __shared__ __align__(128) uint8_t b[2048];
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) b[i] = uint8_t((i * 37) & 0x77);  // finite e4m3 codes
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg >= wgs) return;
  uint32_t seed = threadIdx.x * 2654435761u;
  const uint64_t desc = b_desc(b);
  float acc = 0.f;
  const long long t0 = clock64();
  for (int it = 0; it < reps; ++it) {
    float d[kBatch][4];
    uint32_t a[kBatch][4];  // operands made afresh each batch, as the step decodes them
    seed = seed * 1664525u + 1013904223u;
#pragma unroll
    for (int m = 0; m < kBatch; ++m)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[m][r] = (seed ^ (m * 0x01010101u + r)) & 0x5C5C5C5Cu;
#pragma unroll
    for (int m = 0; m < kBatch; ++m) {
      d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.f;
      asm volatile("" : "+r"(a[m][0]), "+r"(a[m][1]), "+r"(a[m][2]), "+r"(a[m][3]), "+f"(d[m][0]), "+f"(d[m][1]),
                   "+f"(d[m][2]), "+f"(d[m][3])::"memory");
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int m = 0; m < kBatch; ++m)
      asm volatile(
          "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
          " wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
          : "+f"(d[m][0]), "+f"(d[m][1]), "+f"(d[m][2]), "+f"(d[m][3])
          : "r"(a[m][0]), "r"(a[m][1]), "r"(a[m][2]), "r"(a[m][3]), "l"(desc + 2 * (m % 8)), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int m = 0; m < kBatch; ++m) {
      asm volatile("" : "+f"(d[m][0]), "+f"(d[m][1]), "+f"(d[m][2]), "+f"(d[m][3])::"memory");
      acc += d[m][0];
    }
  }
  const long long t1 = clock64();
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 4 + wg] = t1 - t0;
  if (acc == 12345.f) sink[threadIdx.x] = acc;
}

template <int kBatch>
void run(int sms, int wgs, long long* dcyc, float* sink) {
  const int reps = 2000;
  mma_loop<kBatch><<<sms, 128 * wgs>>>(reps, wgs, dcyc, sink);  // warm
  cudaMemset(dcyc, 0, sizeof(long long) * sms * 4);
  mma_loop<kBatch><<<sms, 128 * wgs>>>(reps, wgs, dcyc, sink);
  cudaDeviceSynchronize();
  long long h[132 * 4];
  cudaMemcpy(h, dcyc, sizeof(long long) * sms * 4, cudaMemcpyDeviceToHost);
  double mean = 0;
  for (int c = 0; c < sms; ++c)
    for (int w = 0; w < wgs; ++w) mean += h[c * 4 + w];
  mean /= sms * wgs;
  const double per_batch = mean / reps;
  printf("batch %d, %d warpgroups per SM: %.0f cycles per batch per warpgroup, %.1f cycles per MMA per SM\n", kBatch,
         wgs, per_batch, per_batch / (kBatch * wgs));
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* dcyc;
  float* sink;
  cudaMalloc(&dcyc, sizeof(long long) * sms * 4);
  cudaMalloc(&sink, 4096);
  for (int wgs : {1, 2, 4}) {
    run<1>(sms, wgs, dcyc, sink);
    run<4>(sms, wgs, dcyc, sink);
    run<8>(sms, wgs, dcyc, sink);
    run<2>(sms, wgs, dcyc, sink);
  }
  const cudaError_t err = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(err));
  return err != cudaSuccess;
}
