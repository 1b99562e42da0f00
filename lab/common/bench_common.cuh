// What the ring benches (ring_bench.cu, pattern_bench.cu) share: their clock and the plain read they
// compare with.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

// The plain read: every 16 bytes of n16 * 16 read once, grid-stride, streaming (evict-first) LDG.128 loads, their
// xor kept live through `sink`.
__global__ void ldg_read(const uint4* src, size_t n16, unsigned long long* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345) sink[0] = x;
}

// The mean time of `launch` in us by CUDA events over 10 launches after 2, each after the L2 cache is flushed (the
// `flush` buffer overwritten) and `before` runs, both outside the timed span.
template <class Before, class Launch>
float flushed_mean_us(uint8_t* flush, size_t flush_bytes, Before before, Launch launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float sum = 0;
  for (int r = 0; r < 12; ++r) {
    before();
    cudaMemsetAsync(flush, r, flush_bytes);
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (r >= 2) sum += ms;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return sum / 10 * 1e3f;
}
