// The 1-token CUDA step's probe modes: what each flag of Params::mode asks, their building blocks, and the
// ProbeHooks policy that hands those to the probe instances of the step's kernel (probe_step.cu compiles them over the
// lab's copy, probe_kernel/cuda_step_kernel.cuh; the library's step has none of these hooks).
//
// The flags. Bare: stream every block, skip the decode and the MMAs (y is wrong); no scales (bare only): leave out
// the scale words' copies; prefetch: ask the L2 cache for the CTA's down-GEMM weights once its last gate/up block is
// asked for (y right); no load: no copies at all, each stage counted as landed at once (the computing warpgroups
// alone; y is wrong); touch: the idle warp reads one word at the start of each of the CTA's tiles first (touch_tiles;
// y right); empty: every thread returns at once (the launch of this shape alone; y is wrong); plain: the step
// launched without the cooperative attribute (what the attribute costs; y right while nothing else holds an SM);
// ahead: as a tile's copies start, the first line of the CTA's next tile is asked of the L2 cache (prefetch_tile_l2;
// y right); no wait: the input warp reads each item's down-GEMM input row without waiting for the item's gate/up
// tiles in every CTA (the step without its one dependency between CTAs, what that dependency costs; y is wrong);
// relaxed: the release warp raises the per-item counts without the release (red.relaxed.gpu, so no gpu-scope fence
// after each gate/up tile; what those fences cost; y is right only if the counts happen to be seen after the outputs
// they count, which nothing then guarantees); regs: no ring and no copies, each computing warpgroup loads its own
// stages straight into registers, one stage ahead (y right; with bare, its stream alone; with no wait, its own
// instance too: the stream without the dependency); regs L1: the same for the gate/up tiles only, while the load
// warp streams the down tiles' stages through the ring from the start (y right); LL: each gate/up epilogue also
// stores its outputs as LL words, which three input warps read until every word carries the launch's flag, instead
// of a count per item, a release and a read after it (y right); LL combine: each down tile's outputs as LL words
// too, and the CTA with the last item's tile of a 64-column slice reads the others' and writes y there, instead of a
// count per slice and a read after it (y right). Bare, no scales, prefetch, no load and plain are read at run time
// by any instance (the step's own code has them); the others are compiled into instances of their own
// (probe_step.cu's kInstances lists the combinations).
#pragma once

#include "probe_kernel/cuda_step_kernel.cuh"

namespace {
namespace probe {

__device__ __forceinline__ void add_relaxed(uint32_t* count, uint32_t v) {  // mode relaxed: no release
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(count), "r"(v) : "memory");
}

// The k-th tile of CTA `cta` of `G`'s list (Schedule::walk), -1 past its end; l2: whether it is a down-GEMM tile.
// The register stream's way through the list, a tile at a time; on the host too, for probes_check.cu.
#pragma nv_exec_check_disable
__host__ __device__ inline int nth(const Schedule& sched, int cta, int G, int k, bool& l2) {
  int i = 0, found = -1;
  bool in_l2 = false;
  sched.walk(cta, G, [&](int tile, bool) { found = i++ == k ? tile : found; },
             [&](int tile) {
               if (i++ == k) found = tile, in_l2 = true;
             });
  l2 = in_l2;
  return found;
}

// ---- LL words (probe mode LL): a signal and the data it guards in one 8-byte access ----
// An LL word is 4 data bytes (low half) and a 32-bit flag (high half), stored and loaded as one 64-bit scalar, which
// is single-copy atomic: a reader that sees this launch's flag sees the data the writer put beside it. So a signal
// needs no fence, no count and no second read. The flag is the launch's (launch_flag), so no word needs resetting.

__device__ __forceinline__ void ll_store(uint64_t* word, uint32_t data, uint32_t flag) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(word), "l"((uint64_t(flag) << 32) | data) : "memory");
}

__device__ __forceinline__ uint64_t ll_load(const uint64_t* word) {  // from the L2 cache (relaxed, GPU scope)
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(word) : "memory");
  return v;
}

__device__ __forceinline__ bool ll_ready(uint64_t v, uint32_t flag) { return uint32_t(v >> 32) == flag; }

// n <= N LL words at word + stride j (j < n) -> v[j], each loaded again until it carries `flag`; a round's loads go
// out together.
template <int N>
__device__ __forceinline__ void ll_wait(uint64_t (&v)[N], const uint64_t* word, size_t stride, int n, uint32_t flag) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = j < n ? ll_load(word + j * stride) : uint64_t(flag) << 32;
  bool done;
  do {
    done = true;
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (!ll_ready(v[j], flag)) {
        v[j] = ll_load(word + j * stride);
        done = false;
      }
  } while (!done);
}

// The launch count: every LL launch adds 2**16 to it in all (CTA 0 2**16 - G + 1, each other CTA 1, as it ends), so a
// CTA that reads it before it adds its own share reads 2**16 n + (less than 2**16) whatever the others have done.
// Its flag: the launch number with the top bit set (never the 0 of a fresh buffer); it repeats after 2**31 launches.
// (On the host too, for probes_check.cu.)
__host__ __device__ __forceinline__ uint32_t launch_flag(uint64_t count) {
  return 0x80000000u | (uint32_t(count >> 16) & 0x7FFFFFFFu);
}

__host__ __device__ __forceinline__ uint64_t launch_share(int cta, int G) { return cta == 0 ? 65536u - G + 1 : 1u; }

__device__ __forceinline__ void launch_done(uint64_t* count) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(count), "l"(launch_share(blockIdx.x, gridDim.x))
               : "memory");
}

// Probe modes LL and LL combine: Params::sync past its counts (H/64 combine counts, kMaxTopK L1 counts, CTAs done),
// 8-byte aligned: the launch count; per item its L2 input row as LL words (`in`, word w < I/4: codes 4w .. 4w + 3;
// then one per 32 channels: the scale); per item its L2 outputs as LL words (`out`, 64-column tile ot's word
// 8 (r / 16) + r % 16 for r % 16 < 8: the bf16 bits of rows r (low) and r + 8 (high)). step.py's sync_words sizes
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

// Probe modes regs and regs L1: a computing warpgroup loads its stages of the CTA's tiles (regs L1: of its L1 tiles
// only), in the order it computes them, straight into registers, one stage ahead of the one it computes. `ahead`
// holds the next stage, which lies in the CTA's k-th tile (tile, l2 as nth gives them) from block b of
// the warpgroup's quarter of its K.
struct RegisterStream {
  StageRegs ahead;
  int k, b, tile;
  bool l2, l1_only;

  __device__ void start(const Params& p, const Schedule& sched, const int* expert, int wg, int t, bool only_l1) {
    k = b = 0;
    l1_only = only_l1;
    tile = nth(sched, blockIdx.x, gridDim.x, 0, l2);
    skip(sched);
    next(p, sched, expert, wg, t);
  }

  __device__ void skip(const Schedule& sched) {  // regs L1: past the L2 tiles, which come through the ring
    while (l1_only && tile >= 0 && l2) tile = nth(sched, blockIdx.x, gridDim.x, ++k, l2);
  }

  // The loads of the next stage into `ahead` (nothing past the CTA's last tile); their values are waited for where
  // they are first used.
  __device__ void next(const Params& p, const Schedule& sched, const int* expert, int wg, int t) {
    if (tile < 0) return;
    const int nb = l2 ? p.I / 128 : p.H / 128, tpe = l2 ? p.H / 64 : p.I / 32;
    const size_t blk = weight_tile(expert, tile, tpe) * nb + wg * (nb / kParts) + b;  // as the load warp's issue_tile
    stage_read<true>((l2 ? p.l2_codes : p.l1_codes) + blk * 4096, (l2 ? p.l2_scales : p.l1_scales) + blk * 256, t,
                     ahead);
    b += kBlocks;
    if (b == nb / kParts) {
      b = 0;
      tile = nth(sched, blockIdx.x, gridDim.x, ++k, l2);
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

// Probe mode LL: the same, then the 32 codes and the scale as LL words of the item's row, for the input warps.
__device__ __forceinline__ void l1_epilogue_ll(const Params& p, const float* ep, const Items& it, int item, int ct,
                                               int t, uint32_t flag) {
  float sf;
  const uint32_t code = gate_up_epilogue(p, ep, it, item, ct, t, sf);
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
  constexpr int kPerLane = 6;  // 96 lanes x 6 = 576 words: I <= 2,048 in one round (cuda_step.geometry_limits)
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

// Probe mode LL: input warp iw of three (lane), for each of the CTA's items in the order its L2 tiles come: the row
// from its LL words into shared memory (hs + item hrow, sf2 + item I/32), then one arrival on input_ready[item].
__device__ __forceinline__ void ll_input_warp(const Params& p, const Schedule& sched, int iw, int lane, uint32_t flag,
                                              uint8_t* hs, int hrow, float* sf2, uint64_t* input_ready) {
  for_each_down_item(sched, [&](int item) {
    ll_input_row(p, item, iw, lane, flag, hs + item * hrow, sf2 + item * (p.I / 32));
    fence_async_smem();  // for the warpgroups' MMAs, which read the codes through the async proxy
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(&input_ready[item]);
      if (iw == 0) stamp(p, 4);  // the last L2 input in (the last one's stamp stays)
    }
  });
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

}  // namespace probe

// The probe instances' hooks (cuda_step_kernel.cuh's ProbeHooks, specialized for every kProbe != 0): the building
// blocks above, under the names the kernel calls them by.
template <int kProbe>
struct ProbeHooks<kProbe, true> {
  using RegStream = probe::RegisterStream;

  __device__ static uint64_t launch_count(const Params& p) { return probe::ll_load(probe::LLRows(p).count); }
  __device__ static uint32_t launch_flag(uint64_t count) { return probe::launch_flag(count); }
  __device__ static void launch_done(const Params& p) { probe::launch_done(probe::LLRows(p).count); }
  __device__ static void add_relaxed(uint32_t* count, uint32_t v) { probe::add_relaxed(count, v); }
  __device__ static void touch_tiles(const Params& p, const Schedule& sched, const int* expert, int lane) {
    probe::touch_tiles(p, sched, expert, lane);
  }
  __device__ static void prefetch_tile_l2(const Params& p, const Schedule& sched, const int* expert, int tile,
                                          bool l1) {
    probe::prefetch_tile_l2(p, sched, expert, tile, l1);
  }
  __device__ static void l1_epilogue_ll(const Params& p, const float* ep, const Items& it, int item, int ct, int t,
                                        uint32_t flag) {
    probe::l1_epilogue_ll(p, ep, it, item, ct, t, flag);
  }
  __device__ static void ll_input_warp(const Params& p, const Schedule& sched, int iw, int lane, uint32_t flag,
                                       uint8_t* hs, int hrow, float* sf2, uint64_t* input_ready) {
    probe::ll_input_warp(p, sched, iw, lane, flag, hs, hrow, sf2, input_ready);
  }
  __device__ static void ll_combine(const Params& p, const Items& it, int item, int ot, int r0, uint32_t b0,
                                    uint32_t b1, uint32_t flag) {
    probe::ll_combine(p, it, item, ot, r0, b0, b1, flag);
  }
};

}  // namespace
