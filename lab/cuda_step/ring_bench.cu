// How fast one CTA per SM streams global memory into a shared-memory ring with cp.async.bulk (one thread
// issuing), against the copy size, the ring's depth and CTAs per SM; beside a plain load-and-xor read. The
// question behind it: the 1-token CUDA step (megamoe/decode/cuda/cuda_step.cu) streamed its 80 MB at ~1.5 TB/s.
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o ring lab/cuda_step/ring_bench.cu && ./ring
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "../common/bench_common.cuh"  // flushed_mean_us, ldg_read

__device__ __forceinline__ uint32_t sa(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Each stage's full barrier (one expect_tx) and empty barrier (one arrival per consumer warp), seen by all threads.
__device__ void init_ring(uint64_t* full, uint64_t* empty, int depth) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < depth; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;" ::"r"(sa(&empty[s])));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

__global__ void ring_kernel(const uint8_t* src, size_t bytes, int chunk, int depth, unsigned long long* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(depth) * chunk);
  uint64_t* empty = full + depth;
  init_ring(full, empty, depth);
  const size_t per_cta = bytes / gridDim.x / chunk * chunk;
  const uint8_t* base = src + per_cta * blockIdx.x;
  const int n = int(per_cta / chunk);
  if (threadIdx.x == 128) {  // producer
    for (int u = 0; u < n; ++u) {
      const int s = u % depth;
      const uint32_t ph = ((u / depth) & 1) ^ 1;
      asm volatile("{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}\n"
                   ::"r"(sa(&empty[s])), "r"(ph) : "memory");
      asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
                   ::"r"(sa(&full[s])), "r"(chunk) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(sa(smem + size_t(s) * chunk)), "l"(base + size_t(u) * chunk), "r"(chunk), "r"(sa(&full[s]))
                   : "memory");
    }
  } else if (threadIdx.x < 128) {  // one consumer warpgroup: wait, read a word, release
    unsigned long long x = 0;
    for (int u = 0; u < n; ++u) {
      const int s = u % depth;
      asm volatile("{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}\n"
                   ::"r"(sa(&full[s])), "r"((u / depth) & 1) : "memory");
      x ^= reinterpret_cast<const uint32_t*>(smem + size_t(s) * chunk)[threadIdx.x];
      __syncwarp();
      if (threadIdx.x % 32 == 0)
        asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(sa(&empty[s])) : "memory");
    }
    if (x == 0x12345) sink[0] = x;
  }
}

// The same ring shaped like the 1-token step: each CTA's slice as 128 KB tiles, each tile's two 64 KB halves
// interleaved 4 KB at a time (SPLIT), a 256-byte side copy per 4 KB from a second buffer (SIDE), and the
// stages alternating between two consumer warpgroups (TWO).
__global__ void shaped_kernel(const uint8_t* src, const uint8_t* side, size_t bytes, int depth, int split, int use_side,
                              int two, unsigned long long* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int chunk = 4096 + 256;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(depth) * chunk);
  uint64_t* empty = full + depth;
  init_ring(full, empty, depth);
  const size_t per_cta = bytes / gridDim.x / (128 << 10) * (128 << 10);
  const uint8_t* base = src + per_cta * blockIdx.x;
  const uint8_t* sbase = side + per_cta / 16 * blockIdx.x;
  const int n = int(per_cta / 4096);
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 256) {  // producer
    for (int u = 0; u < n; ++u) {
      const int s = u % depth;
      const uint32_t ph = ((u / depth) & 1) ^ 1;
      int blk = u;
      if (split) blk = (u / 32) * 32 + (u % 2) * 16 + (u % 32) / 2;  // tile, half, block
      asm volatile("{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}\n"
                   ::"r"(sa(&empty[s])), "r"(ph) : "memory");
      asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
                   ::"r"(sa(&full[s])), "r"(use_side ? chunk : 4096) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(sa(smem + size_t(s) * chunk)), "l"(base + size_t(blk) * 4096), "r"(4096), "r"(sa(&full[s]))
                   : "memory");
      if (use_side)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(sa(smem + size_t(s) * chunk + 4096)), "l"(sbase + size_t(blk) * 256), "r"(256),
                     "r"(sa(&full[s])) : "memory");
    }
  } else if (threadIdx.x < 256 && (two || wg == 0)) {
    unsigned long long x = 0;
    const int t = threadIdx.x % 128;
    for (int u = two ? wg : 0; u < n; u += two ? 2 : 1) {
      const int s = u % depth;
      asm volatile("{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}\n"
                   ::"r"(sa(&full[s])), "r"((u / depth) & 1) : "memory");
      x ^= reinterpret_cast<const uint32_t*>(smem + size_t(s) * chunk)[t];
      __syncwarp();
      if (t % 32 == 0)
        asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(sa(&empty[s])) : "memory");
    }
    if (x == 0x12345) sink[0] = x;
  }
}


__global__ void fill_random(uint32_t* p, size_t n) {  // random words: no compressible pattern for the memory system
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ uint32_t(i >> 32) * 40503u;
    x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; x *= 3266489917u; x ^= x >> 16;
    p[i] = x;
  }
}

int main() {
  const size_t bytes = 80u << 20, flush_bytes = 256u << 20;
  uint8_t *src, *flush;
  unsigned long long* sink;
  cudaMalloc(&src, bytes);
  cudaMalloc(&flush, flush_bytes);
  cudaMalloc(&sink, 8);
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(src), bytes / 4);
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  auto time = [&](auto launch) { return flushed_mean_us(flush, flush_bytes, [] {}, launch); };
  printf("plain read (LDG.128, 4 x SMs x 512 threads): %.1f us\n",
         time([&] { ldg_read<<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(src), bytes / 16, sink); }));
  const int chunks[] = {4096, 16384, 32768};
  const int ring_kb[] = {64, 192};
  for (int per_sm = 1; per_sm <= 2; ++per_sm)
    for (int chunk : chunks)
      for (int kb : ring_kb) {
        const int depth = kb * 1024 / chunk / per_sm;
        if (depth < 2) continue;
        const int smem = depth * chunk + 16 * depth;
        if (smem > 227 * 1024 / per_sm) continue;
        const float us = time([&] { ring_kernel<<<sms * per_sm, 160, smem>>>(src, bytes, chunk, depth, sink); });
        printf("ring: %d CTA/SM, chunk %5d B, depth %3d (%3d KB per SM in flight): %.1f us, %.2f TB/s\n", per_sm,
               chunk, depth, depth * chunk * per_sm / 1024, us, bytes / us / 1e6);
      }
  cudaFuncSetAttribute(shaped_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  uint8_t* side;
  cudaMalloc(&side, bytes / 16 + (1 << 20));
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(side), (bytes / 16 + (1 << 20)) / 4);
  for (int depth : {16, 42})
    for (int split = 1; split < 2; ++split)
      for (int use_side = 0; use_side < 2; ++use_side)
        for (int two = 1; two < 2; ++two) {
          const int smem = depth * (4096 + 256) + 16 * depth;
          const float us = time([&] {
            shaped_kernel<<<sms, 288, smem>>>(src, side, bytes, depth, split, use_side, two, sink);
          });
          const double moved = double(bytes / sms / (128 << 10) * (128 << 10)) * sms * (use_side ? 17.0 / 16 : 1.0);
          printf("shaped: depth %2d, halves interleaved %d, 256 B side copies %d, two consumer warpgroups %d: %.1f us "
                 "for %.1f MB, %.2f TB/s\n", depth, split, use_side, two, us, moved / 1e6, moved / us / 1e6);
        }
  cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return 0;
}
