// The 1-token decode step in one persistent launch (recipe megamoe-decode-tc, the same bits as the three Triton
// launches of megamoe/decode/triton_tc.py). Python side: megamoe/decode/cuda_step1.py (build, checks, launch).
//
// One CTA per SM, 544 threads: four warpgroups compute, the last warp loads. The CTA's work is a list of stages
// (two 128-K blocks of one 64-row tile each: 2 x 4,096 code bytes and 2 x 256 scale bytes, contiguous in
// layout_tc.py): L1 tiles (item i, channel tile t) for tile = blockIdx.x, + gridDim.x, ...; then L2 tiles the same
// way. The load warp streams the list through a ring of stages (cp.async.bulk, one mbarrier per stage each way),
// waiting on nothing but free stages, so it runs on into L2's weights while L1 still computes: at the grid barrier
// between L1 and L2 the ring already holds the first of this CTA's L2 stages.
//
// A tile's K is split in quarters, one per warpgroup: warpgroup 0 keeps the running promotion sum of the first
// quarter, the others store each term of theirs in shared memory, and warpgroup 0 replays them in ascending K, the
// same FP32 additions as one unsplit chain (triton_tc._replay does the same across programs).
//
// Numerics per 32-K group g (recipe megamoe-decode-tc): d_g = wgmma m64n8k32 e4m3 from a zero accumulator (the
// weights decoded in registers as the A operand, the token's codes as column 0 of B); d'_g = d_g * 2**(s - 121)
// (exact); L1: blk = ((d'_0 + d'_1) + d'_2) + d'_3, acc = fl32(acc + fl32(x_sf * blk)) per 128-K block; L2:
// acc = fl32(acc + fl32(d'_g * sf2_g)) per group. The L1 epilogue (SwiGLU, routing weight, FP8 requant per 32
// channels) and the combine (slot-ordered FP32 sum, one bf16 rounding) are triton_tc._l1_epilogue's and
// triton_combine.combine_tile's, operation for operation.
//
// B operand without a zero-filled tile: column 0 is all that is read back, so B is the token's codes themselves
// with rows 16 bytes apart (LBO = 16): B[k][n] = codes[k0 + k + 16 n]. Columns 1..7 hold other codes and their
// results are never used.

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// A stage: two consecutive 128-K blocks of a tile (each four 1,024-byte code blocks), then their scale words (64 per
// block). Both runs are contiguous in layout_tc.py, so a stage is two bulk copies: fewer, larger copies stream
// faster (bench/device/stream_ring_bench.cu: one copy costs the issuing thread about as much as 4 KB takes to land).
constexpr int kBlocks = 2;
constexpr int kCodeBytes = kBlocks * 4096;
constexpr int kStageBytes = kCodeBytes + kBlocks * 256;
constexpr int kParts = 4;                         // computing warpgroups, each a quarter of every tile's K
constexpr int kComputeThreads = 128 * kParts;
constexpr int kThreads = kComputeThreads + 32;    // and one load warp
constexpr int kMaxTerms = 48;  // terms of a tile's last three quarters: L1 3 H/512 blocks, L2 3 I/128 groups
constexpr int kMaxTopK = 8;
constexpr int kPad = 160;
constexpr int kTraceSlots = 160;                // B reads up to 143 bytes past a k32 step's start

struct Params {
  const uint8_t* l1_codes;   // [E, I/32, H/32, 1024]
  const uint8_t* l1_scales;  // [E, I/32, H/128, 256]
  const uint8_t* l2_codes;   // [E, H/64, I/32, 1024]
  const uint8_t* l2_scales;  // [E, H/64, I/128, 256]
  const uint8_t* x_q;        // e4m3 [H]      (token 0 of the staged buffers)
  const float* x_sf;         // fp32 [H/128]
  const int64_t* topk_idx;   // [K]
  const float* topk_w;       // [K]
  int32_t* num_touched;      // route's outputs (routing.route_torch), for L2-combine readers and checks
  int32_t* touched;
  int32_t* seg_start;
  int32_t* seg_count;
  int32_t* row_token;
  float* row_weight;
  int32_t* slot_row;
  uint8_t* l2_q;       // [S, I]
  float* l2_sf;        // [S, I/32]
  uint16_t* slot_out;  // bf16 bits [S, H]
  uint16_t* y;         // bf16 bits [H]
  uint32_t* sync;      // [2 + H/64]: the grid barrier's 64-bit count, combine counts per 64 columns
  int64_t* stamps;     // [gridDim.x, 8] or null: when each CTA reached points 0..6 (%globaltimer, ns)
  int64_t* trace;      // [gridDim.x, 1 + kParts, kTraceSlots] or null: when the load warp issued each stage (row
                       // 0) and when warpgroup w found each of its stages landed (row 1 + w)
  float clamp;
  int H, I, K, expert_lo, num_local, stages;
  int mode;            // kMode* flags (0: the step itself)
  int inflight;        // stages the load warp keeps on their way at most (0: as many as the ring has free)
};

// Probe flags (Params::mode). Bare: stream every block, skip the decode and the MMAs (y is wrong); no scales and
// rotate (bare only): leave out the 256-byte scale copies, or start each CTA's tiles at its own block.
constexpr int kModeBare = 1, kModeNoScales = 2, kModeRotate = 4, kModeCpAsync = 8;

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

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// Arrive on bar once this thread's earlier cp.async copies have landed (the barrier counts it as one arrival).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
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

// ---- the CTA's share of one tile's K blocks ------------------------------------------------------------------------

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

__device__ __forceinline__ void trace(int64_t* tr, int row, int& n) {
  if (tr != nullptr) {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    tr[(blockIdx.x * (1 + kParts) + row) * kTraceSlots + min(n, kTraceSlots - 1)] = int64_t(t);
  }
  ++n;
}

// Wait for this warpgroup's next stage (``cur``) -> its bytes.
__device__ __forceinline__ const uint8_t* stage_wait(const Ring& ring, const Cursor& cur, int tid, int64_t* tr, int row,
                                                     int& n) {
  mbar_wait(&ring.full[cur.stage], cur.phase);
  if (tid == 0) trace(tr, row, n);
  return ring.data + size_t(cur.stage) * kStageBytes;
}

// The warpgroup is done with its stage: one arrival per warp frees it; on to its next (stages go round the parts).
__device__ __forceinline__ void stage_release(const Ring& ring, Cursor& cur, int tid) {
  __syncwarp();
  if (tid % 32 == 0) mbar_arrive(&ring.empty[cur.stage]);
  cur.advance(kParts, ring.stages);
}

// The four groups' tensor-core sums of block j of a stage, each already times its factor (exact), for rows
// r0 = 16 warp + lane / 4 and r0 + 8: dg[g][0] (row r0), dg[g][1] (row r0 + 8). Valid in lanes with lane % 4 == 0
// (column 0). bsrc: the B codes of the block's first k32 step.
__device__ __forceinline__ void block_sums(const uint8_t* stage, int j, int tid, const uint8_t* bsrc, float dg[4][2],
                                           bool bare) {
  const uint8_t* blk = stage + j * 4096;
  uint2 v[4];
#pragma unroll
  for (int g = 0; g < 4; ++g) v[g] = *reinterpret_cast<const uint2*>(blk + g * 1024 + 8 * tid);
  const int r0 = 16 * (tid / 32) + (tid % 32) / 4;
  const uint8_t* words = stage + kCodeBytes + j * 256;
  const uint32_t w0 = *reinterpret_cast<const uint32_t*>(words + 4 * r0);
  const uint32_t w1 = *reinterpret_cast<const uint32_t*>(words + 4 * (r0 + 8));
  if (bare) {
#pragma unroll
    for (int g = 0; g < 4; ++g) dg[g][0] = dg[g][1] = __uint_as_float(v[g].x ^ v[g].y ^ w0 ^ w1) * 0.f;
    return;
  }
  uint32_t a[4][4];
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    a[g][0] = decode_lo(v[g].x);  // row r0, K 4 lq .. 4 lq + 3
    a[g][1] = decode_hi(v[g].x);  // row r0 + 8
    a[g][2] = decode_lo(v[g].y);  // row r0, K 16 + 4 lq ..
    a[g][3] = decode_hi(v[g].y);
  }
  float d[4][4];
#pragma unroll
  for (int g = 0; g < 4; ++g) {  // every operand ready before the fence: no MMA waits on a late decode
    d[g][0] = d[g][1] = d[g][2] = d[g][3] = 0.f;
    asm volatile("" : "+r"(a[g][0]), "+r"(a[g][1]), "+r"(a[g][2]), "+r"(a[g][3]), "+f"(d[g][0]), "+f"(d[g][1]),
                 "+f"(d[g][2]), "+f"(d[g][3])::"memory");
  }
  wgmma_fence();
#pragma unroll
  for (int g = 0; g < 4; ++g) wgmma_k32(d[g], a[g], b_desc(bsrc + 32 * g));
  wgmma_commit();
  wgmma_wait0();
#pragma unroll
  for (int g = 0; g < 4; ++g)  // the results are read only after the wait
    asm volatile("" : "+f"(d[g][0]), "+f"(d[g][1]), "+f"(d[g][2]), "+f"(d[g][3])::"memory");
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    dg[g][0] = __fmul_rn(d[g][0], factor(w0, g));
    dg[g][1] = __fmul_rn(d[g][2], factor(w1, g));
  }
}

struct Items {  // the step's valid slots in slot order: item i is slot item_slot[i] (T = 1: one row each)
  int n;
  int expert[kMaxTopK];
  int row[kMaxTopK];
  float weight[kMaxTopK];
  int slot_row[kMaxTopK];  // per slot: its pool row or -1
};

__device__ __forceinline__ void stamp(const Params& p, int point) {
  if (p.stamps != nullptr) {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    p.stamps[blockIdx.x * 8 + point] = int64_t(t);
  }
}

// One grid-wide barrier: each CTA adds one to a 64-bit count (release) and waits until the count reaches the end
// of its round of gridDim.x arrivals (acquire). The count only grows (2**64 arrivals never wrap), so no reset.
__device__ void grid_barrier(unsigned long long* count) {
  unsigned long long old;
  asm volatile("atom.add.release.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(count) : "memory");
  const unsigned long long target = (old / gridDim.x + 1) * gridDim.x;
  unsigned long long now;
  do {
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(now) : "l"(count) : "memory");
  } while (now < target);
}

__device__ __forceinline__ uint32_t atomic_add_acq_rel(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Route's outputs for the step (routing.route_torch's, bit for bit), and y = 0 when no slot is routed here.
__device__ void write_route(const Params& p, const int* ex, const Items& it) {
  int nt = 0;
  for (int k = 0; k < p.K; ++k) {
    if (ex[k] < 0) continue;
    p.slot_row[k] = it.slot_row[k];
    p.row_token[it.slot_row[k]] = 0;
    p.row_weight[it.slot_row[k]] = p.topk_w[k];
  }
  for (int k = 0; k < p.K; ++k) {
    if (ex[k] >= 0) continue;
    p.slot_row[k] = -1;
  }
  for (int k = 0; k < p.K; ++k) {  // distinct experts ascending, each with its first row and count
    if (ex[k] < 0) continue;
    bool first = true;
    for (int j = 0; j < k; ++j) first &= ex[j] != ex[k];
    if (!first) continue;
    int below = 0, cnt = 0, rank = 0;
    for (int j = 0; j < p.K; ++j) {
      below += ex[j] >= 0 && ex[j] < ex[k];
      cnt += ex[j] == ex[k];
    }
    for (int j = 0; j < p.K; ++j) {  // rank among distinct experts
      bool firstj = ex[j] >= 0 && ex[j] < ex[k];
      for (int m = 0; m < j && firstj; ++m) firstj &= ex[m] != ex[j];
      rank += firstj;
    }
    p.touched[rank] = ex[k];
    p.seg_start[rank] = below;
    p.seg_count[rank] = cnt;
    ++nt;
  }
  *p.num_touched = nt;
  if (it.n == 0)
    for (int c = 0; c < p.H; ++c) p.y[c] = 0;
}

__global__ void __launch_bounds__(kThreads, 1) step1_kernel(const Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int H = p.H, I = p.I;
  const int nb1 = H / 128, nb2 = I / 128;  // K blocks of an L1 / L2 tile
  const int tpe1 = I / 32, tpe2 = H / 64;  // tiles per expert
  // shared memory: ring | x codes | L2 input codes per routed row | terms x2 | epilogue | x_sf | sf2 | bars
  uint8_t* ring_data = smem;
  uint8_t* xs = ring_data + size_t(p.stages) * kStageBytes;
  uint8_t* hs = xs + H + kPad;
  float* terms = reinterpret_cast<float*>(hs + kMaxTopK * (I + kPad));
  float* ep = terms + 2 * kMaxTerms * 64;
  float* xsf = ep + 64;
  float* sf2 = xsf + nb1;
  int* flag = reinterpret_cast<int*>(sf2 + kMaxTopK * I / 32);
  uint64_t* bars = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(flag + 4) + 7) & ~uintptr_t(7));
  Ring ring{ring_data, bars, bars + p.stages, p.stages};

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(&ring.full[s], (p.mode & kModeCpAsync) ? 32 : 1);  // the loading lanes, or one expect_tx
      mbar_init(&ring.empty[s], 4);  // one arrival per warp of the warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the barriers: the load warp starts as soon as it knows the step's experts
  // The step's routing, computed by every thread (K <= 8 slots of one token): the valid slots in slot order, and
  // each one's pool row as routing.route_torch numbers them (stable by expert).
  Items it;
  it.n = 0;
  int ex[kMaxTopK];
  float tw[kMaxTopK];
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {  // unrolled: the slots' loads go out together
    const int64_t e = k < p.K ? p.topk_idx[k] - p.expert_lo : -1;
    ex[k] = (e >= 0 && e < p.num_local) ? int(e) : -1;
    tw[k] = k < p.K ? p.topk_w[k] : 0.f;
  }
  for (int k = 0; k < p.K; ++k) {
    int row = -1;
    if (ex[k] >= 0) {
      row = 0;
      for (int j = 0; j < p.K; ++j) row += ex[j] >= 0 && (ex[j] < ex[k] || (ex[j] == ex[k] && j < k));
      it.expert[it.n] = ex[k];
      it.row[it.n] = row;
      it.weight[it.n] = tw[k];
      ++it.n;
    }
    it.slot_row[k] = row;
  }
  if (tid < kComputeThreads) {  // the token's codes and scales; pad past the end with zeros
    for (int c = tid; c < H / 16; c += kComputeThreads)
      reinterpret_cast<uint4*>(xs)[c] = reinterpret_cast<const uint4*>(p.x_q)[c];
    for (int c = tid; c < kPad / 16; c += kComputeThreads) reinterpret_cast<uint4*>(xs + H)[c] = uint4{0, 0, 0, 0};
    for (int c = tid; c < nb1; c += kComputeThreads) xsf[c] = p.x_sf[c];
    for (int c = tid; c < kMaxTopK * (I + kPad) / 16; c += kComputeThreads)  // the pads stay zero
      reinterpret_cast<uint4*>(hs)[c] = uint4{0, 0, 0, 0};
    fence_async_smem();
  }

  const int n1 = it.n * tpe1, n2 = it.n * tpe2;  // L1 / L2 tiles of the step
  if (tid == 0) stamp(p, 0);  // set up
  if (tid >= kComputeThreads) {  // ---- the last warp: the loads ----
    const int lane = tid - kComputeThreads;
    const bool cp_async = p.mode & kModeCpAsync;
    if (!cp_async && lane != 0) {  // one lane issues the bulk copies; another writes route's outputs
      if (lane == 1 && blockIdx.x == 0) write_route(p, ex, it);
      return;
    }
    if (cp_async && lane == 0 && blockIdx.x == 0) write_route(p, ex, it);
    Cursor cur{0, 1};  // a fresh barrier passes a wait on parity 1: the first round finds every stage free
    Cursor lag{0, 0};  // the stage issued `inflight` stages ago, whose landing the next issue waits for
    int traced = 0;
    uint32_t issued = 0;
    auto issue = [&](const uint8_t* codes, const uint8_t* scales) {
      const int s = cur.stage;
      uint8_t* dst = ring.data + size_t(s) * kStageBytes;
      if (lane == 0) {
        mbar_wait(&ring.empty[s], cur.phase);
        if (p.inflight && issued >= uint32_t(p.inflight)) {  // at most `inflight` stages still on their way
          mbar_wait(&ring.full[lag.stage], lag.phase);
          lag.advance(1, ring.stages);
        }
      }
      ++issued;
      if (cp_async) __syncwarp();
      if (cp_async) {  // 16 bytes per lane and copy; each lane's arrival fires once its copies have landed
        for (int c = lane; c < kStageBytes / 16; c += 32)
          cp_async16(dst + 16 * c, c < kCodeBytes / 16 ? codes + 16 * c : scales + 16 * (c - kCodeBytes / 16));
        cp_async_arrive(&ring.full[s]);
      } else if (lane == 0) {
        const bool scales_too = !(p.mode & kModeNoScales);
        mbar_expect_tx(&ring.full[s], scales_too ? kStageBytes : kCodeBytes);
        bulk_load(dst, codes, kCodeBytes, &ring.full[s]);
        if (scales_too) bulk_load(dst + kCodeBytes, scales, kStageBytes - kCodeBytes, &ring.full[s]);
      }
      cur.advance(1, ring.stages);
      if (lane == 0) trace(p.trace, 0, traced);
    };
    const int rot = (p.mode & kModeRotate) ? blockIdx.x : 0;  // (bare probes) each CTA starts at its own block
    for (int tile = blockIdx.x; tile < n1; tile += gridDim.x) {
      const size_t base = size_t(it.expert[tile / tpe1]) * tpe1 + tile % tpe1;
      for (int b = 0; b < nb1 / kParts; b += kBlocks)
        for (int q = 0; q < kParts; ++q) {
          const size_t blk = base * nb1 + q * (nb1 / kParts) + (b + rot * kBlocks) % (nb1 / kParts);
          issue(p.l1_codes + blk * 4096, p.l1_scales + blk * 256);
        }
    }
    if (lane == 0) stamp(p, 1);  // the last L1 block asked for
    for (int tile = blockIdx.x; tile < n2; tile += gridDim.x) {
      const size_t base = size_t(it.expert[tile / tpe2]) * tpe2 + tile % tpe2;
      for (int b = 0; b < nb2 / kParts; b += kBlocks)
        for (int q = 0; q < kParts; ++q) {
          const size_t blk = base * nb2 + q * (nb2 / kParts) + (b + rot * kBlocks) % (nb2 / kParts);
          issue(p.l2_codes + blk * 4096, p.l2_scales + blk * 256);
        }
    }
    if (lane == 0) stamp(p, 2);  // the last L2 block asked for
    return;
  }

  // ---- the computing warpgroups: decode, MMA, promotion ----
  named_sync(1, kComputeThreads);  // the token's codes in shared memory
  const int wg = tid / 128, t = tid % 128;
  const int r0 = 16 * (t / 32) + (t % 32) / 4;
  const bool col0 = (t % 4) == 0;  // lanes holding column 0 (the token)
  Cursor cur{wg, 0};               // this warpgroup's stages are the CTA's list's wg, wg + kParts, ...
  int traced = 0;
  int tiles_done = 0;

  for (int tile = blockIdx.x; tile < n1; tile += gridDim.x, ++tiles_done) {  // ---- L1 ----
    const int item = tile / tpe1, ct = tile % tpe1;
    float* tb = terms + (tiles_done & 1) * kMaxTerms * 64;
    float acc0 = 0.f, acc1 = 0.f;
    const uint8_t* stage = nullptr;
    for (int b = 0; b < nb1 / kParts; ++b) {
      const int kb = wg * (nb1 / kParts) + b;
      if (b % kBlocks == 0) stage = stage_wait(ring, cur, t, p.trace, 1 + wg, traced);
      float dg[4][2];
      block_sums(stage, b % kBlocks, t, xs + kb * 128, dg, p.mode & kModeBare);
      if (b % kBlocks == kBlocks - 1) stage_release(ring, cur, t);
      const float blk0 = __fadd_rn(__fadd_rn(__fadd_rn(dg[0][0], dg[1][0]), dg[2][0]), dg[3][0]);
      const float blk1 = __fadd_rn(__fadd_rn(__fadd_rn(dg[0][1], dg[1][1]), dg[2][1]), dg[3][1]);
      const float term0 = __fmul_rn(blk0, xsf[kb]), term1 = __fmul_rn(blk1, xsf[kb]);
      if (wg == 0) {
        acc0 = __fadd_rn(acc0, term0);
        acc1 = __fadd_rn(acc1, term1);
      } else if (col0) {
        tb[(kb - nb1 / kParts) * 64 + r0] = term0;  // the later quarters' terms, in ascending K
        tb[(kb - nb1 / kParts) * 64 + r0 + 8] = term1;
      }
    }
    named_sync(1, kComputeThreads);  // the later quarters' terms are in shared memory
    if (wg == 0) {
      for (int b = 0; b < nb1 - nb1 / kParts; ++b) {  // the chain goes on through the later quarters, in order
        acc0 = __fadd_rn(acc0, tb[b * 64 + r0]);
        acc1 = __fadd_rn(acc1, tb[b * 64 + r0 + 8]);
      }
      if (col0) {
        ep[r0] = acc0;
        ep[r0 + 8] = acc1;
      }
      named_sync(2, 128);
      if (t < 32) {  // SwiGLU, routing weight and the FP8 requant of channels 32 ct .. 32 ct + 31
        const float gate = ep[t], up = ep[32 + t];
        const float g = fminf(gate, p.clamp);
        const float uu = fminf(fmaxf(up, -p.clamp), p.clamp);
        const float e = static_cast<float>(exp(-static_cast<double>(g)));
        const float sig = __fdiv_rn(1.f, __fadd_rn(1.f, e));
        const float vw = __fmul_rn(__fmul_rn(__fmul_rn(g, sig), uu), it.weight[item]);
        float amax = fabsf(vw);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        const float sf = __fmul_rn(fmaxf(amax, __uint_as_float(0x2EDBE6FFu)), __uint_as_float(0x3B124925u));
        const float qv = fminf(fmaxf(__fmul_rn(vw, __fdiv_rn(1.f, sf)), -448.f), 448.f);
        const int row = it.row[item];
        p.l2_q[size_t(row) * I + 32 * ct + t] = e4m3_rtne_bits(qv);
        if (t == 0) p.l2_sf[size_t(row) * (I / 32) + ct] = sf;
      }
    }
  }

  // ---- every CTA's L1 outputs written: one grid-wide barrier ----
  named_sync(1, kComputeThreads);
  if (tid == 0) {
    stamp(p, 3);  // this CTA's L1 done
    grid_barrier(reinterpret_cast<unsigned long long*>(p.sync));
    stamp(p, 4);  // every CTA's L1 done
  }
  named_sync(1, kComputeThreads);

  // Every routed row's L2 input codes and group scales, written by other CTAs' L1: read through L2 (.cg), all at once
  const int hrow = I + kPad;
  for (int c = tid; c < it.n * (I / 16); c += kComputeThreads) {
    const int i = c / (I / 16), j = c % (I / 16);
    reinterpret_cast<uint4*>(hs + i * hrow)[j] = __ldcg(reinterpret_cast<const uint4*>(p.l2_q + size_t(it.row[i]) * I) + j);
  }
  for (int c = tid; c < it.n * (I / 32); c += kComputeThreads)
    sf2[c] = __ldcg(p.l2_sf + size_t(it.row[c / (I / 32)]) * (I / 32) + c % (I / 32));
  fence_async_smem();
  named_sync(1, kComputeThreads);
  int mine = 0;  // this CTA's L2 tiles
  for (int tile = blockIdx.x; tile < n2; tile += gridDim.x, ++tiles_done, ++mine) {  // ---- L2 ----
    const int item = tile / tpe2, ot = tile % tpe2;
    const uint8_t* hw = hs + item * hrow + wg * (I / kParts);  // this warpgroup's quarter of the row's codes
    const float* sfw = sf2 + item * (I / 32) + wg * (I / 32 / kParts);
    float* tb = terms + (tiles_done & 1) * kMaxTerms * 64;
    float acc0 = 0.f, acc1 = 0.f;
    const uint8_t* stage = nullptr;
    for (int b = 0; b < nb2 / kParts; ++b) {
      if (b % kBlocks == 0) stage = stage_wait(ring, cur, t, p.trace, 1 + wg, traced);
      float dg[4][2];
      block_sums(stage, b % kBlocks, t, hw + b * 128, dg, p.mode & kModeBare);
      if (b % kBlocks == kBlocks - 1) stage_release(ring, cur, t);
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const float c = sfw[4 * b + g];
        const float term0 = __fmul_rn(dg[g][0], c), term1 = __fmul_rn(dg[g][1], c);
        if (wg == 0) {
          acc0 = __fadd_rn(acc0, term0);
          acc1 = __fadd_rn(acc1, term1);
        } else if (col0) {
          const int j = 4 * ((wg - 1) * (nb2 / kParts) + b) + g;  // the later quarters' groups, in ascending K
          tb[j * 64 + r0] = term0;
          tb[j * 64 + r0 + 8] = term1;
        }
      }
    }
    named_sync(1, kComputeThreads);
    if (wg == 0) {
      for (int j = 0; j < 4 * (nb2 - nb2 / kParts); ++j) {
        acc0 = __fadd_rn(acc0, tb[j * 64 + r0]);
        acc1 = __fadd_rn(acc1, tb[j * 64 + r0 + 8]);
      }
      if (col0) {
        const int row = it.row[item];
        p.slot_out[size_t(row) * H + 64 * ot + r0] = bf16_bits(acc0);
        p.slot_out[size_t(row) * H + 64 * ot + r0 + 8] = bf16_bits(acc1);
      }
    }
  }
  // The combine of each of this CTA's 64-column tiles, by the CTA that writes the last of the step's rows for it:
  // one count per tile, all counted at once, then the last writer's slot-ordered sums.
  if (wg == 0) {
    named_sync(2, 128);
    if (t < mine) {  // lane i counts tile i in (acq_rel: the warpgroup's slot_out stores before, the sums after)
      const int ot = (blockIdx.x + t * gridDim.x) % tpe2;
      const bool last = atomic_add_acq_rel(&p.sync[2 + ot], 1u) == uint32_t(it.n - 1);
      if (last) p.sync[2 + ot] = 0;  // for the next launch
      const uint32_t mask = __ballot_sync(0xFFFFFFFFu >> (32 - mine), last);
      if (t == 0) flag[0] = int(mask);
    }
    named_sync(2, 128);
    const uint32_t last = uint32_t(flag[0]);
    for (int c = t; c < mine * 64; c += 128) {
      if (!(last >> (c / 64) & 1)) continue;
      const int col = 64 * ((blockIdx.x + (c / 64) * gridDim.x) % tpe2) + c % 64;
      float acc = 0.f;
      for (int k = 0; k < p.K; ++k) {
        const int r = it.slot_row[k];
        if (r >= 0) acc = __fadd_rn(acc, __uint_as_float(uint32_t(__ldcg(p.slot_out + size_t(r) * H + col)) << 16));
      }
      p.y[col] = bf16_bits(acc);
    }
  }
  if (tid == 0) stamp(p, 5);  // this CTA's L2 done (warpgroup 0)
}

}  // namespace

extern "C" {

// Shared memory the kernel needs besides its ring, for the geometry (bytes).
int megamoe_step1_fixed_smem(int H, int I) {
  const int bytes =
      (H + kPad) + kMaxTopK * (I + kPad) + 4 * (2 * kMaxTerms * 64 + 64 + H / 128 + kMaxTopK * I / 32 + 4);
  return (bytes + 7) / 8 * 8;
}

int megamoe_step1_stage_bytes() { return kStageBytes + 16; }  // a stage and its two mbarriers

int megamoe_step1_max_terms() { return kMaxTerms; }

int megamoe_step1_threads() { return kThreads; }

int megamoe_step1_parts() { return kParts; }

// The kernel's dynamic shared memory limit; once, before the first launch (and outside a CUDA graph capture).
int megamoe_step1_prepare(int device, int smem_bytes) {
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return int(err);
  return int(cudaFuncSetAttribute(step1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
}

// Launch on `stream`; 0 or the CUDA error code. A cooperative launch: every CTA must be resident at once.
int megamoe_step1_launch(const void* l1_codes, const void* l1_scales, const void* l2_codes, const void* l2_scales,
                         const void* x_q, const void* x_sf, const void* topk_idx, const void* topk_w,
                         void* num_touched, void* touched, void* seg_start, void* seg_count, void* row_token,
                         void* row_weight, void* slot_row, void* l2_q, void* l2_sf, void* slot_out, void* y,
                         void* sync, void* stamps, void* trace, float clamp, int H, int I, int K, int expert_lo, int num_local,
                         int stages, int mode, int inflight, int grid, int smem_bytes, int device, void* stream) {
  Params p{static_cast<const uint8_t*>(l1_codes), static_cast<const uint8_t*>(l1_scales),
           static_cast<const uint8_t*>(l2_codes), static_cast<const uint8_t*>(l2_scales),
           static_cast<const uint8_t*>(x_q), static_cast<const float*>(x_sf),
           static_cast<const int64_t*>(topk_idx), static_cast<const float*>(topk_w),
           static_cast<int32_t*>(num_touched), static_cast<int32_t*>(touched), static_cast<int32_t*>(seg_start),
           static_cast<int32_t*>(seg_count), static_cast<int32_t*>(row_token), static_cast<float*>(row_weight),
           static_cast<int32_t*>(slot_row), static_cast<uint8_t*>(l2_q), static_cast<float*>(l2_sf),
           static_cast<uint16_t*>(slot_out), static_cast<uint16_t*>(y), static_cast<uint32_t*>(sync),
           static_cast<int64_t*>(stamps), static_cast<int64_t*>(trace), clamp, H, I, K, expert_lo, num_local, stages, mode, inflight};
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
  cfg.numAttrs = 1;
  return int(cudaLaunchKernelEx(&cfg, step1_kernel, p));
}

}  // extern "C"
