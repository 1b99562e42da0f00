// Host check of the LL probe modes' launch flag: megamoe/decode/cuda/step1_probes.cuh's launch_flag and
// launch_share, the code the kernel runs. Each CTA reads the launch count at its start and adds its share at its
// end; within a launch the CTAs' reads and adds interleave in any order that keeps each CTA's read before its own
// add, and a launch begins after the previous one has ended. Over many grids and random interleavings:
//   - every CTA of a launch gets the same flag;
//   - it differs from the previous launch's flag and from 0 (a fresh buffer's words), so no word an earlier
//     launch (or nothing) wrote is taken for this launch's;
// and a control where CTA 0 adds its share without the others' cannot tell launches apart (the check can fail).
//
//     nvcc -std=c++17 -o ll_flag_check tests/cuda/ll_flag_check.cu && ./ll_flag_check   (exit 1 on a failure)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "../../megamoe/decode/cuda/step1_probes.cuh"

// One launch of G CTAs on `count` in a random interleaving -> whether all CTAs got one flag, and which.
static bool launch(uint64_t& count, int G, std::mt19937& rng, uint32_t& flag, bool only_cta0_adds = false) {
  std::vector<int> order;  // each CTA appears twice: its read, then its add
  for (int c = 0; c < G; ++c) order.insert(order.end(), {c, c});
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int> seen(G, 0);
  std::vector<uint32_t> flags(G);
  for (int c : order) {
    if (seen[c]++ == 0)
      flags[c] = launch_flag(count);
    else if (!only_cta0_adds || c == 0)
      count += launch_share(c, G);
  }
  flag = flags[0];
  for (uint32_t f : flags)
    if (f != flag) return false;
  return true;
}

int main() {
  std::mt19937 rng(1234);
  int cases = 0, failed = 0;
  for (int G : {1, 2, 3, 7, 66, 114, 132, 1024}) {
    uint64_t count = 0;
    uint32_t before = 0;  // a fresh buffer's LL words carry flag 0
    for (int n = 0; n < 200; ++n, ++cases) {
      uint32_t flag;
      if (!launch(count, G, rng, flag)) {
        std::printf("G %d, launch %d: the CTAs got different flags\n", G, n);
        ++failed;
      } else if (flag == before) {
        std::printf("G %d, launch %d: flag %08x again\n", G, n, flag);
        ++failed;
      }
      before = flag;
    }
  }
  std::printf("%d launches, %d failed\n", cases, failed);
  // The control: with only CTA 0's share added, consecutive launches of more than one CTA share a flag.
  uint64_t count = 0;
  uint32_t a, b;
  launch(count, 132, rng, a, true);
  launch(count, 132, rng, b, true);
  if (a != b) {
    std::printf("the control's launches got different flags: the check cannot tell\n");
    return 1;
  }
  return failed != 0;
}
