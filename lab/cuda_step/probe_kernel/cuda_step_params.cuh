// lab/cuda_step's copy, with the probe fields and flags: see cuda_step_kernel.cuh.
// The 1-token CUDA step's parameters (cuda_step.cu), its routing of the step's slots and route's outputs.
#pragma once

#include "cuda_step_ops.cuh"

namespace {

struct Params {
  const uint8_t* l1_codes;   // [E, I/32, H/32, 1024]
  const uint8_t* l1_scales;  // [E, I/32, H/128, 256]
  const uint8_t* l2_codes;   // [E, H/64, I/32, 1024]
  const uint8_t* l2_scales;  // [E, H/64, I/128, 256]
  const uint8_t* x_q;        // e4m3 [H]      (token 0 of the staged buffers)
  const float* x_sf;         // fp32 [H/128]
  const int64_t* topk_idx;   // [K]
  const float* topk_w;       // [K]
  int32_t* num_touched;      // route's outputs (routing.route_torch), for down-GEMM and combine readers and checks
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
  uint32_t* sync;      // [H/64 + kMaxTopK + 1]: combine counts per 64 columns, gate/up tiles done per item, CTAs done
  int64_t* stamps;     // [gridDim.x, 8] or null: when each CTA reached points 0..6 (%globaltimer, ns)
  int64_t* trace;      // [gridDim.x, 1 + kParts, kTraceSlots] or null: when the load warp issued each stage (row
                       // 0) and when warpgroup w found each of its stages landed (row 1 + w)
  float clamp;
  int H, I, K, expert_lo, num_local, stages;
  int mode;            // kMode* flags (0: the step itself)
  int inflight;        // stages the load warp keeps on their way at most (0: as many as the ring has free)
  int lag;             // gate/up rounds a down tile waits after its item's last gate/up round (Schedule)
};

// Probe flags (Params::mode): 0 is the step itself, which is all the library launches. The lab's probe instances
// (lab/cuda_step/probes.cuh says what each flag asks) set the others; the step's code reads the runtime ones (bare,
// no scales, prefetch, no load; plain is the launch's) and compiles the rest only into the lab's instances.
constexpr int kModeBare = 1, kModeNoScales = 2, kModePrefetch = 4, kModeNoLoad = 8, kModeTouch = 16, kModeEmpty = 32,
              kModePlain = 64, kModeAhead = 128, kModeNoWait = 256, kModeRelaxed = 512, kModeRegs = 1024,
              kModeRegsL1 = 2048, kModeLL = 4096, kModeLLCombine = 8192;

struct Items {  // the step's valid slots in slot order (T = 1: one row each); in shared memory
  int n;
  int slot_expert[kMaxTopK];  // per slot: its local expert or -1
  int expert[kMaxTopK];
  int row[kMaxTopK];
  float weight[kMaxTopK];
  int slot_row[kMaxTopK];  // per slot: its pool row or -1
};

// The CTA's tiles in the order it takes them (gate/up and down tiles numbered item-major, as in the Triton launches):
// in gate/up round r its gate/up tile blockIdx.x + r G, then those of its down tiles blockIdx.x + m G whose item's
// gate/up tiles all lie in rounds <= r - lag; the rest after the last round. An down tile waits only for its own item's
// gate/up tiles (a count per item in Params::sync), so early items' down overlaps the later gate/up rounds and no CTA
// waits on the whole grid but for the last items. No deadlock: the gate/up tiles of round r come before any wait a CTA
// makes in round r, and those waits are for tiles of rounds <= r (tests/cuda/schedule_check.cu runs this code on the
// host over many grids and shapes). The load warp, the signal warps and the computing warpgroups walk the same list.
struct Schedule {
  int n1, n2, tpe1, tpe2, lag;  // gate/up / down tiles of the step, per item

  template <class GateUp, class Down>  // gate_up(tile, this CTA's last gate/up tile?), down(tile)
  __device__ void for_each(GateUp gate_up, Down down) const {
    walk(blockIdx.x, gridDim.x, gate_up, down);
  }

  // CTA `cta` of `G`'s tiles; on the host too, for tests/cuda/schedule_check.cu.
#pragma nv_exec_check_disable
  template <class GateUp, class Down>
  __host__ __device__ void walk(int cta, int G, GateUp gate_up, Down down) const {
    const int rounds = (n1 + G - 1) / G;
    int k = cta;
    for (int r = 0; r < rounds; ++r) {
      const int j = cta + r * G;
      if (j < n1) gate_up(j, j + G >= n1);
      for (; k < n2; k += G) {
        const int last_round = ((k / tpe2 + 1) * tpe1 - 1) / G;  // of the item's gate/up tiles
        const int ready = last_round + lag < rounds - 1 ? last_round + lag : rounds - 1;
        if (ready > r) break;
        down(k);
      }
    }
  }
};

// Step tile `tile` (tiles numbered item-major, tpe per item) -> its tile in the weights' layout: the item's expert's
// tile tile % tpe (whose K blocks start at this times the tile's blocks).
__device__ __forceinline__ size_t weight_tile(const int* expert, int tile, int tpe) {
  return size_t(expert[tile / tpe]) * tpe + tile % tpe;
}

// Each item the CTA's down tiles need, once, in the order its down tiles come: fn(item).
template <class Fn>
__device__ __forceinline__ void for_each_down_item(const Schedule& sched, Fn fn) {
  uint32_t have = 0;
  sched.for_each([](int, bool) {}, [&](int tile) {
    const int item = tile / sched.tpe2;
    if (have >> item & 1) return;
    have |= 1u << item;
    fn(item);
  });
}

// The step's routing (K <= 8 slots of one token) -> it: the valid slots in slot order, each one's pool row as
// routing.route_torch numbers them (stable by expert).
__device__ void route_items(const Params& p, Items& it) {
  int ex[kMaxTopK];
  float tw[kMaxTopK];
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {  // unrolled: the slots' loads go out together (one round trip)
    const int64_t e = k < p.K ? p.topk_idx[k] - p.expert_lo : -1;
    ex[k] = (e >= 0 && e < p.num_local) ? int(e) : -1;
    tw[k] = k < p.K ? p.topk_w[k] : 0.f;
  }
  int n = 0;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    if (k >= p.K) break;
    int row = -1;
    it.slot_expert[k] = ex[k];
    if (ex[k] >= 0) {
      row = 0;
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) row += j < p.K && ex[j] >= 0 && (ex[j] < ex[k] || (ex[j] == ex[k] && j < k));
      it.expert[n] = ex[k];
      it.row[n] = row;
      it.weight[n] = tw[k];
      ++n;
    }
    it.slot_row[k] = row;
  }
  it.n = n;
}

// SwiGLU, routing weight and the FP8 requant of channels 32 ct .. 32 ct + 31 of item `item` (one warp, lane t;
// gate = ep[t], up = ep[32 + t]) -> l2_q, l2_sf: triton_tc._gate_up_epilogue, operation for operation.
__device__ __forceinline__ uint32_t gate_up_epilogue(const Params& p, const float* ep, const Items& it, int item,
                                                     int ct, int t, float& sf_out) {  // -> lane t's code, the scale
  const float g = fminf(ep[t], p.clamp);
  const float uu = fminf(fmaxf(ep[32 + t], -p.clamp), p.clamp);
  const float e = static_cast<float>(exp(-static_cast<double>(g)));
  const float sig = __fdiv_rn(1.f, __fadd_rn(1.f, e));
  const float vw = __fmul_rn(__fmul_rn(__fmul_rn(g, sig), uu), it.weight[item]);
  float amax = fabsf(vw);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const float sf = __fmul_rn(fmaxf(amax, __uint_as_float(0x2EDBE6FFu)), __uint_as_float(0x3B124925u));
  const float qv = fminf(fmaxf(__fmul_rn(vw, __fdiv_rn(1.f, sf)), -448.f), 448.f);
  const int row = it.row[item];
  const uint8_t code = e4m3_rtne_bits(qv);
  p.l2_q[size_t(row) * p.I + 32 * ct + t] = code;
  if (t == 0) p.l2_sf[size_t(row) * (p.I / 32) + ct] = sf;
  sf_out = sf;
  return code;
}

// The combine of each of this CTA's `mine` 64-column down tiles (blockIdx.x + i gridDim.x), by the CTA that writes the
// last of the step's rows for it: one count per tile, all counted at once, then the last writer's slot-ordered
// sums (triton_combine.combine_tile's). Warpgroup 0 (lane t of 128) after its slot_out stores; flag: shared scratch.
__device__ __forceinline__ void combine_tiles(const Params& p, const Items& it, int mine, int* flag, int t) {
  const int tpe2 = p.H / 64;
  named_sync(2, 128);
  if (t < mine) {  // lane i counts tile i in (acq_rel: the warpgroup's slot_out stores before, the sums after)
    const int ot = (blockIdx.x + t * gridDim.x) % tpe2;
    const bool last = atomic_add_acq_rel(&p.sync[ot], 1u) == uint32_t(it.n - 1);
    if (last) p.sync[ot] = 0;  // for the next launch
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
      if (r >= 0) acc = __fadd_rn(acc, __uint_as_float(uint32_t(__ldcg(p.slot_out + size_t(r) * p.H + col)) << 16));
    }
    p.y[col] = bf16_bits(acc);
  }
}

// Probes: when this CTA reached a point (Params::stamps, %globaltimer ns).
__device__ __forceinline__ void stamp(const Params& p, int point) {
  if (p.stamps != nullptr) {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    p.stamps[blockIdx.x * 8 + point] = int64_t(t);
  }
}

// Route's outputs for the step (routing.route_torch's, bit for bit), and y = 0 when no slot is routed here.
__device__ void write_route(const Params& p, const Items& it) {
  const int* ex = it.slot_expert;
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

}  // namespace
