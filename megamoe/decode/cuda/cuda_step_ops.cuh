// Building blocks of the 1-token CUDA step (cuda_step.cu): PTX wrappers (mbarriers, bulk copies, wgmma), the
// numerics it shares with the Triton kernels, the ring of stages and a stage's tensor-core sums.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// A stage: two consecutive 128-K blocks of a tile (each four 1,024-byte code blocks), then their scale words (64 per
// block). Both runs are contiguous in layout_tc.py, so a stage is two bulk copies: fewer, larger copies stream
// faster (lab/cuda_step/ring_bench.cu: one copy costs the issuing thread about as much as 4 KB takes to land).
constexpr int kBlocks = 2;
constexpr int kCodeBytes = kBlocks * 4096;
constexpr int kStageBytes = kCodeBytes + kBlocks * 256;
constexpr int kParts = 4;                         // computing warpgroups, each a quarter of every tile's K
constexpr int kComputeThreads = 128 * kParts;
constexpr int kThreads = kComputeThreads + 128;   // and a warpgroup of a load warp, two signal warps, one idle
constexpr int kComputeRegs = 112, kOtherRegs = 32;  // registers per thread after setmaxnreg: the 640 x 96
                                                    // the CTA has, 4 x 128 x 112 + 128 x 32 of them
constexpr int kMaxTerms = 48;  // terms of a tile's last three quarters: gate/up 3 H/512 blocks, down 3 I/128 groups
constexpr int kMaxTopK = 8;
constexpr int kPad = 160;                       // B reads up to 143 bytes past a k32 step's start

// ---- PTX wrappers ------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
                   smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// B descriptor, K-major, no swizzle: start address, LBO (between the two 16-byte K halves of a row) = 16, SBO =
// 128 (unused with N = 8).
__device__ __forceinline__ uint64_t b_desc(const uint8_t* p) {
  uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(16 >> 4) << 16) | (uint64_t(128 >> 4) << 32);
}

// D = A * B for one k32 step (scale-d 0: no accumulator), A in registers: four e4m3x4 words per thread.
__device__ __forceinline__ void wgmma_k32(float d[4], const uint32_t a[4], uint64_t desc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// ---- numerics shared with the Triton kernels -----------------------------------------------------------------------

// A stored byte holds the codes of rows ri (lo) and ri + 8 (hi); -> e4m3 bytes worth e2m1 * 2**-6
// (layout_tc.pack_pair), four bytes at once.
__device__ __forceinline__ uint32_t decode_lo(uint32_t b) { return b & 0x9C9C9C9Cu; }
__device__ __forceinline__ uint32_t decode_hi(uint32_t b) {
  return ((b << 2) & 0x8C8C8C8Cu) | ((b >> 2) & 0x10101010u);
}

// Byte g of a scale word (s + 6) -> the factor 2**(s - 121): the byte is the FP32 exponent field.
__device__ __forceinline__ float factor(uint32_t word, int g) {
  return __uint_as_float(((word >> (8 * g)) & 0xFFu) << 23);
}

__device__ __forceinline__ uint16_t bf16_bits(float v) {  // triton_gemv._bf16_bits: RNE on the bits
  int32_t b = __float_as_int(v);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

__device__ __forceinline__ uint8_t e4m3_rtne_bits(float q) {  // staging.triton_stage._e4m3_rtne_bits
  int32_t b = __float_as_int(q);
  int32_t sign = (b >> 24) & 0x80;
  int32_t a = b & 0x7FFFFFFF;
  int32_t normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960;
  int32_t e = a >> 23;
  int32_t s = min(141 - e, 31);
  int32_t mant = (a & 0x7FFFFF) | 0x800000;
  int32_t sub = (mant + ((1 << (s - 1)) - 1) + ((mant >> s) & 1)) >> s;
  int32_t code = a >= 0x3C800000 ? normal : sub;
  return static_cast<uint8_t>(code | sign);
}

// ---- the ring: stages in, stages out, a stage's sums ---------------------------------------------------------------

struct Ring {
  uint8_t* data;
  uint64_t* full;
  uint64_t* empty;
  int stages;
};

struct Cursor {  // a stage of the ring and the parity of its current round
  int stage;
  uint32_t phase;
  __device__ __forceinline__ void advance(int step, int stages) {
    stage += step;
    if (stage >= stages) {
      stage -= stages;
      phase ^= 1;
    }
  }
};

// The warpgroup is done with its stage: one arrival per warp frees it; on to its next (stages go round the parts).
__device__ __forceinline__ void stage_release(const Ring& ring, Cursor& cur, int tid) {
  __syncwarp();
  if (tid % 32 == 0) mbar_arrive(&ring.empty[cur.stage]);
  cur.advance(kParts, ring.stages);
}

// Wait for this warpgroup's next stage, then the tensor-core sums of its kBlocks blocks, each group's already times
// its factor (exact), for rows r0 = 16 warp + lane / 4 and r0 + 8: dg[j][g][0] (block j, group g, row r0),
// dg[j][g][1] (row r0 + 8). Valid in lanes with lane % 4 == 0 (column 0). desc: the B descriptor of the stage's first
// k32 step (the next steps' codes follow 32 bytes apart, one descriptor unit of 16 bytes is 2). Each thread reads its
// 8 bytes of each of the kBlocks x 4 group blocks (v, the A operand's codes in fragment order) and the scale words of
// its two rows in each block (w); the stage is freed as soon as they are decoded, before the MMAs (the weights are the
// MMAs' A operand in registers, and B lies outside the ring). All kBlocks x 4 MMAs go out together and are waited for
// once.
__device__ __forceinline__ void stage_sums(const Ring& ring, Cursor& cur, int tid, uint64_t desc,
                                           float dg[kBlocks][4][2]) {
  mbar_wait(&ring.full[cur.stage], cur.phase);
  const uint8_t* stage = ring.data + size_t(cur.stage) * kStageBytes;
  const int r0 = 16 * (tid / 32) + (tid % 32) / 4;
  uint2 v[kBlocks][4];
  uint32_t w[kBlocks][2];
#pragma unroll
  for (int j = 0; j < kBlocks; ++j) {
#pragma unroll
    for (int g = 0; g < 4; ++g) v[j][g] = *reinterpret_cast<const uint2*>(stage + j * 4096 + g * 1024 + 8 * tid);
    const uint8_t* words = stage + kCodeBytes + j * 256;
    w[j][0] = *reinterpret_cast<const uint32_t*>(words + 4 * r0);
    w[j][1] = *reinterpret_cast<const uint32_t*>(words + 4 * (r0 + 8));
  }
  uint32_t a[kBlocks * 4][4];
#pragma unroll
  for (int j = 0; j < kBlocks; ++j)
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      a[4 * j + g][0] = decode_lo(v[j][g].x);  // row r0, K 4 lq .. 4 lq + 3
      a[4 * j + g][1] = decode_hi(v[j][g].x);  // row r0 + 8
      a[4 * j + g][2] = decode_lo(v[j][g].y);  // row r0, K 16 + 4 lq ..
      a[4 * j + g][3] = decode_hi(v[j][g].y);
    }
  stage_release(ring, cur, tid);  // the decode has consumed every byte the stage held for this thread
  float d[kBlocks * 4][4];
#pragma unroll
  for (int m = 0; m < kBlocks * 4; ++m) {  // every operand ready before the fence: no MMA waits on a late decode
    d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.f;
    asm volatile("" : "+r"(a[m][0]), "+r"(a[m][1]), "+r"(a[m][2]), "+r"(a[m][3]), "+f"(d[m][0]), "+f"(d[m][1]),
                 "+f"(d[m][2]), "+f"(d[m][3])::"memory");
  }
  wgmma_fence();
#pragma unroll
  for (int m = 0; m < kBlocks * 4; ++m) wgmma_k32(d[m], a[m], desc + 2 * m);
  wgmma_commit();
  wgmma_wait0();
#pragma unroll
  for (int m = 0; m < kBlocks * 4; ++m)  // the results are read only after the wait
    asm volatile("" : "+f"(d[m][0]), "+f"(d[m][1]), "+f"(d[m][2]), "+f"(d[m][3])::"memory");
#pragma unroll
  for (int j = 0; j < kBlocks; ++j)
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      dg[j][g][0] = __fmul_rn(d[4 * j + g][0], factor(w[j][0], g));
      dg[j][g][1] = __fmul_rn(d[4 * j + g][2], factor(w[j][1], g));
    }
}

// A count another CTA raises (release) reaches `target`: one thread polls it relaxed, then one acquire fence (an
// acquire load in the loop would invalidate the SM's L1 cache at every poll, spilled registers included); the caller's
// barrier passes the order on to the rest of its threads.
__device__ __forceinline__ void wait_count(const uint32_t* count, uint32_t target) {
  uint32_t now;
  do {
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(count) : "memory");
  } while (now < target);
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ void wait_count_cta(const uint32_t* count, uint32_t target) {  // shared memory
  uint32_t now;
  do {
    asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];" : "=r"(now) : "r"(smem_addr(count)) : "memory");
  } while (now < target);
}

__device__ __forceinline__ void store_release_cta(uint32_t* count, uint32_t v) {  // shared memory
  asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(smem_addr(count)), "r"(v) : "memory");
}

__device__ __forceinline__ void add_release(uint32_t* count, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(count), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t atomic_add_acq_rel(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

}  // namespace
