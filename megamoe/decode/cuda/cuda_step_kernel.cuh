// The 1-token decode step's kernel: one persistent launch (recipe megamoe-decode-tc, the same bits as the three
// Triton launches of megamoe/decode/triton_tc.py). cuda_step.cu compiles the step and launches it; Python side:
// megamoe/decode/cuda_step.py (build, checks, launch). The lab's probe modes run on its own copy of this kernel, which
// has hooks this one does not (lab/cuda_step/probe_kernel/; its JOURNAL.md has where the time goes, run by run).
// Building blocks: cuda_step_ops.cuh (PTX, numerics, the ring, a stage's sums); cuda_step_params.cuh (parameters,
// routing, the order of a CTA's tiles, the gate/up epilogue, the combine). Names: l1_* / tpe1 / nb1 are the gate/up
// GEMM's (its weights, tiles per expert, K blocks), l2_* / tpe2 / nb2 the down GEMM's; L1 and L2 alone are caches.
//
// One CTA per SM, 640 threads: four computing warpgroups, then a warpgroup of a load warp, a release warp, an input
// warp and an idle one (setmaxnreg gives the computing warpgroups 112 registers, the others 32). The CTA's work is a
// list of tiles (Schedule): its gate/up tiles (item i, channel tile t) blockIdx.x, + gridDim.x, ..., and its down tiles
// the same way, each down tile placed `lag` gate/up rounds after its item's last gate/up round. A tile is a list of
// stages (two 128-K blocks of one 64-row tile: 2 x 4,096 code bytes and 2 x 256 scale bytes, contiguous in
// layout_tc.py). The load warp streams the stages through a ring (cp.async.bulk, one mbarrier per stage each way),
// waiting on nothing but free stages, so it runs on into the down GEMM's weights while the gate/up GEMM still computes.
//
// No grid barrier: a down tile needs only its own item's gate/up outputs. Warpgroup 0 stores each gate/up tile's
// outputs and tells the release warp (a shared-memory count), which raises the item's count for every CTA (release);
// the input warp waits for each of its items' counts and reads the item's down-GEMM input row into shared memory (an
// mbarrier per item tells the warpgroups). Neither wait is on the computing warpgroups' path: the release waits for the
// stores it publishes, and an input read is a round trip through a memory system busy with the weights.
//
// A tile's K is split in quarters, one per warpgroup: warpgroup 0 keeps the running promotion sum of the first
// quarter, the others store each term of theirs in shared memory, and warpgroup 0 replays them in ascending K, the
// same FP32 additions as one unsplit chain (triton_tc._replay does the same across programs).
//
// Numerics per 32-K group g (recipe megamoe-decode-tc): d_g = wgmma m64n8k32 e4m3 from a zero accumulator (the
// weights decoded in registers as the A operand, the token's codes as column 0 of B); d'_g = d_g * 2**(s - 121)
// (exact); gate/up: blk = ((d'_0 + d'_1) + d'_2) + d'_3, acc = fl32(acc + fl32(x_sf * blk)) per 128-K block; down:
// acc = fl32(acc + fl32(d'_g * sf2_g)) per group. The gate/up epilogue (SwiGLU, routing weight, FP8 requant per 32
// channels) and the combine (slot-ordered FP32 sum, one bf16 rounding) are triton_tc._gate_up_epilogue's and
// triton_combine.combine_tile's, operation for operation.
//
// B operand without a zero-filled tile: column 0 is all that is read back, so B is the token's codes themselves
// with rows 16 bytes apart (LBO = 16): B[k][n] = codes[k0 + k + 16 n]. Columns 1..7 hold other codes and their
// results are never used.

#pragma once

#include "cuda_step_params.cuh"

namespace {

__global__ void __launch_bounds__(kThreads, 1) step1_kernel(const Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int H = p.H, I = p.I;
  const int nb1 = H / 128, nb2 = I / 128;  // K blocks of a gate/up / down tile
  const int tpe1 = I / 32, tpe2 = H / 64;  // tiles per expert
  const int hrow = I + kPad;               // a down-GEMM input row in shared memory
  // shared memory: ring | x codes | down-GEMM input codes per routed row | terms x2 | epilogue | x_sf | sf2 | flag |
  // bars (ring: full, empty; input_ready) | the routing | the gate/up epilogue count
  uint8_t* ring_data = smem;
  uint8_t* xs = ring_data + size_t(p.stages) * kStageBytes;
  uint8_t* hs = xs + H + kPad;
  float* terms = reinterpret_cast<float*>(hs + kMaxTopK * hrow);
  float* ep = terms + 2 * kMaxTerms * 64;
  float* xsf = ep + 64;
  float* sf2 = xsf + nb1;
  int* flag = reinterpret_cast<int*>(sf2 + kMaxTopK * I / 32);
  uint64_t* bars = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(flag + 4) + 7) & ~uintptr_t(7));
  Ring ring{ring_data, bars, bars + p.stages, p.stages};
  uint64_t* input_ready = bars + 2 * p.stages;  // per item: its down-GEMM input row is in shared memory (one phase)
  Items& it = *reinterpret_cast<Items*>(input_ready + kMaxTopK);
  uint32_t& epilogues = *reinterpret_cast<uint32_t*>(&it + 1);  // gate/up epilogues warpgroup 0 has stored
  uint32_t* gate_up_done = p.sync + tpe2;       // per item: its gate/up tiles whose outputs are stored (all CTAs)

  const int tid = threadIdx.x;
  if (tid == 0) {
    route_items(p, it);  // its loads go out first
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(&ring.full[s], 1);   // the load warp's expect_tx
      mbar_init(&ring.empty[s], 4);  // one arrival per warp of the warpgroup
    }
    for (int i = 0; i < kMaxTopK; ++i) mbar_init(&input_ready[i], 1);  // the input warp's arrival
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    epilogues = 0;
  }
  __syncthreads();  // the barriers and the routing: the load warp starts

  const Schedule sched{it.n * tpe1, it.n * tpe2, tpe1, tpe2, p.lag};
  if (tid >= kComputeThreads) {  // ---- the last warpgroup: loads and signals ----
    regs_dec<kOtherRegs>();  // the warpgroup as a whole, before its warps part
    if (tid >= kComputeThreads + 96) return;  // the idle warp
    // Two signal warps keep the cross-CTA waits off the computing warpgroups' path; the release (which waits for
    // the stores it publishes) and the input reads (a round trip each) would each stall a warpgroup for microseconds
    // while the weights stream.
    if (tid >= kComputeThreads + 64) {  // ---- the input warp: each item's down input row, once it is complete ----
      const int lane = tid % 32;
      for_each_down_item(sched, [&](int item) {
        if (lane == 0) wait_count(gate_up_done + item, uint32_t(tpe1));
        __syncwarp();
        const size_t src = size_t(it.row[item]);
        for (int c = lane; c < I / 16; c += 32)
          reinterpret_cast<uint4*>(hs + item * hrow)[c] = __ldcg(reinterpret_cast<const uint4*>(p.l2_q + src * I) + c);
        for (int c = lane; c < I / 32; c += 32) sf2[item * (I / 32) + c] = __ldcg(p.l2_sf + src * (I / 32) + c);
        fence_async_smem();  // for the warpgroups' MMAs, which read the codes through the async proxy
        __syncwarp();
        if (lane == 0) mbar_arrive(&input_ready[item]);
      });
      named_sync(3, kComputeThreads + 64);  // every wait of this CTA's done, for the counts' reset
      return;
    }
    if (tid >= kComputeThreads + 32) {  // ---- the release warp: each gate/up tile's outputs to every CTA ----
      if (tid % 32 == 0) {
        uint32_t gate_up_tiles = 0;
        sched.for_each(
            [&](int tile, bool) {
              wait_count_cta(&epilogues, ++gate_up_tiles);  // warpgroup 0's epilogue stored the tile's outputs
              add_release(gate_up_done + tile / tpe1, 1);
            },
            [](int) {});
      }
      __syncwarp();
      named_sync(3, kComputeThreads + 64);
      return;
    }
    {  // ---- the load warp ----
      const int lane = tid - kComputeThreads;
      if (lane != 0) {  // one lane issues the bulk copies; another writes route's outputs
        if (lane == 1 && blockIdx.x == 0) write_route(p, it);
        return;
      }
      Cursor cur{0, 1};  // a fresh barrier passes a wait on parity 1: the first round finds every stage free
      auto issue = [&](const uint8_t* codes, const uint8_t* scales) {
        const int s = cur.stage;
        uint8_t* dst = ring.data + size_t(s) * kStageBytes;
        mbar_wait(&ring.empty[s], cur.phase);
        mbar_expect_tx(&ring.full[s], kStageBytes);
        bulk_load(dst, codes, kCodeBytes, &ring.full[s]);
        bulk_load(dst + kCodeBytes, scales, kStageBytes - kCodeBytes, &ring.full[s]);
        cur.advance(1, ring.stages);
      };
      // A tile (tile index `tile`, tpe per expert, nb K blocks): kBlocks blocks of each quarter in turn
      auto issue_tile = [&](int tile, int tpe, int nb, const uint8_t* codes, const uint8_t* scales) {
        const size_t base = weight_tile(it.expert, tile, tpe);
        for (int b = 0; b < nb / kParts; b += kBlocks)
          for (int q = 0; q < kParts; ++q) {
            const size_t blk = base * nb + q * (nb / kParts) + b;
            issue(codes + blk * 4096, scales + blk * 256);
          }
      };
      sched.for_each([&](int tile, bool) { issue_tile(tile, tpe1, nb1, p.l1_codes, p.l1_scales); },
                     [&](int tile) { issue_tile(tile, tpe2, nb2, p.l2_codes, p.l2_scales); });
      return;
    }
  }
  regs_inc<kComputeRegs>();

  // ---- the computing warpgroups: decode, MMA, promotion ----
  // The token's codes and scales; zeros past the ends of x and of each input row (B's unused columns read them)
  for (int c = tid; c < H / 16; c += kComputeThreads)
    reinterpret_cast<uint4*>(xs)[c] = reinterpret_cast<const uint4*>(p.x_q)[c];
  for (int c = tid; c < kPad / 16; c += kComputeThreads) reinterpret_cast<uint4*>(xs + H)[c] = uint4{0, 0, 0, 0};
  for (int c = tid; c < nb1; c += kComputeThreads) xsf[c] = p.x_sf[c];
  for (int c = tid; c < kMaxTopK * kPad / 16; c += kComputeThreads)
    reinterpret_cast<uint4*>(hs + (c / (kPad / 16)) * hrow + I)[c % (kPad / 16)] = uint4{0, 0, 0, 0};
  fence_async_smem();
  named_sync(1, kComputeThreads);
  const int wg = tid / 128, t = tid % 128;
  const int r0 = 16 * (t / 32) + (t % 32) / 4;
  const bool col0 = (t % 4) == 0;  // lanes holding column 0 (the token)
  Cursor cur{wg, 0};  // this warpgroup's stages are the CTA's list's wg, wg + kParts, ...
  int tiles_done = 0;
  uint32_t gate_up_tiles = 0;  // this CTA's gate/up epilogues done (warpgroup 0)
  int mine = 0;                // this CTA's down tiles
  uint32_t inputs = 0;         // items whose down-GEMM input row this warpgroup has seen arrive

  auto gate_up_tile = [&](int tile, bool) {
    const int item = tile / tpe1, ct = tile % tpe1;
    float* tb = terms + (tiles_done++ & 1) * kMaxTerms * 64;
    float acc0 = 0.f, acc1 = 0.f;
    for (int b = 0; b < nb1 / kParts; b += kBlocks) {
      const int kb = wg * (nb1 / kParts) + b;
      float dg[kBlocks][4][2];
      stage_sums(ring, cur, t, b_desc(xs + kb * 128), dg);
#pragma unroll
      for (int j = 0; j < kBlocks; ++j) {
        const float blk0 = __fadd_rn(__fadd_rn(__fadd_rn(dg[j][0][0], dg[j][1][0]), dg[j][2][0]), dg[j][3][0]);
        const float blk1 = __fadd_rn(__fadd_rn(__fadd_rn(dg[j][0][1], dg[j][1][1]), dg[j][2][1]), dg[j][3][1]);
        const float term0 = __fmul_rn(blk0, xsf[kb + j]), term1 = __fmul_rn(blk1, xsf[kb + j]);
        if (wg == 0) {
          acc0 = __fadd_rn(acc0, term0);
          acc1 = __fadd_rn(acc1, term1);
        } else if (col0) {
          tb[(kb + j - nb1 / kParts) * 64 + r0] = term0;  // the later quarters' terms, in ascending K
          tb[(kb + j - nb1 / kParts) * 64 + r0 + 8] = term1;
        }
      }
    }
    named_sync(1, kComputeThreads);  // the later quarters' terms are in shared memory
    if (wg != 0) return;
    for (int b = 0; b < nb1 - nb1 / kParts; ++b) {  // the chain goes on through the later quarters, in order
      acc0 = __fadd_rn(acc0, tb[b * 64 + r0]);
      acc1 = __fadd_rn(acc1, tb[b * 64 + r0 + 8]);
    }
    if (col0) {
      ep[r0] = acc0;
      ep[r0 + 8] = acc1;
    }
    named_sync(2, 128);
    if (t < 32) {
      gate_up_epilogue(p, ep, it, item, ct, t);
      __syncwarp();  // the warp's stores, then the release warp raises the item's count for every CTA
      if (t == 0) store_release_cta(&epilogues, ++gate_up_tiles);
    }
  };

  auto down_tile = [&](int tile) {
    const int item = tile / tpe2, ot = tile % tpe2;
    ++mine;
    if (!(inputs >> item & 1)) {  // the item's input row, read in by the input warp
      mbar_wait(&input_ready[item], 0);
      inputs |= 1u << item;
    }
    const uint8_t* hw = hs + item * hrow + wg * (I / kParts);  // this warpgroup's quarter of the row's codes
    const float* sfw = sf2 + item * (I / 32) + wg * (I / 32 / kParts);
    float* tb = terms + (tiles_done++ & 1) * kMaxTerms * 64;
    float acc0 = 0.f, acc1 = 0.f;
    for (int b = 0; b < nb2 / kParts; b += kBlocks) {
      float dg[kBlocks][4][2];
      stage_sums(ring, cur, t, b_desc(hw + b * 128), dg);
#pragma unroll
      for (int j = 0; j < kBlocks; ++j)
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const float c = sfw[4 * (b + j) + g];
          const float term0 = __fmul_rn(dg[j][g][0], c), term1 = __fmul_rn(dg[j][g][1], c);
          if (wg == 0) {
            acc0 = __fadd_rn(acc0, term0);
            acc1 = __fadd_rn(acc1, term1);
          } else if (col0) {
            const int jj = 4 * ((wg - 1) * (nb2 / kParts) + b + j) + g;  // the later quarters' groups, ascending K
            tb[jj * 64 + r0] = term0;
            tb[jj * 64 + r0 + 8] = term1;
          }
        }
    }
    named_sync(1, kComputeThreads);
    if (wg != 0) return;
    for (int j = 0; j < 4 * (nb2 - nb2 / kParts); ++j) {
      acc0 = __fadd_rn(acc0, tb[j * 64 + r0]);
      acc1 = __fadd_rn(acc1, tb[j * 64 + r0 + 8]);
    }
    if (col0) {
      const int row = it.row[item];
      p.slot_out[size_t(row) * H + 64 * ot + r0] = bf16_bits(acc0);
      p.slot_out[size_t(row) * H + 64 * ot + r0 + 8] = bf16_bits(acc1);
    }
  };

  sched.for_each(gate_up_tile, down_tile);

  if (wg == 0) combine_tiles(p, it, mine, flag, t);
  // The per-item counts back to zero for the next launch, by the last CTA to finish: every CTA has passed all its
  // waits by then.
  named_sync(3, kComputeThreads + 64);  // with the signal warps
  if (tid == 0) {
    uint32_t* finished = gate_up_done + kMaxTopK;
    if (atomic_add_acq_rel(finished, 1u) == gridDim.x - 1) {
      for (int i = 0; i < kMaxTopK; ++i) gate_up_done[i] = 0;
      *finished = 0;
    }
  }
}

}  // namespace
