// Tests of the float64 reference token rounding (SonicMoE "TR" routing).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "smoe/reference.h"
#include "test_seed.h"

using namespace smoe::ref;

namespace {

using smoe_test::fresh_seed;
using smoe_test::Rng;

const RoundingMode kAllModes[] = {RoundingMode::kNearest, RoundingMode::kUp, RoundingMode::kDown,
                                  RoundingMode::kStochastic};

const char* mode_name(RoundingMode m) {
  switch (m) {
    case RoundingMode::kNearest: return "NR";
    case RoundingMode::kUp: return "UP";
    case RoundingMode::kDown: return "DOWN";
    case RoundingMode::kStochastic: return "SR";
  }
  return "?";
}

std::vector<double> softmax_row(const std::vector<double>& logits, int64_t t, int E) {
  std::vector<double> p(static_cast<size_t>(E));
  double mx = -std::numeric_limits<double>::infinity();
  for (int e = 0; e < E; ++e) mx = std::max(mx, logits[t * E + e]);
  double sum = 0.0;
  for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[t * E + e] - mx));
  for (auto& v : p) v /= sum;
  return p;
}

// Checks a token-rounding routing against its top-K routing, without re-implementing the sort:
// structure, counts, "chosen first" rule, best padded / worst dropped, and scores.
void expect_token_rounding_valid(const std::vector<double>& logits, int64_t T, int E, int K,
                                 int m_tile, RoundingMode mode, uint64_t seed,
                                 const GeneralRouting& g) {
  SCOPED_TRACE(::testing::Message() << "mode=" << mode_name(mode) << " m_tile=" << m_tile);
  const TopKRouting topk = topk_softmax_ref(logits, T, E, K);
  ASSERT_EQ(g.T, T);
  ASSERT_EQ(g.E, E);
  ASSERT_EQ(g.token_offset.size(), static_cast<size_t>(T + 1));
  ASSERT_EQ(g.token_offset[0], 0);
  ASSERT_EQ(g.expert.size(), static_cast<size_t>(g.nnz()));
  ASSERT_EQ(g.score.size(), static_cast<size_t>(g.nnz()));

  // kept[t][e] = score, for the kept entries; token-major, strictly ascending expert.
  std::vector<std::map<int, double>> kept(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    ASSERT_LE(g.token_offset[t], g.token_offset[t + 1]);
    for (int64_t j = g.token_offset[t]; j < g.token_offset[t + 1]; ++j) {
      ASSERT_GE(g.expert[j], 0);
      ASSERT_LT(g.expert[j], E);
      if (j > g.token_offset[t]) {
        EXPECT_LT(g.expert[j - 1], g.expert[j]) << "token " << t << ": not strictly ascending";
      }
      EXPECT_TRUE(kept[t].emplace(g.expert[j], g.score[j]).second)
          << "token " << t << " lists expert " << g.expert[j] << " twice";
    }
  }

  // chosen score of (t, e), or -1 when not chosen.
  std::vector<double> chosen(static_cast<size_t>(T * E), -1.0);
  std::vector<int64_t> freq(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      chosen[t * E + topk.expert[t * K + k]] = topk.score[t * K + k];
      freq[topk.expert[t * K + k]] += 1;
    }

  for (int e = 0; e < E; ++e) {
    SCOPED_TRACE(::testing::Message() << "expert " << e << " f_e=" << freq[e]);
    int64_t count = 0, kept_chosen = 0, kept_other = 0;
    double min_kept_chosen = 2.0, max_dropped_chosen = -2.0;
    double min_kept_other = 2.0, max_dropped_other = -2.0;
    for (int64_t t = 0; t < T; ++t) {
      const bool is_kept = kept[t].count(e) > 0;
      const double cs = chosen[t * E + e];
      const double s_full = softmax_row(logits, t, E)[e];
      count += is_kept;
      if (cs >= 0.0) {
        if (is_kept) {
          ++kept_chosen;
          min_kept_chosen = std::min(min_kept_chosen, cs);
          EXPECT_EQ(kept[t][e], cs) << "token " << t << ": chosen entry must keep its top-K score";
        } else {
          max_dropped_chosen = std::max(max_dropped_chosen, cs);
        }
      } else {
        if (is_kept) {
          ++kept_other;
          min_kept_other = std::min(min_kept_other, s_full - 1.0);
          EXPECT_NEAR(kept[t][e], s_full, 1e-15) << "token " << t << ": padded score must be S[t][e]";
        } else {
          max_dropped_other = std::max(max_dropped_other, s_full - 1.0);
        }
      }
    }
    // Count: the rounded count, a multiple of m_tile or clamped to T, within one tile of f_e.
    EXPECT_EQ(count, rounded_count(freq[e], T, m_tile, mode, seed, e));
    EXPECT_TRUE(count % m_tile == 0 || count == T) << "count " << count;
    EXPECT_LT(std::abs(count - freq[e]), m_tile);
    if (mode == RoundingMode::kNearest) { EXPECT_LE(2 * std::abs(count - freq[e]), m_tile); }
    if (mode == RoundingMode::kUp) { EXPECT_GE(count, freq[e]); }
    if (mode == RoundingMode::kDown) { EXPECT_LE(count, freq[e]); }
    // Every chosen token comes before any non-chosen one.
    if (kept_other > 0) { EXPECT_EQ(kept_chosen, freq[e]) << "padded while dropping a chosen token"; }
    EXPECT_EQ(kept_chosen, std::min(count, freq[e]));
    if (mode == RoundingMode::kUp) { EXPECT_EQ(kept_chosen, freq[e]); }
    if (mode == RoundingMode::kDown) { EXPECT_EQ(kept_other, 0); }
    // Dropped chosen tokens are the worst chosen; padded tokens are the best non-chosen.
    if (kept_chosen > 0) { EXPECT_GE(min_kept_chosen, max_dropped_chosen); }
    // Non-chosen tokens rank by S' = S - 1 (which cannot resolve S below ~1e-16: those all tie at
    // -1 and go lower token first); allow a few ulps of 1 for the test's own softmax.
    if (kept_other > 0) { EXPECT_GE(min_kept_other, max_dropped_other - 1e-15); }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// uniform01 / rounded_count
// ---------------------------------------------------------------------------------------------

TEST(Uniform01Ref, GoldenValueAndRange) {
  // splitmix64(0) = 0xE220A8397B1DCDAF (the first output of a zero-seeded splitmix64), so with
  // seed = splitmix64(0) and expert 0 the draw is splitmix64(0) again: its top 53 bits * 2^-53.
  const uint64_t sm0 = 0xE220A8397B1DCDAFULL;
  EXPECT_EQ(uniform01(sm0, 0), static_cast<double>(sm0 >> 11) * std::ldexp(1.0, -53));
  // Known second value: splitmix64(0x9E3779B97F4A7C15) = 0x6E789E6AA1B965F4.
  EXPECT_EQ(uniform01(sm0 ^ 0x9E3779B97F4A7C15ULL, 0),
            static_cast<double>(0x6E789E6AA1B965F4ULL >> 11) * std::ldexp(1.0, -53));

  Rng rng;
  TRACE_SEED(rng);
  double sum = 0.0;
  const int N = 20000;
  for (int i = 0; i < N; ++i) {
    const uint64_t seed = rng.gen();
    const int e = static_cast<int>(rng.gen() % 256);
    const double u = uniform01(seed, e);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    EXPECT_EQ(u, uniform01(seed, e));  // deterministic
    sum += u;
  }
  EXPECT_NEAR(sum / N, 0.5, 0.02);
  // Different experts of one seed draw different values.
  const uint64_t seed = rng.gen();
  std::set<double> seen;
  for (int e = 0; e < 64; ++e) seen.insert(uniform01(seed, e));
  EXPECT_EQ(seen.size(), 64u);
}

TEST(RoundedCountRef, HandMadeCases) {
  const uint64_t seed = 12345;
  // Multiples (and zero) never change.
  for (RoundingMode mode : kAllModes)
    for (int64_t f : {0, 4, 8, 64}) EXPECT_EQ(rounded_count(f, 64, 4, mode, seed, 0), f);
  // f = 5, m = 4.
  EXPECT_EQ(rounded_count(5, 64, 4, RoundingMode::kNearest, seed, 0), 4);
  EXPECT_EQ(rounded_count(5, 64, 4, RoundingMode::kUp, seed, 0), 8);
  EXPECT_EQ(rounded_count(5, 64, 4, RoundingMode::kDown, seed, 0), 4);
  // f = 7, m = 4.
  EXPECT_EQ(rounded_count(7, 64, 4, RoundingMode::kNearest, seed, 0), 8);
  EXPECT_EQ(rounded_count(7, 64, 4, RoundingMode::kUp, seed, 0), 8);
  EXPECT_EQ(rounded_count(7, 64, 4, RoundingMode::kDown, seed, 0), 4);
  // f < m_tile.
  EXPECT_EQ(rounded_count(3, 64, 128, RoundingMode::kNearest, seed, 0), 0);
  EXPECT_EQ(rounded_count(3, 64, 128, RoundingMode::kDown, seed, 0), 0);
  EXPECT_EQ(rounded_count(3, 64, 128, RoundingMode::kUp, seed, 0), 64);  // clamped to T
  // Clamp to T.
  EXPECT_EQ(rounded_count(62, 64, 8, RoundingMode::kUp, seed, 0), 64);
  EXPECT_EQ(rounded_count(62, 63, 8, RoundingMode::kUp, seed, 0), 63);
  EXPECT_EQ(rounded_count(62, 63, 8, RoundingMode::kNearest, seed, 0), 63);
  EXPECT_EQ(rounded_count(62, 63, 8, RoundingMode::kDown, seed, 0), 56);
  // m_tile = 1 is the identity.
  for (RoundingMode mode : kAllModes)
    for (int64_t f = 0; f <= 9; ++f) EXPECT_EQ(rounded_count(f, 9, 1, mode, seed, 3), f);
}

TEST(RoundedCountRef, NearestTiesRoundDown) {
  for (int m : {2, 4, 8, 16, 128}) {
    for (int64_t k = 0; k < 4; ++k) {
      const int64_t T = 10 * 128;
      const int64_t f = m / 2 + k * m;  // exactly half a tile past k*m
      EXPECT_EQ(rounded_count(f, T, m, RoundingMode::kNearest, 0, 0), k * m) << "m=" << m << " f=" << f;
      if (m > 2) {
        EXPECT_EQ(rounded_count(f + 1, T, m, RoundingMode::kNearest, 0, 0), (k + 1) * m);
        EXPECT_EQ(rounded_count(f - 1, T, m, RoundingMode::kNearest, 0, 0), k * m);
      }
    }
  }
}

TEST(RoundedCountRef, StochasticIsSeededAndUnbiased) {
  Rng rng;
  TRACE_SEED(rng);
  const int m = 8;
  const int64_t T = 1000;
  for (int64_t f : {17, 20, 22, 31}) {
    const int64_t lo = f - f % m, hi = lo + m;
    const double p = static_cast<double>(f % m) / m;
    int ups = 0;
    const int N = 20000;
    for (int i = 0; i < N; ++i) {
      const uint64_t seed = rng.gen();
      const int e = static_cast<int>(rng.gen() % 64);
      const int64_t c = rounded_count(f, T, m, RoundingMode::kStochastic, seed, e);
      ASSERT_TRUE(c == lo || c == hi) << "f=" << f << " c=" << c;
      EXPECT_EQ(c, rounded_count(f, T, m, RoundingMode::kStochastic, seed, e));
      EXPECT_EQ(c == hi, uniform01(seed, e) < p);
      ups += (c == hi);
    }
    // Binomial: sd <= 0.0036 here; 0.02 is > 5 sd.
    EXPECT_NEAR(static_cast<double>(ups) / N, p, 0.02) << "f=" << f;
  }
}

// ---------------------------------------------------------------------------------------------
// token_rounding_ref
// ---------------------------------------------------------------------------------------------

TEST(TokenRoundingRef, InvariantsOnRandomRoutings) {
  Rng rng;
  TRACE_SEED(rng);
  struct Case { int64_t T; int E, K, m; };
  for (const Case& c : {Case{64, 8, 2, 4}, Case{64, 8, 1, 8}, Case{50, 6, 3, 4}, Case{33, 4, 2, 16},
                        Case{40, 8, 8, 8}, Case{24, 5, 2, 3}, Case{16, 8, 2, 128}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K);
    for (int rep = 0; rep < 3; ++rep) {
      const std::vector<double> logits = rng.normals(c.T * c.E, 2.0);
      const uint64_t seed = rng.gen();
      for (RoundingMode mode : kAllModes) {
        const GeneralRouting g = token_rounding_ref(logits, c.T, c.E, c.K, c.m, mode, seed);
        expect_token_rounding_valid(logits, c.T, c.E, c.K, c.m, mode, seed, g);
        // Metadata of a token-rounding routing is well formed.
        const RoutingMetadata md = routing_metadata_ref(g);
        EXPECT_EQ(md.expert_offset.back(), g.nnz());
      }
    }
  }
}

// Hand-made case (T=4, E=3, K=2, m_tile=2) where a chosen token has a lower softmax score than
// several non-chosen ones, so only the S' = S - 1 construction keeps it.
TEST(TokenRoundingRef, HandMadeUpDownNearest) {
  const std::vector<double> logits = {
      0.0, 5.0, -10.0,  // t0: chooses 1, 0 (score of 0 ~ 0.0067)
      2.0, 3.0, 3.2,    // t1: chooses 2, 1
      2.5, 3.1, 3.0,    // t2: chooses 1, 2
      1.0, 3.0, 2.7,    // t3: chooses 1, 2
  };
  const int64_t T = 4;
  const int E = 3, K = 2, m = 2;
  auto sm2 = [](double a, double b) { return std::exp(a) / (std::exp(a) + std::exp(b)); };
  auto sm3 = [&](int64_t t, int e) {
    double s = 0.0;
    for (int i = 0; i < 3; ++i) s += std::exp(logits[t * 3 + i]);
    return std::exp(logits[t * 3 + e]) / s;
  };
  // f = {1, 4, 3}.
  {  // UP: e0 -> 2 (t0 + best non-chosen t2), e1 -> 4, e2 -> 4 (t1, t2, t3 + t0).
    const GeneralRouting g = token_rounding_ref(logits, T, E, K, m, RoundingMode::kUp, 0);
    EXPECT_EQ(g.token_offset, (std::vector<int64_t>{0, 3, 5, 8, 10}));
    EXPECT_EQ(g.expert, (std::vector<int32_t>{0, 1, 2, 1, 2, 0, 1, 2, 1, 2}));
    const std::vector<double> want = {sm2(0.0, 5.0), sm2(5.0, 0.0), sm3(0, 2),
                                      sm2(3.0, 3.2), sm2(3.2, 3.0),
                                      sm3(2, 0),     sm2(3.1, 3.0), sm2(3.0, 3.1),
                                      sm2(3.0, 2.7), sm2(2.7, 3.0)};
    ASSERT_EQ(g.score.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(g.score[i], want[i], 1e-15) << i;
    expect_token_rounding_valid(logits, T, E, K, m, RoundingMode::kUp, 0, g);
  }
  // DOWN: e0 -> 0, e1 -> 4, e2 -> 2 (drop the worst chosen: t3 with 0.43).
  // NR: f = 1 and 3 are exact ties (half of m_tile = 2) -> round down, so same as DOWN.
  for (RoundingMode mode : {RoundingMode::kDown, RoundingMode::kNearest}) {
    SCOPED_TRACE(mode_name(mode));
    const GeneralRouting g = token_rounding_ref(logits, T, E, K, m, mode, 0);
    EXPECT_EQ(g.token_offset, (std::vector<int64_t>{0, 1, 3, 5, 6}));
    EXPECT_EQ(g.expert, (std::vector<int32_t>{1, 1, 2, 1, 2, 1}));
    const std::vector<double> want = {sm2(5.0, 0.0), sm2(3.0, 3.2), sm2(3.2, 3.0),
                                      sm2(3.1, 3.0), sm2(3.0, 3.1), sm2(3.0, 2.7)};
    ASSERT_EQ(g.score.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(g.score[i], want[i], 1e-15) << i;
    expect_token_rounding_valid(logits, T, E, K, m, mode, 0, g);
  }
}

// f_e = m/2 + k*m exactly, through the whole routing: NR must round it down.
TEST(TokenRoundingRef, NearestTieRoundsDownThroughRouting) {
  Rng rng;
  TRACE_SEED(rng);
  const int E = 4, K = 1, m = 4;
  for (int64_t k = 0; k < 3; ++k) {
    const int64_t f0 = m / 2 + k * m;  // tokens choosing expert 0
    const int64_t T = 16;
    std::vector<double> logits = rng.normals(T * E);
    for (int64_t t = 0; t < T; ++t) logits[t * E + (t < f0 ? 0 : 1 + t % 3)] += 50.0;
    const GeneralRouting g = token_rounding_ref(logits, T, E, K, m, RoundingMode::kNearest, 0);
    int64_t count0 = 0;
    for (int64_t j = 0; j < g.nnz(); ++j) count0 += (g.expert[j] == 0);
    EXPECT_EQ(count0, k * m) << "f0=" << f0;
    expect_token_rounding_valid(logits, T, E, K, m, RoundingMode::kNearest, 0, g);
    // UP keeps them all and pads to the next tile.
    const GeneralRouting gu = token_rounding_ref(logits, T, E, K, m, RoundingMode::kUp, 0);
    int64_t count_up = 0;
    for (int64_t j = 0; j < gu.nnz(); ++j) count_up += (gu.expert[j] == 0);
    EXPECT_EQ(count_up, (k + 1) * m);
  }
}

TEST(TokenRoundingRef, StochasticDeterministicPerSeedAndVariesWithSeed) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 64;
  const int E = 8, K = 2, m = 8;
  // Make every f_e a non-multiple of m: expert e gets a fixed odd share of tokens.
  std::vector<double> logits;
  std::vector<int64_t> freq;
  for (;;) {
    logits = rng.normals(T * E, 2.0);
    const TopKRouting r = topk_softmax_ref(logits, T, E, K);
    freq.assign(E, 0);
    for (int32_t e : r.expert) freq[e] += 1;
    int non_multiples = 0;
    for (int64_t f : freq) non_multiples += (f % m != 0);
    if (non_multiples >= 4) break;
  }
  const uint64_t seed = rng.gen();
  const GeneralRouting a = token_rounding_ref(logits, T, E, K, m, RoundingMode::kStochastic, seed);
  const GeneralRouting b = token_rounding_ref(logits, T, E, K, m, RoundingMode::kStochastic, seed);
  EXPECT_EQ(a.token_offset, b.token_offset);
  EXPECT_EQ(a.expert, b.expert);
  EXPECT_EQ(a.score, b.score);
  int differ = 0;
  for (int i = 0; i < 20; ++i) {
    const GeneralRouting c =
        token_rounding_ref(logits, T, E, K, m, RoundingMode::kStochastic, rng.gen());
    differ += (c.expert != a.expert || c.token_offset != a.token_offset);
  }
  EXPECT_GT(differ, 0) << "the stochastic routing never changed over 20 seeds";

  // Empirical up-fraction per expert over many seeds ~ (f mod m) / m.
  const int N = 4000;
  std::vector<int> ups(E, 0);
  for (int i = 0; i < N; ++i) {
    const uint64_t s = rng.gen();
    const GeneralRouting g = token_rounding_ref(logits, T, E, K, m, RoundingMode::kStochastic, s);
    std::vector<int64_t> cnt(E, 0);
    for (int32_t e : g.expert) cnt[e] += 1;
    for (int e = 0; e < E; ++e) ups[e] += (cnt[e] > freq[e]);
  }
  for (int e = 0; e < E; ++e) {
    const double p = static_cast<double>(freq[e] % m) / m;
    EXPECT_NEAR(static_cast<double>(ups[e]) / N, p, 0.04) << "expert " << e << " f=" << freq[e];
  }
}

// When every f_e is already a multiple of m_tile, every mode returns plain top-K routing.
TEST(TokenRoundingRef, MultiplesAlreadyGiveTopK) {
  Rng rng;
  TRACE_SEED(rng);
  const int64_t T = 32;
  const int E = 4, K = 2, m = 8;
  // Token t prefers experts t%4 and (t+1)%4: each expert is chosen by exactly 16 tokens.
  std::vector<double> logits = rng.normals(T * E, 0.5);
  for (int64_t t = 0; t < T; ++t) {
    logits[t * E + t % 4] += 10.0;
    logits[t * E + (t + 1) % 4] += 10.0;
  }
  const GeneralRouting topk = to_general(topk_softmax_ref(logits, T, E, K));
  // to_general lists a token's experts by descending logit; token rounding by ascending expert.
  GeneralRouting want = topk;
  for (int64_t t = 0; t < T; ++t)
    if (want.expert[t * K] > want.expert[t * K + 1]) {
      std::swap(want.expert[t * K], want.expert[t * K + 1]);
      std::swap(want.score[t * K], want.score[t * K + 1]);
    }
  for (RoundingMode mode : kAllModes) {
    SCOPED_TRACE(mode_name(mode));
    const GeneralRouting g = token_rounding_ref(logits, T, E, K, m, mode, rng.gen());
    EXPECT_EQ(g.token_offset, want.token_offset);
    EXPECT_EQ(g.expert, want.expert);
    EXPECT_EQ(g.score, want.score);
  }
  // m_tile = 1: every count is a multiple, on any routing.
  const std::vector<double> l2 = rng.normals(T * 8, 2.0);
  const GeneralRouting t2 = to_general(topk_softmax_ref(l2, T, 8, 3));
  for (RoundingMode mode : kAllModes) {
    const GeneralRouting g = token_rounding_ref(l2, T, 8, 3, 1, mode, rng.gen());
    EXPECT_EQ(g.token_offset, t2.token_offset);
    for (int64_t t = 0; t < T; ++t) {
      std::map<int, double> a, b;
      for (int64_t j = t * 3; j < t * 3 + 3; ++j) {
        a[g.expert[j]] = g.score[j];
        b[t2.expert[j]] = t2.score[j];
      }
      EXPECT_EQ(a, b) << "token " << t;
    }
  }
}

// S' = S - 1 is computed in float64 as the header says: non-chosen scores below ~1e-16 all become
// exactly -1, so they tie and the lower token is padded first (even if its S is smaller).
TEST(TokenRoundingRef, SPrimeTiesGoToLowerToken) {
  // T=4, E=2, K=1, m_tile=2: only t0 chooses expert 0 (f_0 = 1, UP -> 2).
  const std::vector<double> logits = {
      5.0, 0.0,     // t0 -> e0
      -100.0, 0.0,  // t1: S[1][0] ~ 3.7e-44
      -40.0, 0.0,   // t2: S[2][0] ~ 4.2e-18
      -1.0, 0.0,    // t3: S[3][0] ~ 0.27  (the best non-chosen)
  };
  const GeneralRouting g = token_rounding_ref(logits, 4, 2, 1, 2, RoundingMode::kUp, 0);
  // e0 keeps t0 and t3 (S' = 0.27 - 1 > -1). e1: f = 3 -> 4: t1, t2, t3 + t0.
  EXPECT_EQ(g.token_offset, (std::vector<int64_t>{0, 2, 3, 4, 6}));
  EXPECT_EQ(g.expert, (std::vector<int32_t>{0, 1, 1, 1, 0, 1}));

  // Now no non-chosen token is resolvable: t1 (S ~ 3.7e-44) and t2 (S ~ 4.2e-18) both have
  // S' == -1 exactly, so the lower token (t1) is padded.
  std::vector<double> l2 = logits;
  l2[3 * 2 + 0] = -60.0;  // t3: S ~ 8.8e-27
  const GeneralRouting g2 = token_rounding_ref(l2, 4, 2, 1, 2, RoundingMode::kUp, 0);
  EXPECT_EQ(g2.token_offset, (std::vector<int64_t>{0, 2, 4, 5, 6}));
  EXPECT_EQ(g2.expert, (std::vector<int32_t>{0, 1, 0, 1, 1, 1}));
}
