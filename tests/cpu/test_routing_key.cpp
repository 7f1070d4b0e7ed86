// The routing order as 32-bit keys (src/routing/routing_key.h), which the top-K warp reductions
// compare with redux.sync: key order = float order (signed zeros equal), exact round trip, the taken
// key below every logit; and the kernel's selection (lane-local best, warp max key, then the lowest
// expert holding it) replayed on the CPU against the reference's stable sort on tie-heavy rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "routing/routing_key.h"

namespace r = smoe::routing;

namespace {

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// The values where an order map goes wrong first, then random bit patterns (NaN left out: the
// routing maps NaN to -inf before it makes a key).
std::vector<float> probe_values(uint64_t seed, int random_count) {
  const float inf = std::numeric_limits<float>::infinity();
  const float dmin = std::numeric_limits<float>::denorm_min();
  const float nmin = std::numeric_limits<float>::min();
  const float fmax = std::numeric_limits<float>::max();
  std::vector<float> v = {-inf, -fmax, -1.5f, -1.f, -nmin, -dmin, -0.f, 0.f, dmin, nmin, 1.f, 1.5f, fmax, inf,
                          std::nextafter(1.f, 2.f), std::nextafter(-1.f, -2.f), std::nextafter(0.f, 1.f)};
  std::mt19937_64 rng(seed);
  while (static_cast<int>(v.size()) < 17 + random_count) {
    const uint32_t u = static_cast<uint32_t>(rng());
    float x;
    std::memcpy(&x, &u, sizeof x);
    if (!std::isnan(x)) v.push_back(x);
  }
  return v;
}

}  // namespace

TEST(RoutingKey, OrderAndEqualityMatchTheFloats) {
  const std::vector<float> v = probe_values(20261207, 400);
  for (float a : v)
    for (float b : v) {
      ASSERT_EQ(r::routing_key(a) > r::routing_key(b), a > b) << a << " vs " << b;
      ASSERT_EQ(r::routing_key(a) == r::routing_key(b), a == b) << a << " vs " << b;
    }
}

TEST(RoutingKey, RoundTripsExactlyAndZerosShareAKey) {
  for (float x : probe_values(7, 20000)) {
    const float back = r::routing_value(r::routing_key(x));
    if (x == 0.f)
      ASSERT_EQ(bits(back), bits(0.f)) << "-0 and +0 come back as +0";
    else
      ASSERT_EQ(bits(back), bits(x)) << x;
  }
  EXPECT_EQ(r::routing_key(-0.f), r::routing_key(0.f));
}

TEST(RoutingKey, TakenKeyRanksBelowEveryLogit) {
  for (float x : probe_values(11, 20000)) ASSERT_GT(r::routing_key(x), r::kTakenKey) << x;
  EXPECT_EQ(r::routing_key(-std::numeric_limits<float>::infinity()), 0x007FFFFFu);
}

// The kernel's rounds (src/routing/warp_topk.cuh) on one row, lane by lane: each lane's best untaken
// key (strict >: its lowest slot among equals), the warp's largest key (redux max), the lowest expert
// among the lanes holding it (redux min).
std::vector<int> warp_rounds(const std::vector<float>& row, int K) {
  const int E = static_cast<int>(row.size());
  int J = 1;
  while (32 * J < E) J *= 2;
  std::vector<uint32_t> key(32 * static_cast<size_t>(J), r::kTakenKey);
  for (int e = 0; e < E; ++e) key[e] = r::routing_key(row[e]);  // slot (lane, j) is expert lane + 32 j
  std::vector<uint32_t> taken(32, 0);
  std::vector<int> chosen;
  for (int k = 0; k < K; ++k) {
    uint32_t lane_key[32];
    int lane_slot[32];
    for (int lane = 0; lane < 32; ++lane) {
      lane_key[lane] = r::kTakenKey;
      lane_slot[lane] = 0;
      for (int j = 0; j < J; ++j) {
        const uint32_t kk = ((taken[lane] >> j) & 1u) ? r::kTakenKey : key[lane + 32 * j];
        if (kk > lane_key[lane]) {
          lane_key[lane] = kk;
          lane_slot[lane] = j;
        }
      }
    }
    const uint32_t best = *std::max_element(lane_key, lane_key + 32);
    unsigned bi = 0xffffffffu;
    for (int lane = 0; lane < 32; ++lane)
      if (lane_key[lane] == best) bi = std::min(bi, static_cast<unsigned>(lane + 32 * lane_slot[lane]));
    taken[bi & 31] |= 1u << (bi >> 5);
    chosen.push_back(static_cast<int>(bi));
  }
  return chosen;
}

TEST(RoutingKey, WarpRoundsChooseAsTheStableSort) {
  std::mt19937_64 rng(20261207);
  const float inf = std::numeric_limits<float>::infinity();
  const float tie_values[] = {-inf, -1.f, -0.f, 0.f, 1.f, 2.f, inf};
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int E : {1, 2, 5, 31, 32, 33, 64, 100, 128, 129, 256, 300, 511, 512})
    for (int K : {1, 2, 8, 16}) {
      if (K > E) continue;
      for (int trial = 0; trial < 40; ++trial) {
        std::vector<float> row(static_cast<size_t>(E));
        for (float& x : row)
          x = trial % 2 ? tie_values[rng() % 7] : normal(rng);
        std::vector<int> order(static_cast<size_t>(E));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
        order.resize(static_cast<size_t>(K));
        ASSERT_EQ(warp_rounds(row, K), order) << "E " << E << " K " << K << " trial " << trial;
      }
    }
}
