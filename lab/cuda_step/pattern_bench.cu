// The 1-token CUDA step's stream alone: one CTA per SM, one thread issuing cp.async.bulk stages into a ring of 20,
// four consumer warpgroups that only read a word of each of their stages and free it. No decode, no MMA, no waits
// between CTAs. The question behind it: the step's own `bare` mode streams as slowly as the whole step (run 36:
// 39.8 against 40.4 us of kernel time) while a plain read of the same 80.2 MB takes 29.7, and its load warp stops
// for microseconds before each tile's first stage. Is that the step's address pattern, or the step?
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o pattern lab/cuda_step/pattern_bench.cu && ./pattern
//
// Patterns, each the same stages (two 4 KB code blocks and their two 256-byte scale words, like the step's):
//   step      the step's tiles at DeepSeek-V4-Flash: per CTA its L1 tiles blockIdx.x + r * G, then its L2 tiles,
//             of experts 183 59 202 95 89 31 (probe.py's token) in weights for 256 experts, each tile's
//             stages in the step's order (two blocks of each K quarter in turn);
//   blocked   the step's experts, each CTA's tiles consecutive (c * n / G up to (c + 1) * n / G), not strided;
//   in-order  the step's tiles, each tile's stages in address order, not the K quarters in turn;
//   compact   the step's order with experts 0..5 (the six experts' weights adjacent);
//   linear    each CTA's stages from one contiguous stretch of the code and scale buffers;
//   reload    the step's pattern, the issuing thread waiting at each tile start for a word from the L2 cache;
//   polled    the step's pattern with its cross-CTA counts' traffic: a warp per CTA spins on a global count that
//             each CTA raises (red.release.gpu) as it finishes reading an L1 tile, as the step's input warp does;
//   released  the same additions with no spinning warp; relaxed: the additions without the release (no fence);
//   LDG read  no ring: a plain grid-stride LDG.128 read of the same 80.2 MB, 4 CTAs of 512 threads per SM;
//   regs D    no ring and no issuing thread: the step's stages in the step's order, each consumer warpgroup loading
//             its own (stages wg, wg + 4, ...) straight into registers with LDG.128 / LDG.32, D stages ahead
//             (one CTA of 512 threads per SM, as the step's computing warpgroups). It asks whether the step's
//             stream could run at a plain read's pace if its computing warpgroups loaded their weights themselves:
//             the ring has run 1.13-1.20x the LDG read with any address pattern (ring_bench.cu too).
// The L2 cache is flushed before every launch. Per pattern: the mean of 10 launches, and from one more launch
// traced, the issuing thread's gaps over 1 us summed per CTA (p50) and the gap before a tile's first stage (p50).
#include <stdio.h>

#include <algorithm>
#include <vector>

// The step's own PTX wrappers (mbarriers, bulk copies) and stage shape: kStageBytes, kCodeBytes, kTraceSlots.
#include "probe_kernel/cuda_step_ops.cuh"
#include "../common/bench_common.cuh"  // flushed_mean_us, ldg_read

constexpr int kDepth = 20, kH = 4096, kI = 2048, kExperts = 256;
constexpr int kNb1 = kH / 128, kNb2 = kI / 128, kTpe1 = kI / 32, kTpe2 = kH / 64;

struct Weights {
  const uint8_t *c1, *s1, *c2, *s2;  // codes [E, tiles, blocks, 4096], scale words [E, tiles, blocks, 256]
  int experts[6];
};

struct Pattern {
  int linear;    // one contiguous stretch per CTA (the tile options below are then unused)
  int blocked;   // a CTA's tiles consecutive, not strided by the grid
  int in_order;  // a tile's stages in address order, not the K quarters in turn
  int poll;      // the step's cross-CTA counts: one warp per CTA spins on a global count (ld.relaxed.gpu) until
                 // every CTA has added its L1 tiles (red.release.gpu after each tile's last stage is read);
                 // 2: only the additions, red.release.gpu; 3: only the additions, red.relaxed.gpu (no fence)
  int reload;    // at each tile start the issuing thread waits for one word from the L2 cache (ld.global.cg, a zero
                 // its tile's address depends on), as a spilled register reloaded there whose line is not in L1 would
};

// How many of the n tiles CTA c of G takes, and its i-th: strided (c, c + G, ...) or blocked (consecutive).
__host__ __device__ int tile_count(int c, int G, int n, int blocked) {
  return blocked ? (c + 1) * n / G - c * n / G : (c < n ? (n - c + G - 1) / G : 0);
}
__host__ __device__ int tile_at(int c, int G, int n, int blocked, int i) {
  return blocked ? c * n / G + i : c + i * G;
}

// The 4 KB block where stage k of step tile j starts (tpe tiles per expert, nb blocks per tile): two blocks of each
// K quarter in turn, as the step takes them, or in address order.
__device__ __forceinline__ size_t stage_block(const int* experts, int j, int tpe, int nb, int k, int in_order) {
  const size_t tile = size_t(experts[j / tpe]) * tpe + j % tpe;
  return tile * nb + (in_order ? 2 * k : (k % 4) * (nb / 4) + k / 4 * 2);
}

__device__ __forceinline__ void issue(uint8_t* ring, uint64_t* full, uint64_t* empty, int u, const uint8_t* codes,
                                      const uint8_t* scales) {
  const int s = u % kDepth;
  mbar_wait(&empty[s], ((u / kDepth) & 1) ^ 1);
  mbar_expect_tx(&full[s], kStageBytes);
  bulk_load(ring + size_t(s) * kStageBytes, codes, kCodeBytes, &full[s]);
  bulk_load(ring + size_t(s) * kStageBytes + kCodeBytes, scales, kStageBytes - kCodeBytes, &full[s]);
}

__global__ void __launch_bounds__(576, 1) pattern_kernel(Weights w, Pattern p, uint32_t* count,
                                                         unsigned long long* sink, long long* trace) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(kDepth) * kStageBytes);
  uint64_t* empty = full + kDepth;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kDepth; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4);  // one arrival per warp of the consuming warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int G = gridDim.x, c = blockIdx.x, n1 = 6 * kTpe1, n2 = 6 * kTpe2;
  // this CTA's stages: the step's count (tiles of L1 then L2, strided) whatever the pattern
  const int stages = tile_count(c, G, n1, p.blocked) * kNb1 / 2 + tile_count(c, G, n2, p.blocked) * kNb2 / 2;
  if (threadIdx.x == 512) {  // the issuing thread
    int u = 0;
    auto stamp = [&]() {
      if (trace) {
        long long t;
        asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
        trace[size_t(c) * kTraceSlots + min(u, kTraceSlots - 1)] = t;
      }
      ++u;
    };
    if (p.linear) {  // the same number of stages from one contiguous stretch per CTA
      const size_t first = size_t(c) * 80;
      for (int k = 0; k < stages; ++k, stamp())
        issue(smem, full, empty, u, w.c1 + (first + k) * 8192, w.s1 + (first + k) * 512);
    } else {  // the CTA's L1 tiles, then its L2 tiles
      auto tiles = [&](int n, int tpe, int nb, const uint8_t* codes, const uint8_t* scales) {
        for (int i = 0; i < tile_count(c, G, n, p.blocked); ++i) {
          const int j = tile_at(c, G, n, p.blocked, i);
          uint32_t zero = 0;
          if (p.reload) asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(zero) : "l"(count + 32 + c) : "memory");
          for (int k = 0; k < nb / 2; ++k, stamp()) {  // stage k: blocks blk, blk + 1 of the tile
            const size_t blk = stage_block(w.experts, j, tpe, nb, k, p.in_order) + zero;
            issue(smem, full, empty, u, codes + blk * 4096, scales + blk * 256);
          }
        }
      };
      tiles(n1, kTpe1, kNb1, w.c1, w.s1);
      tiles(n2, kTpe2, kNb2, w.c2, w.s2);
    }
  } else if (threadIdx.x == 544 && p.poll == 1) {  // the spinning warp (its other lanes idle, as in the step)
    uint32_t now;
    do {
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(count) : "memory");
    } while (now < uint32_t(n1));
  } else if (threadIdx.x < 512) {  // four consumer warpgroups: stages wg, wg + 4, ...
    unsigned long long x = 0;
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    const int l1_stages = tile_count(c, G, n1, p.blocked) * kNb1 / 2;
    for (int u = wg; u < stages; u += 4) {
      const int s = u % kDepth;
      mbar_wait(&full[s], (u / kDepth) & 1);
      x ^= reinterpret_cast<const uint32_t*>(smem + size_t(s) * kStageBytes)[t];
      __syncwarp();
      if (t % 32 == 0)
        mbar_arrive(&empty[s]);
      if (p.poll && t == 0 && u < l1_stages && u % (kNb1 / 2) == kNb1 / 2 - 1) {  // an L1 tile's last stage
        if (p.poll == 3)
          asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
        else
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
      }
    }
    if (x == 0x12345) sink[0] = x;
  }
}

// The u-th stage of CTA c's list in the step's order (its L1 tiles, then its L2 tiles, strided by the grid; in a
// tile two blocks of each K quarter in turn): its 8 KB of codes and 512 bytes of scale words.
__device__ __forceinline__ void step_stage(const Weights& w, const int* experts, int c, int G, int u,
                                           const uint8_t*& codes, const uint8_t*& scales) {
  const int l1_stages = tile_count(c, G, 6 * kTpe1, 0) * kNb1 / 2;
  const bool l1 = u < l1_stages;
  const int v = l1 ? u : u - l1_stages, per_tile = (l1 ? kNb1 : kNb2) / 2, tpe = l1 ? kTpe1 : kTpe2;
  const int nb = l1 ? kNb1 : kNb2, j = tile_at(c, G, 0, 0, v / per_tile), k = v % per_tile;
  const size_t blk = stage_block(experts, j, tpe, nb, k, 0);
  codes = (l1 ? w.c1 : w.c2) + blk * 4096;
  scales = (l1 ? w.s1 : w.s2) + blk * 256;
}

// Case `regs D`: warpgroup wg streams stages wg, wg + 4, ... of the CTA's list into registers, D of them in flight:
// per stage a thread loads 4 x 16 bytes of codes (a warp 512 contiguous bytes per load) and one scale word.
// kFrag (case `frag D`): the codes as the step's layout hands them to a thread, 8 bytes of each of the stage's eight
// 1,024-byte group blocks (8 x LDG.64, a warp 256 contiguous bytes per load), as the step would load its A operand.
template <int D, bool kFrag>
__global__ void __launch_bounds__(512, 1) regs_kernel(Weights w, unsigned long long* sink) {
  __shared__ int experts[6];  // not the parameter's array: indexed at run time, it would be copied to the stack
  if (threadIdx.x < 6) experts[threadIdx.x] = w.experts[threadIdx.x];
  __syncthreads();
  const int G = gridDim.x, c = blockIdx.x, wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int stages = tile_count(c, G, 6 * kTpe1, 0) * kNb1 / 2 + tile_count(c, G, 6 * kTpe2, 0) * kNb2 / 2;
  uint4 cd[D][4];
  uint32_t sc[D];
  auto load = [&](int u, uint4 (&into)[4], uint32_t& s) {
    if (u >= stages) return;
    const uint8_t *codes, *scales;
    step_stage(w, experts, c, G, u, codes, scales);
    if constexpr (kFrag) {
      const uint2* src = reinterpret_cast<const uint2*>(codes) + t;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint2 a = __ldcs(src + 128 * (2 * j)), b = __ldcs(src + 128 * (2 * j + 1));
        into[j] = uint4{a.x, a.y, b.x, b.y};
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) into[j] = __ldcs(reinterpret_cast<const uint4*>(codes) + t + 128 * j);
    }
    s = __ldcs(reinterpret_cast<const uint32_t*>(scales) + t);
  };
#pragma unroll
  for (int d = 0; d < D; ++d) load(wg + 4 * d, cd[d], sc[d]);
  uint32_t x = 0;
  for (int u0 = wg; u0 < stages; u0 += 4 * D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (u0 + 4 * d >= stages) break;
#pragma unroll
      for (int j = 0; j < 4; ++j) x ^= cd[d][j].x ^ cd[d][j].y ^ cd[d][j].z ^ cd[d][j].w;
      x ^= sc[d];
      load(u0 + 4 * (d + D), cd[d], sc[d]);
    }
  }
  if (x == 0x12345) sink[0] = x;
}

__global__ void fill_random(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; x *= 3266489917u; x ^= x >> 16;
    p[i] = x;
  }
}

int main() {
  const size_t c1 = size_t(kExperts) * kTpe1 * kNb1 * 4096, c2 = size_t(kExperts) * kTpe2 * kNb2 * 4096;
  const size_t flush_bytes = 256u << 20;
  uint8_t *buf[4], *flush;
  const size_t sizes[4] = {c1, c1 / 16, c2, c2 / 16};
  for (int i = 0; i < 4; ++i) {
    if (cudaMalloc(&buf[i], sizes[i]) != cudaSuccess) { printf("cudaMalloc %zu failed\n", sizes[i]); return 1; }
    fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(buf[i]), sizes[i] / 4, 17u * i);
  }
  unsigned long long* sink;
  long long* trace;
  uint32_t* count;
  cudaMalloc(&count, 4096);  // [0] the polled count, [32 + c] CTA c's zero for reload
  cudaMemset(count, 0, 4096);
  cudaMalloc(&flush, flush_bytes);
  cudaMalloc(&sink, 8);
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaMalloc(&trace, size_t(sms) * kTraceSlots * 8);
  const int smem = kDepth * kStageBytes + 16 * kDepth;
  cudaFuncSetAttribute(pattern_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  auto elapsed_us = [&](auto launch) {  // the polled count reset before each launch, outside the timed span
    return flushed_mean_us(flush, flush_bytes, [&] { cudaMemsetAsync(count, 0, 4); }, launch);
  };
  struct Case { const char* name; int experts[6]; Pattern p; };
  const Case cases[] = {{"step", {183, 59, 202, 95, 89, 31}, {0, 0, 0, 0, 0}},
                        {"blocked", {183, 59, 202, 95, 89, 31}, {0, 1, 0, 0, 0}},
                        {"in-order", {183, 59, 202, 95, 89, 31}, {0, 0, 1, 0, 0}},
                        {"compact", {0, 1, 2, 3, 4, 5}, {0, 0, 0, 0, 0}},
                        {"linear", {0, 1, 2, 3, 4, 5}, {1, 0, 0, 0, 0}},
                        {"reload", {183, 59, 202, 95, 89, 31}, {0, 0, 0, 0, 1}},
                        {"polled", {183, 59, 202, 95, 89, 31}, {0, 0, 0, 1, 0}},
                        {"released", {183, 59, 202, 95, 89, 31}, {0, 0, 0, 2, 0}},
                        {"relaxed", {183, 59, 202, 95, 89, 31}, {0, 0, 0, 3, 0}},
                        {"step", {183, 59, 202, 95, 89, 31}, {0, 0, 0, 0, 0}}};
  const size_t step_bytes = size_t(6) * (kTpe1 * kNb1 + kTpe2 * kNb2) * (4096 + 256);
  const float ldg_us = elapsed_us([&] {
    ldg_read<<<4 * sms, 512>>>(reinterpret_cast<const uint4*>(buf[0]), step_bytes / 16, sink);
  });
  printf("%-8s %.1f us for %.1f MB (%.2f TB/s)\n", "LDG read", ldg_us, step_bytes / 1e6, step_bytes / ldg_us / 1e6);
  for (const Case& cs : cases) {
    Weights w{buf[0], buf[1], buf[2], buf[3], {}};
    std::copy(cs.experts, cs.experts + 6, w.experts);
    const float us = elapsed_us([&] { pattern_kernel<<<sms, 576, smem>>>(w, cs.p, count, sink, nullptr); });
    cudaMemset(trace, 0, size_t(sms) * kTraceSlots * 8);
    cudaMemsetAsync(count, 0, 4);
    cudaMemsetAsync(flush, 99, flush_bytes);
    pattern_kernel<<<sms, 576, smem>>>(w, cs.p, count, sink, trace);
    std::vector<long long> tr(size_t(sms) * kTraceSlots);
    cudaMemcpy(tr.data(), trace, tr.size() * 8, cudaMemcpyDeviceToHost);
    std::vector<double> stops, at_tile;
    for (int c = 0; c < sms; ++c) {
      double total = 0;
      const int l1_stages = tile_count(c, sms, 6 * kTpe1, cs.p.blocked) * kNb1 / 2;
      for (int k = 1; k < kTraceSlots && tr[size_t(c) * kTraceSlots + k] > 0; ++k) {
        const double gap = (tr[size_t(c) * kTraceSlots + k] - tr[size_t(c) * kTraceSlots + k - 1]) / 1e3;
        if (gap > 1.0) total += gap;
        const bool tile_start = k < l1_stages ? k % (kNb1 / 2) == 0 : (k - l1_stages) % (kNb2 / 2) == 0;
        if (tile_start && !cs.p.linear) at_tile.push_back(gap);
      }
      stops.push_back(total);
    }
    std::sort(stops.begin(), stops.end());
    std::sort(at_tile.begin(), at_tile.end());
    printf("%-8s %.1f us (%.2fx the LDG read); the issuing thread's gaps over 1 us per CTA p50 %.2f us; "
           "before a tile's first stage p50 %.2f\n",
           cs.name, us, us / ldg_us, stops[stops.size() / 2], at_tile.empty() ? 0.0 : at_tile[at_tile.size() / 2]);
  }
  Weights w{buf[0], buf[1], buf[2], buf[3], {183, 59, 202, 95, 89, 31}};
  auto regs = [&](const char* name, auto kernel) {
    const float us = elapsed_us([&] { kernel<<<sms, 512>>>(w, sink); });
    printf("%-8s %.1f us (%.2fx the LDG read)\n", name, us, us / ldg_us);
  };
  regs("regs 1", regs_kernel<1, false>);
  regs("regs 2", regs_kernel<2, false>);
  regs("regs 3", regs_kernel<3, false>);
  regs("regs 4", regs_kernel<4, false>);
  regs("frag 1", regs_kernel<1, true>);
  regs("frag 2", regs_kernel<2, true>);
  regs("frag 4", regs_kernel<4, true>);
  regs("regs 2", regs_kernel<2, false>);  // again, after the others: the spread between two launches of one kernel
  const float ldg_again = elapsed_us([&] {
    ldg_read<<<4 * sms, 512>>>(reinterpret_cast<const uint4*>(buf[0]), step_bytes / 16, sink);
  });
  printf("%-8s %.1f us again (%.2fx the first)\n", "LDG read", ldg_again, ldg_again / ldg_us);
  printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
