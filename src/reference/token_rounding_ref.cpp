// float64 CPU reference: token rounding (SonicMoE "TR" routing).
// See include/smoe/reference.h for the spec.
#include "smoe/reference.h"
#include "ref_require.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

namespace smoe {
namespace ref {

namespace {

using detail::require;

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

double uniform01(uint64_t seed, int expert) {
  const uint64_t z = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(expert)));
  return static_cast<double>(z >> 11) * 0x1.0p-53;  // top 53 bits, in [0, 1)
}

int64_t rounded_count(int64_t f, int64_t T, int m_tile, RoundingMode mode, uint64_t seed,
                      int expert) {
  require(m_tile >= 1, "rounded_count: m_tile < 1");
  require(f >= 0 && f <= T, "rounded_count: f must be in [0, T]");
  const int64_t m = m_tile;
  const int64_t rem = f % m;
  const int64_t lo = f - rem;
  int64_t out = f;
  if (rem != 0) {
    const int64_t hi = lo + m;
    switch (mode) {
      case RoundingMode::kNearest:
        out = (2 * rem > m) ? hi : lo;  // exactly half a tile rounds down
        break;
      case RoundingMode::kUp:
        out = hi;
        break;
      case RoundingMode::kDown:
        out = lo;
        break;
      case RoundingMode::kStochastic: {
        const double p = static_cast<double>(rem) / static_cast<double>(m);
        out = (uniform01(seed, expert) < p) ? hi : lo;
        break;
      }
    }
  }
  return std::min<int64_t>(std::max<int64_t>(out, 0), T);
}

GeneralRouting token_rounding_ref(const std::vector<double>& logits, int64_t T, int E, int K,
                                  int m_tile, RoundingMode mode, uint64_t seed) {
  require(m_tile >= 1, "token_rounding_ref: m_tile < 1");
  const TopKRouting topk = topk_softmax_ref(logits, T, E, K);  // validates the shapes

  // S = softmax over all E logits (max subtracted).
  std::vector<double> S(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t) {
    const double* row = logits.data() + t * E;
    double mx = row[0];
    for (int e = 1; e < E; ++e) mx = std::max(mx, row[e]);
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += std::exp(row[e] - mx);
    for (int e = 0; e < E; ++e) S[t * E + e] = std::exp(row[e] - mx) / sum;
  }

  // S' = S - 1, then the chosen entries get their (top-K softmax) score.
  std::vector<double> Sp(S.size());
  for (size_t i = 0; i < S.size(); ++i) Sp[i] = S[i] - 1.0;
  std::vector<char> chosen(S.size(), 0);
  std::vector<int64_t> freq(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int e = topk.expert[t * K + k];
      Sp[t * E + e] = topk.score[t * K + k];
      chosen[t * E + e] = 1;
      freq[e] += 1;
    }

  // Per expert: sort tokens by S'[:, e] descending (ties: lower token first) and keep a prefix.
  // Iterating experts in ascending order makes each token's list ascending by expert.
  std::vector<std::vector<std::pair<int32_t, double>>> per_token(static_cast<size_t>(T));
  std::vector<int64_t> order(static_cast<size_t>(T));
  for (int e = 0; e < E; ++e) {
    const int64_t keep = rounded_count(freq[e], T, m_tile, mode, seed, e);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return Sp[a * E + e] > Sp[b * E + e];
    });
    for (int64_t i = 0; i < keep; ++i) {
      const int64_t t = order[i];
      const double sc = chosen[t * E + e] ? Sp[t * E + e] : S[t * E + e];
      per_token[t].emplace_back(e, sc);
    }
  }

  GeneralRouting g;
  g.T = T;
  g.E = E;
  g.token_offset.assign(static_cast<size_t>(T + 1), 0);
  for (int64_t t = 0; t < T; ++t) {
    g.token_offset[t + 1] = g.token_offset[t] + static_cast<int64_t>(per_token[t].size());
    for (const auto& es : per_token[t]) {
      g.expert.push_back(es.first);
      g.score.push_back(es.second);
    }
  }
  return g;
}

}  // namespace ref
}  // namespace smoe
