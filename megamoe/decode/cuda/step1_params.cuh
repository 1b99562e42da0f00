// The 1-token CUDA step's parameters (step1.cu), its routing of the step's slots and route's outputs.
#pragma once

#include "step1_ops.cuh"

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
  uint32_t* sync;      // [H/64 + kMaxTopK + 1]: combine counts per 64 columns, L1 tiles done per item, CTAs done
  int64_t* stamps;     // [gridDim.x, 8] or null: when each CTA reached points 0..6 (%globaltimer, ns)
  int64_t* trace;      // [gridDim.x, 1 + kParts, kTraceSlots] or null: when the load warp issued each stage (row
                       // 0) and when warpgroup w found each of its stages landed (row 1 + w)
  float clamp;
  int H, I, K, expert_lo, num_local, stages;
  int mode;            // kMode* flags (0: the step itself)
  int inflight;        // stages the load warp keeps on their way at most (0: as many as the ring has free)
  int lag;             // L1 rounds an L2 tile waits after its item's last L1 round (Schedule)
};

// Probe flags (Params::mode). Bare: stream every block, skip the decode and the MMAs (y is wrong); no scales (bare
// only): leave out the scale words' copies; prefetch: ask the L2 cache for the CTA's L2 weights once its last L1
// block is asked for (y right); no load: no copies at all, each stage counted as landed at once (the computing
// warpgroups alone; y is wrong); touch: the idle warp reads one word at the start of each of the CTA's tiles first
// (touch_tiles; y right); empty: every thread returns at once (the launch of this shape alone; y is wrong); plain:
// the step launched without the cooperative attribute (what the attribute costs; y right while nothing else holds
// an SM); ahead: as a tile's copies start, the first line of the CTA's next tile is asked of the L2 cache
// (prefetch_tile_l2; y right); no wait: the input warp reads each item's L2 input row without waiting for the
// item's L1 tiles in every CTA (the step without its one dependency between CTAs, what that dependency costs; y is
// wrong); relaxed: the release warp raises the per-item counts without the release (red.relaxed.gpu, so no
// gpu-scope fence after each L1 tile; what those fences cost; y is right only if the counts happen to be seen after
// the outputs they count, which nothing then guarantees); regs: no ring and no copies, each computing warpgroup
// loads its own stages straight into registers, one stage ahead (y right; with bare, its stream alone; with no
// wait, its own instance too: the stream without the dependency); regs L1: the same for the L1 tiles only, while
// the load warp streams the L2 tiles' stages through the ring from the start (y right); LL: each L1 epilogue also
// stores its outputs as LL words (LLRows), which three input warps read until every word carries the launch's flag,
// instead of a count per item, a release and a read after it (y right; also with regs L1, its own instance); LL
// combine: each L2 tile's outputs as LL words too, and the CTA with the last item's tile of a 64-column slice reads
// the others' and writes y there, instead of a count per slice and a read after it (y right).
constexpr int kModeBare = 1, kModeNoScales = 2, kModePrefetch = 4, kModeNoLoad = 8, kModeTouch = 16, kModeEmpty = 32,
              kModePlain = 64, kModeAhead = 128, kModeNoWait = 256, kModeRelaxed = 512, kModeRegs = 1024,
              kModeRegsL1 = 2048, kModeLL = 4096, kModeLLCombine = 8192;

// Probe modes LL and LL combine: Params::sync past its counts (H/64 combine counts, kMaxTopK L1 counts, CTAs done),
// 8-byte aligned: the launch count; per item its L2 input row as LL words (`in`, word w < I/4: codes 4w .. 4w + 3;
// then one per 32 channels: the scale); per item its L2 outputs as LL words (`out`, 64-column tile ot's word
// 8 (r / 16) + r % 16 for r % 16 < 8: the bf16 bits of rows r (low) and r + 8 (high)). cuda_step1.sync_words sizes
// the buffer for them.
struct LLRows {
  uint64_t* count;
  uint64_t* in;
  uint64_t* out;
  int words, out_words;  // per item
  __device__ explicit LLRows(const Params& p)
      : count(reinterpret_cast<uint64_t*>(p.sync + ((p.H / 64 + kMaxTopK + 2) & ~1))),
        in(count + 1),
        out(in + kMaxTopK * (p.I / 4 + p.I / 32)),
        words(p.I / 4 + p.I / 32),
        out_words(p.H / 2) {}
};

struct Items {  // the step's valid slots in slot order (T = 1: one row each); in shared memory
  int n;
  int slot_expert[kMaxTopK];  // per slot: its local expert or -1
  int expert[kMaxTopK];
  int row[kMaxTopK];
  float weight[kMaxTopK];
  int slot_row[kMaxTopK];  // per slot: its pool row or -1
};

// The CTA's tiles in the order it takes them (L1 and L2 tiles numbered item-major, as in the Triton launches): in
// L1 round r its L1 tile blockIdx.x + r G, then those of its L2 tiles blockIdx.x + m G whose item's L1 tiles all
// lie in rounds <= r - lag; the rest after the last round. An L2 tile waits only for its own item's L1 tiles (a
// count per item in Params::sync), so early items' L2 overlaps the later L1 rounds and no CTA waits on the whole
// grid but for the last items. No deadlock: the L1 tiles of round r come before any wait a CTA makes in round r,
// and those waits are for tiles of rounds <= r (tests/cuda/schedule_check.cu runs this code on the host over many
// grids and shapes). The load warp, the signal warps and the computing warpgroups walk the same list.
struct Schedule {
  int n1, n2, tpe1, tpe2, lag;  // L1 / L2 tiles of the step, per item

  template <class L1, class L2>
  __device__ void for_each(L1 l1, L2 l2) const {  // l1(tile, this CTA's last L1 tile?), l2(tile)
    walk(blockIdx.x, gridDim.x, l1, l2);
  }

  // The k-th tile of CTA `cta` of `G`'s list, -1 past its end; l2: whether it is an L2 tile (probe mode regs).
#pragma nv_exec_check_disable
  __host__ __device__ int nth(int cta, int G, int k, bool& l2) const {
    int i = 0, found = -1;
    bool in_l2 = false;
    walk(cta, G, [&](int tile, bool) { found = i++ == k ? tile : found; },
         [&](int tile) {
           if (i++ == k) found = tile, in_l2 = true;
         });
    l2 = in_l2;
    return found;
  }

  // CTA `cta` of `G`'s tiles; on the host too, for tests/cuda/schedule_check.cu.
#pragma nv_exec_check_disable
  template <class L1, class L2>
  __host__ __device__ void walk(int cta, int G, L1 l1, L2 l2) const {
    const int rounds = (n1 + G - 1) / G;
    int k = cta;
    for (int r = 0; r < rounds; ++r) {
      const int j = cta + r * G;
      if (j < n1) l1(j, j + G >= n1);
      for (; k < n2; k += G) {
        const int last_round = ((k / tpe2 + 1) * tpe1 - 1) / G;  // of the item's L1 tiles
        const int ready = last_round + lag < rounds - 1 ? last_round + lag : rounds - 1;
        if (ready > r) break;
        l2(k);
      }
    }
  }
};

// Step tile `tile` (tiles numbered item-major, tpe per item) -> its tile in the weights' layout: the item's expert's
// tile tile % tpe (whose K blocks start at this times the tile's blocks).
__device__ __forceinline__ size_t weight_tile(const int* expert, int tile, int tpe) {
  return size_t(expert[tile / tpe]) * tpe + tile % tpe;
}

// Probe modes regs and regs L1: a computing warpgroup loads its stages of the CTA's tiles (regs L1: of its L1 tiles
// only), in the order it computes them, straight into registers, one stage ahead of the one it computes. `ahead`
// holds the next stage, which lies in the CTA's k-th tile (tile, l2 as Schedule::nth gives them) from block b of
// the warpgroup's quarter of its K.
struct RegStream {
  StageRegs ahead;
  int k, b, tile;
  bool l2, l1_only;

  __device__ void start(const Params& p, const Schedule& sched, const int* expert, int wg, int t, bool only_l1) {
    k = b = 0;
    l1_only = only_l1;
    tile = sched.nth(blockIdx.x, gridDim.x, 0, l2);
    skip(sched);
    next(p, sched, expert, wg, t);
  }

  __device__ void skip(const Schedule& sched) {  // regs L1: past the L2 tiles, which come through the ring
    while (l1_only && tile >= 0 && l2) tile = sched.nth(blockIdx.x, gridDim.x, ++k, l2);
  }

  // The loads of the next stage into `ahead` (nothing past the CTA's last tile); their values are waited for where
  // they are first used.
  __device__ void next(const Params& p, const Schedule& sched, const int* expert, int wg, int t) {
    if (tile < 0) return;
    const int nb = l2 ? p.I / 128 : p.H / 128, tpe = l2 ? p.H / 64 : p.I / 32;
    const size_t blk = weight_tile(expert, tile, tpe) * nb + wg * (nb / kParts) + b;
    stage_read_global((l2 ? p.l2_codes : p.l1_codes) + blk * 4096, (l2 ? p.l2_scales : p.l1_scales) + blk * 256, t,
                      ahead);
    b += kBlocks;
    if (b == nb / kParts) {
      b = 0;
      tile = sched.nth(blockIdx.x, gridDim.x, ++k, l2);
      skip(sched);
    }
  }
};

// Probe mode touch: the lanes of the idle warp each read one word at the start of some of the CTA's tiles (codes
// and scales, L1 and L2), so that every page the CTA will stream is asked for once, at the start, beside the first
// tile's copies. The question it asks: the load warp stops for microseconds before a tile's first stage while the
// ring has free slots (run 37's README); if those stops wait for the new tile's address translations, this takes
// them off the stream's path. The idle warp, not the load warp's other lanes: a lane waiting on its load there
// could hold up the issuing lane's divergent path.
__device__ __forceinline__ void touch_tiles(const Params& p, const Schedule& sched, const int* expert, int lane) {
  const int nb1 = p.H / 128, nb2 = p.I / 128, tpe1 = p.I / 32, tpe2 = p.H / 64;
  int i = 0;
  auto touch = [&](const uint8_t* codes, const uint8_t* scales, size_t first_block) {
    if (i++ % 32 != lane) return;
    // volatile: the value is never used, and ptxas drops a plain load whose value is never used (checked in SASS)
    asm volatile("{\n .reg .b32 w;\n ld.volatile.global.u32 w, [%0];\n}\n" ::"l"(codes + first_block * 4096));
    asm volatile("{\n .reg .b32 w;\n ld.volatile.global.u32 w, [%0];\n}\n" ::"l"(scales + first_block * 256));
  };
  sched.for_each(
      [&](int tile, bool) { touch(p.l1_codes, p.l1_scales, weight_tile(expert, tile, tpe1) * nb1); },
      [&](int tile) { touch(p.l2_codes, p.l2_scales, weight_tile(expert, tile, tpe2) * nb2); });
}

// Probe mode ahead: the first line of the codes and of the scales of step tile `tile` (an L1 tile if l1, else L2;
// none past the step's tiles) asked of the L2 cache by the load warp as the tile before it starts: the CTA's next
// L1 tile, or after its last one its first L2 tile (exact with the default lag, where the CTA's L2 tiles follow all
// its L1 tiles). Where touch_tiles asks for every page of the CTA at the start, this asks one tile ahead, so that a
// page's translation, if that is what holds a new tile's copies, is done while the tile before it streams.
// prefetch.global.L2 goes through the load-store path, not the copy engine, and nothing waits for it.
__device__ __forceinline__ void prefetch_tile_l2(const Params& p, const Schedule& sched, const int* expert, int tile,
                                                 bool l1) {
  if (tile >= (l1 ? sched.n1 : sched.n2)) return;
  const size_t blk = l1 ? weight_tile(expert, tile, p.I / 32) * (p.H / 128)  // the tile's first K block
                        : weight_tile(expert, tile, p.H / 64) * (p.I / 128);
  asm volatile("prefetch.global.L2 [%0];" ::"l"((l1 ? p.l1_codes : p.l2_codes) + blk * 4096));
  asm volatile("prefetch.global.L2 [%0];" ::"l"((l1 ? p.l1_scales : p.l2_scales) + blk * 256));
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
// gate = ep[t], up = ep[32 + t]) -> l2_q, l2_sf: triton_tc._l1_epilogue, operation for operation.
__device__ __forceinline__ uint32_t l1_epilogue(const Params& p, const float* ep, const Items& it, int item, int ct,
                                                int t, float& sf_out) {  // -> lane t's code, and the scale
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

// Probe mode LL: the same, then the 32 codes and the scale as LL words of the item's row, for the input warps.
__device__ __forceinline__ void l1_epilogue_ll(const Params& p, const float* ep, const Items& it, int item, int ct,
                                               int t, uint32_t flag) {
  float sf;
  const uint32_t code = l1_epilogue(p, ep, it, item, ct, t, sf);
  const uint32_t word = code | __shfl_down_sync(0xFFFFFFFFu, code, 1) << 8 |
                        __shfl_down_sync(0xFFFFFFFFu, code, 2) << 16 |
                        __shfl_down_sync(0xFFFFFFFFu, code, 3) << 24;  // lanes 4j: channels 4j .. 4j + 3
  const LLRows ll(p);
  uint64_t* row = ll.in + size_t(item) * ll.words;
  if (t % 4 == 0) ll_store(row + 8 * ct + t / 4, word, flag);
  if (t == 0) ll_store(row + p.I / 4 + ct, __float_as_uint(sf), flag);
}

// Probe mode LL: input warp iw of three (lane) reads item `item`'s L2 input row from its LL words into shared memory
// (codes to `codes`, scales to `scales`). Until the item's last L1 tile (in its last round) has stored its scale
// word, one lane polls that word; then every lane loads its words until each carries the flag.
__device__ __forceinline__ void ll_input_row(const Params& p, int item, int iw, int lane, uint32_t flag,
                                             uint8_t* codes, float* scales) {
  const LLRows ll(p);
  const int I = p.I;
  const uint64_t* row = ll.in + size_t(item) * ll.words;
  if (lane == 0)
    while (!ll_ready(ll_load(row + I / 4 + I / 32 - 1), flag)) {
    }
  __syncwarp();
  constexpr int kPerLane = 6;  // 96 lanes x 6 = 576 words: I <= 2,048 in one round (cuda_step1.geometry_limits)
  for (int w0 = 32 * iw + lane; w0 < ll.words; w0 += 96 * kPerLane) {
    uint64_t v[kPerLane];
    const int n = (ll.words - w0 + 95) / 96;
    ll_wait(v, row + w0, 96, n < kPerLane ? n : kPerLane, flag);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int w = w0 + 96 * j;
      if (w >= ll.words) break;
      if (w < I / 4)
        *reinterpret_cast<uint32_t*>(codes + 4 * w) = uint32_t(v[j]);
      else
        scales[w - I / 4] = __uint_as_float(uint32_t(v[j]));
    }
  }
}

// The combine of each of this CTA's `mine` 64-column L2 tiles (blockIdx.x + i gridDim.x), by the CTA that writes the
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

// Probe mode LL combine, by the lanes of warpgroup 0 holding rows r0 and r0 + 8 of item `item`'s 64-column L2 tile
// ot (bf16 bits b0, b1): all but the last item store them as LL words; the last item's lane reads the others' words
// and writes y there, the slot-ordered FP32 sum and one bf16 rounding (triton_combine.combine_tile's: the items are
// the valid slots in slot order). The last item's tiles come last in every CTA's list and no other tile waits for
// a combine, so the wait cannot deadlock.
__device__ __forceinline__ void ll_combine(const Params& p, const Items& it, int item, int ot, int r0, uint32_t b0,
                                           uint32_t b1, uint32_t flag) {
  const LLRows ll(p);
  const int word = 32 * ot + 8 * (r0 / 16) + r0 % 16;
  if (item + 1 < it.n) {
    ll_store(ll.out + size_t(item) * ll.out_words + word, b0 | b1 << 16, flag);
    return;
  }
  uint64_t v[kMaxTopK - 1];
  ll_wait(v, ll.out + word, size_t(ll.out_words), it.n - 1, flag);
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxTopK - 1; ++j) {
    if (j >= it.n - 1) break;
    s0 = __fadd_rn(s0, __uint_as_float(uint32_t(v[j]) << 16));
    s1 = __fadd_rn(s1, __uint_as_float(uint32_t(v[j]) >> 16 << 16));
  }
  s0 = __fadd_rn(s0, __uint_as_float(b0 << 16));
  s1 = __fadd_rn(s1, __uint_as_float(b1 << 16));
  p.y[64 * ot + r0] = bf16_bits(s0);
  p.y[64 * ot + r0 + 8] = bf16_bits(s1);
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
