// Host check of the 1-token CUDA step's tile order: megamoe/decode/cuda/cuda_step_params.cuh's Schedule, the code the
// kernel runs. For many grids, expert counts, tiles per expert and lags:
//   - every L1 and L2 tile is some CTA's, exactly once, and `last` marks each CTA's last L1 tile;
//   - the CTAs cannot deadlock: each L2 tile waits for all of its item's L1 tiles and a CTA takes its tiles in order,
//     simulated greedily until every CTA is through its list or none can move;
// A hand-made order that must deadlock checks that the simulation can tell.
//
//     nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -o schedule_check tests/cuda/schedule_check.cu
//     ./schedule_check      (prints the cases and failures; exit 1 on a failure)
#include <cstdio>
#include <vector>

#include "../../megamoe/decode/cuda/cuda_step_params.cuh"

struct Step {
  bool l2;
  int tile;
};

// Greedy run of the CTAs' lists: whether every CTA gets through (no deadlock).
static bool runs_to_end(const std::vector<std::vector<Step>>& lists, int items, int tpe1, int tpe2) {
  std::vector<size_t> pos(lists.size(), 0);
  std::vector<int> done(items, 0);  // L1 tiles finished per item
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t c = 0; c < lists.size(); ++c)
      for (; pos[c] < lists[c].size(); ++pos[c], moved = true) {
        const Step st = lists[c][pos[c]];
        if (st.l2 && done[st.tile / tpe2] < tpe1) break;  // its item's L1 tiles are not all done
        if (!st.l2) ++done[st.tile / tpe1];
      }
  }
  for (size_t c = 0; c < lists.size(); ++c)
    if (pos[c] != lists[c].size()) return false;
  return true;
}

static const char* check(int G, int n, int tpe1, int tpe2, int lag) {
  const Schedule s{n * tpe1, n * tpe2, tpe1, tpe2, lag};
  std::vector<std::vector<Step>> lists(G);
  std::vector<int> seen1(s.n1, 0), seen2(s.n2, 0);
  bool last_ok = true;
  for (int c = 0; c < G; ++c) {
    int last_l1 = -1, marked = -1;
    s.walk(c, G, [&](int t, bool last) {
      lists[c].push_back({false, t});
      ++seen1[t];
      last_l1 = t;
      if (last) marked = t;
    }, [&](int t) {
      lists[c].push_back({true, t});
      ++seen2[t];
    });
    last_ok &= marked == last_l1;
  }
  for (int v : seen1)
    if (v != 1) return "an L1 tile not taken exactly once";
  for (int v : seen2)
    if (v != 1) return "an L2 tile not taken exactly once";
  if (!last_ok) return "`last` not on a CTA's last L1 tile";
  if (!runs_to_end(lists, n, tpe1, tpe2)) return "deadlock";
  return nullptr;
}

int main() {
  // The control: CTA 0 takes item 0's L2 tile before item 0's L1 tile 0, which only it holds.
  const std::vector<std::vector<Step>> stuck = {{{true, 0}, {false, 0}}, {{false, 1}}};
  if (runs_to_end(stuck, 1, 2, 1)) {
    std::printf("the deadlock control ran to the end: the simulation cannot tell\n");
    return 1;
  }
  int cases = 0, failed = 0;
  const int grids[] = {1, 2, 3, 7, 66, 114, 132};
  const int tpes[][2] = {{64, 64}, {32, 16}, {16, 64}, {128, 32}, {64, 128}};
  const int lags[] = {0, 1, 2, 3, 9};
  for (int G : grids)
    for (int n = 0; n <= kMaxTopK; ++n)
      for (const auto& tpe : tpes)
        for (int lag : lags) {
          ++cases;
          if (const char* why = check(G, n, tpe[0], tpe[1], lag)) {
            ++failed;
            std::printf("G %d, items %d, tiles per item %d / %d, lag %d: %s\n", G, n, tpe[0], tpe[1], lag, why);
          }
        }
  std::printf("%d cases, %d failed\n", cases, failed);
  return failed != 0;
}
