// Host checks of two probe building blocks (probes.cuh), the code the probe instances run.
//
// The LL modes' launch flag, launch_flag and launch_share. Each CTA reads the launch count at its start and adds its share at its
// end; within a launch the CTAs' reads and adds interleave in any order that keeps each CTA's read before its own
// add, and a launch begins after the previous one has ended. Over many grids and random interleavings:
//   - every CTA of a launch gets the same flag;
//   - it differs from the previous launch's flag and from 0 (a fresh buffer's words), so no word an earlier
//     launch (or nothing) wrote is taken for this launch's;
// and a control where CTA 0 adds its share without the others' cannot tell launches apart (the check can fail).
//
// The register stream's way through a CTA's tiles, nth: over many grids, items, tiles per item and lags it gives
// each CTA's list (Schedule::walk) in order, then -1; and a control list with two tiles swapped must disagree.
//
//     nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -o probes_check lab/cuda_step/probes_check.cu
//     ./probes_check      (prints the cases and failures; exit 1 on a failure)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "probes.cuh"

using probe::launch_flag;
using probe::launch_share;

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

struct Step {
  bool l2;
  int tile;
};

// Whether nth walks CTA c's list `list` in order, then gives -1.
static bool nth_agrees(const Schedule& s, int c, int G, const std::vector<Step>& list) {
  for (size_t k = 0; k <= list.size(); ++k) {
    bool l2 = false;
    const int tile = probe::nth(s, c, G, int(k), l2);
    if (k == list.size() ? tile != -1 : tile != list[k].tile || l2 != list[k].l2) return false;
  }
  return true;
}

// nth over many grids and shapes -> the failed cases' count; `cases` counts them all.
static int check_nth(int& cases) {
  int failed = 0;
  const int tpes[][2] = {{64, 64}, {32, 16}, {16, 64}, {128, 32}};
  for (int G : {1, 2, 3, 7, 66, 132})
    for (int n = 0; n <= kMaxTopK; ++n)
      for (const auto& tpe : tpes)
        for (int lag : {0, 1, 2, 9}) {
          ++cases;
          const Schedule s{n * tpe[0], n * tpe[1], tpe[0], tpe[1], lag};
          for (int c = 0; c < G; ++c) {
            std::vector<Step> list;
            s.walk(c, G, [&](int t, bool) { list.push_back({false, t}); }, [&](int t) { list.push_back({true, t}); });
            if (!nth_agrees(s, c, G, list)) {
              std::printf("nth: G %d, items %d, tiles per item %d / %d, lag %d, CTA %d disagrees with its list\n", G,
                          n, tpe[0], tpe[1], lag, c);
              ++failed;
              break;
            }
          }
        }
  return failed;
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
  int nth_cases = 0;
  const int nth_failed = check_nth(nth_cases);
  std::printf("nth: %d cases, %d failed\n", nth_cases, nth_failed);
  // The control: with only CTA 0's share added, consecutive launches of more than one CTA share a flag.
  uint64_t count = 0;
  uint32_t a, b;
  launch(count, 132, rng, a, true);
  launch(count, 132, rng, b, true);
  if (a != b) {
    std::printf("the control's launches got different flags: the check cannot tell\n");
    return 1;
  }
  // nth's control: CTA 0's list (G = 2, 2 items of 4 / 2 tiles) with its first two tiles swapped must disagree.
  const Schedule s{8, 4, 4, 2, 0};
  std::vector<Step> list;
  s.walk(0, 2, [&](int t, bool) { list.push_back({false, t}); }, [&](int t) { list.push_back({true, t}); });
  std::swap(list[0], list[1]);
  if (nth_agrees(s, 0, 2, list)) {
    std::printf("nth agreed with a list in the wrong order: the check cannot tell\n");
    return 1;
  }
  return failed != 0 || nth_failed != 0;
}
