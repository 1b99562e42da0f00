// The roofline's fastest read as a library (megamoe/bench/read_cuda.py builds it with nvcc and calls it through
// ctypes): one persistent launch of `blocks` x kThreads threads striding over the buffer in 16-byte words, every
// load a 128-bit non-caching load of the read-only path (ld.global.nc.L1::no_allocate.v4.u32: no L1 line kept
// for bytes that are read once), kUnroll of them in flight per thread per step of the loop. Each block writes the
// xor of every word it read to out[block], so no load is dead code and a caller can check that every word was
// read exactly once (the xor of out is the xor of the buffer).
//
//   thread t of block b, grid G = blocks x kThreads, global index g = b x kThreads + t:
//     16-byte words g, g + G, g + 2G, ... of the buffer's first n / 4 x 16 bytes
//     block 0's threads 0..2: the n % 4 int32 words after them (a word count that is not a multiple of 4)

#include <cstdint>

#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 128;  // threads per block: 16 blocks of 128 fill an SM's 2048 threads
constexpr int kUnroll = 4;     // 16-byte loads each thread issues before it uses any: 64 bytes in flight a thread

__device__ __forceinline__ uint4 load_nc(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t xor_of(const uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

__global__ void __launch_bounds__(kThreads) read_kernel(const uint4* __restrict__ src, const int64_t n16,
                                                        const uint32_t* __restrict__ tail, const int tail_words,
                                                        uint32_t* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kUnroll - 1) * stride < n16; i += kUnroll * stride) {  // kUnroll whole grid strides at a time
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_nc(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= xor_of(v[u]);
  }
  for (; i < n16; i += stride) acc ^= xor_of(load_nc(src + i));  // the last < kUnroll strides
  if (blockIdx.x == 0 && int(threadIdx.x) < tail_words) acc ^= tail[threadIdx.x];

  for (int lane = 16; lane > 0; lane /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, lane);
  __shared__ uint32_t warp_xor[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_xor[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t block_xor = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) block_xor ^= warp_xor[w];
    out[blockIdx.x] = block_xor;
  }
}

}  // namespace

extern "C" {

int megamoe_read_threads() { return kThreads; }

// Read the `words` int32 words at `src` (16-byte aligned) once with `blocks` blocks on `stream` (a cudaStream_t) of
// device `device`; out[blocks] gets each block's xor. Returns 0 or the CUDA error code of the launch.
int megamoe_read_launch(int device, const void* src, long long words, void* out, int blocks, void* stream) {
  const cudaError_t set = cudaSetDevice(device);
  if (set != cudaSuccess) return int(set);
  const int64_t n16 = words / 4;
  const uint32_t* tail = static_cast<const uint32_t*>(src) + n16 * 4;
  read_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(src), n16, tail, int(words % 4), static_cast<uint32_t*>(out));
  return int(cudaGetLastError());
}

}  // extern "C"
