// Fresh random inputs for every test run, reproducible on demand: the seed comes from
// std::random_device unless SMOE_TEST_SEED=<n> is set, and tests print it on failure (TRACE_SEED).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace smoe_test {

inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("SMOE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

struct Rng {
  uint64_t seed = fresh_seed();
  std::mt19937_64 gen{seed};
  double normal(double sd = 1.0) { return std::normal_distribution<double>(0.0, sd)(gen); }
  int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }
  std::vector<double> normals(int64_t count, double sd = 1.0) {
    std::vector<double> v(static_cast<size_t>(count));
    for (auto& x : v) x = normal(sd);
    return v;
  }
};

}  // namespace smoe_test

#define TRACE_SEED(rng) SCOPED_TRACE(::testing::Message() << "seed=" << (rng).seed)
