// The plain read the device benches compare their rings with: every 16 bytes of n16 * 16 read once, grid-stride,
// streaming (evict-first) LDG.128 loads, their xor kept live through `sink`.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

__global__ void ldg_read(const uint4* src, size_t n16, unsigned long long* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345) sink[0] = x;
}
