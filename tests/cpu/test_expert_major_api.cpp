// The expert-major layer's host side without a GPU (smoe/expert_major.h): shape rules, sizes as host
// arithmetic, and every argument rule checked before anything runs, each naming the argument. The
// pointers are fake and never dereferenced.
#include <algorithm>
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "expert_major/rules.h"
#include "smoe/expert_major.h"

namespace {

using smoe::ExpertMajorShape;
using smoe::GateUpLayout;
using smoe::StatusCode;

void expect_error(const smoe::Status& s, StatusCode code, const std::string& mentions) {
  EXPECT_EQ(s.code, code) << s.message;
  EXPECT_NE(s.message.find(mentions), std::string::npos) << "message '" << s.message << "' should name '" << mentions
                                                         << "'";
}

template <typename T>
T* fake(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

ExpertMajorShape shape(GateUpLayout gu = GateUpLayout::kSeparate, bool probs = true, bool segmented = false) {
  ExpertMajorShape s;
  s.rows = 1000;
  s.d = 256;
  s.n = 128;
  s.E = 8;
  s.gate_up = gu;
  s.probs = probs;
  s.segmented = segmented;
  return s;
}

// Disjoint fake buffers of the right sizes, 1 GiB apart.
constexpr uintptr_t kGiB = uintptr_t{1} << 30;
smoe::ExpertMajorForwardArgs good_forward(const ExpertMajorShape& s) {
  smoe::ExpertMajorForwardArgs a;
  a.shape = s;
  a.x = fake<const smoe::bf16>(1 * kGiB);
  a.counts = fake<const int32_t>(2 * kGiB);
  a.segment_offset = s.segmented ? fake<const int32_t>(3 * kGiB) : nullptr;
  a.probs = s.probs ? fake<const float>(4 * kGiB) : nullptr;
  a.weights.w1 = fake<const smoe::bf16>(5 * kGiB);
  a.weights.w3 = s.gate_up == GateUpLayout::kSeparate ? fake<const smoe::bf16>(6 * kGiB) : nullptr;
  a.weights.w2 = fake<const smoe::bf16>(7 * kGiB);
  a.out = fake<smoe::bf16>(8 * kGiB);
  a.saved = fake<void>(9 * kGiB);
  a.saved_bytes = smoe::expert_major_saved_state_size(s);
  a.workspace = fake<void>(10 * kGiB);
  a.workspace_bytes = smoe::expert_major_forward_workspace_size(s);
  a.status = fake<smoe::DeviceStatus>(11 * kGiB);
  return a;
}
smoe::ExpertMajorBackwardArgs good_backward(const ExpertMajorShape& s) {
  const smoe::ExpertMajorForwardArgs f = good_forward(s);
  smoe::ExpertMajorBackwardArgs a;
  a.shape = s;
  a.x = f.x;
  a.probs = f.probs;
  a.weights = f.weights;
  a.dout = fake<const smoe::bf16>(12 * kGiB);
  a.saved = f.saved;
  a.saved_bytes = f.saved_bytes;
  a.dx = fake<smoe::bf16>(13 * kGiB);
  a.dw1 = fake<smoe::bf16>(14 * kGiB);
  a.dw3 = s.gate_up == GateUpLayout::kSeparate ? fake<smoe::bf16>(15 * kGiB) : nullptr;
  a.dw2 = fake<smoe::bf16>(16 * kGiB);
  a.dprobs = s.probs ? fake<float>(17 * kGiB) : nullptr;
  a.workspace = fake<void>(18 * kGiB);
  a.workspace_bytes = smoe::expert_major_backward_workspace_size(s);
  return a;
}

}  // namespace

TEST(ExpertMajorApi, ShapeRules) {
  EXPECT_TRUE(smoe::expert_major_can_implement(shape()).ok());
  ExpertMajorShape s = shape();
  s.rows = 0;  // R = 0 is a valid call
  EXPECT_TRUE(smoe::expert_major_can_implement(s).ok());
  s = shape();
  s.rows = -1;
  expect_error(smoe::expert_major_can_implement(s), StatusCode::kInvalidArgument, "shape.rows");
  s = shape();
  s.d = 100;
  expect_error(smoe::expert_major_can_implement(s), StatusCode::kInvalidArgument, "shape.d = 100");
  s = shape();
  s.n = 0;
  expect_error(smoe::expert_major_can_implement(s), StatusCode::kInvalidArgument, "shape.n = 0");
  s = shape();
  s.E = 513;
  expect_error(smoe::expert_major_can_implement(s), StatusCode::kInvalidArgument, "shape.E = 513");
  s.E = 512;  // the limit itself
  EXPECT_TRUE(smoe::expert_major_can_implement(s).ok());
  s = shape();
  s.gate_up = static_cast<GateUpLayout>(7);
  expect_error(smoe::expert_major_can_implement(s), StatusCode::kInvalidArgument, "shape.gate_up");
  EXPECT_EQ(smoe::expert_major_saved_state_size(s), 0u);
  EXPECT_EQ(smoe::expert_major_forward_workspace_size(s), 0u);
  EXPECT_EQ(smoe::expert_major_backward_workspace_size(s), 0u);
}

// Sizes are host arithmetic (this machine has no GPU) and follow the plan: held = 4Rn + 16R + O(E).
TEST(ExpertMajorApi, SizesAreHostArithmetic) {
  auto al = [](size_t b) { return (b + 255) / 256 * 256; };
  const ExpertMajorShape s = shape();  // R 1000, d 256, n 128, E 8, probs
  const size_t R = 1000, d = 256, n = 128, E = 8;
  // stamp, H, expert_offset, row_of, slot_of, scores, row_offset
  EXPECT_EQ(smoe::expert_major_saved_state_size(s),
            al(32) + al(R * 2 * n * 2) + al(4 * (E + 1)) + 3 * al(4 * R) + al(4 * (R + 1)));
  // A, Y, the valid flag, the row begins
  EXPECT_EQ(smoe::expert_major_forward_workspace_size(s), al(R * n * 2) + al(R * d * 2) + al(4) + al(4 * E));
  // dH, then A' and the dS partials (n = 128: one 128-column tile; dead after dW2) sharing bytes with
  // dX~ (written after them): the larger side, here dX~; the valid flag, the expert_offset copy.
  const size_t early = al(R * n * 2) + al(R * 1 * 4), late = al(R * d * 2);
  EXPECT_EQ(smoe::expert_major_backward_workspace_size(s),
            al(R * 2 * n * 2) + std::max(early, late) + al(4) + al(4 * (E + 1)));
  // consume_saved: dH goes over the saved H.
  EXPECT_EQ(smoe::expert_major_backward_workspace_size(s, true),
            smoe::expert_major_backward_workspace_size(s) - al(R * 2 * n * 2));
  ExpertMajorShape narrow = s;
  narrow.d = 64;  // dX~ smaller than A' + the partials: the overlay takes the larger side
  EXPECT_EQ(smoe::expert_major_backward_workspace_size(narrow),
            al(R * 2 * n * 2) + std::max(early, al(R * 64 * 2)) + al(4) + al(4 * (E + 1)));
  ExpertMajorShape np = s;
  np.probs = false;  // the dS row sums come from the workspace
  EXPECT_EQ(smoe::expert_major_backward_workspace_size(np), smoe::expert_major_backward_workspace_size(s) + al(R * 4));
  // The saved state does not grow with d (x is the caller's): O(R n), never O(R d).
  ExpertMajorShape wide = s;
  wide.d = 8192;
  EXPECT_EQ(smoe::expert_major_saved_state_size(wide), smoe::expert_major_saved_state_size(s));
}

// A valid call gets through every rule (the rules alone: the fake buffers must never reach a GPU).
TEST(ExpertMajorApi, ValidArgumentsPassTheRules) {
  for (GateUpLayout gu : {GateUpLayout::kInterleaved, GateUpLayout::kSeparate, GateUpLayout::kConcatenated})
    for (bool probs : {false, true})
      for (bool seg : {false, true}) {
        const ExpertMajorShape s = shape(gu, probs, seg);
        EXPECT_TRUE(smoe::expert_major::check_forward(good_forward(s)).ok());
        EXPECT_TRUE(smoe::expert_major::check_backward(good_backward(s)).ok());
      }
  ExpertMajorShape s = shape();
  s.rows = 0;  // no rows: the row tensors may be null
  auto f = good_forward(s);
  f.x = nullptr;
  f.out = nullptr;
  f.probs = nullptr;
  EXPECT_TRUE(smoe::expert_major::check_forward(f).ok());
}

TEST(ExpertMajorApi, ForwardRulesNameTheArgument) {
  const ExpertMajorShape s = shape();
  auto check = [&](auto edit, StatusCode code, const char* mentions) {
    auto a = good_forward(s);
    edit(a);
    expect_error(smoe::expert_major_forward(a, nullptr), code, mentions);
  };
  using A = smoe::ExpertMajorForwardArgs;
  check([](A& a) { a.x = nullptr; }, StatusCode::kInvalidArgument, "x is null");
  check([](A& a) { a.x = fake<const smoe::bf16>(kGiB + 2); }, StatusCode::kMisalignedPointer, "x =");
  check([](A& a) { a.counts = nullptr; }, StatusCode::kInvalidArgument, "counts");
  check([](A& a) { a.segment_offset = fake<const int32_t>(3 * kGiB); }, StatusCode::kInvalidArgument,
        "segment_offset must be null");
  check([](A& a) { a.probs = nullptr; }, StatusCode::kInvalidArgument, "probs");
  check([](A& a) { a.weights.w3 = nullptr; }, StatusCode::kInvalidArgument, "weights.w3");
  check([](A& a) { a.weights.w2 = nullptr; }, StatusCode::kInvalidArgument, "weights.w2");
  check([](A& a) { a.out = nullptr; }, StatusCode::kInvalidArgument, "out");
  check([](A& a) { a.status = nullptr; }, StatusCode::kInvalidArgument, "status");
  check([](A& a) { --a.saved_bytes; }, StatusCode::kWorkspaceTooSmall, "expert_major_saved_state_size");
  check([](A& a) { --a.workspace_bytes; }, StatusCode::kWorkspaceTooSmall, "expert_major_forward_workspace_size");
  check([](A& a) { a.out = const_cast<smoe::bf16*>(a.x); }, StatusCode::kInvalidArgument, "out");
  check([](A& a) { a.saved = a.workspace; }, StatusCode::kInvalidArgument, "overlaps");
  // Layout rules: w3 only with two tensors; segment_offset with the segmented layout.
  auto a = good_forward(shape(GateUpLayout::kConcatenated));
  a.weights.w3 = fake<const smoe::bf16>(6 * kGiB);
  expect_error(smoe::expert_major_forward(a, nullptr), StatusCode::kInvalidArgument, "weights.w3 must be null");
  a = good_forward(shape(GateUpLayout::kSeparate, true, true));
  a.segment_offset = nullptr;
  expect_error(smoe::expert_major_forward(a, nullptr), StatusCode::kInvalidArgument, "segment_offset");
  a = good_forward(shape(GateUpLayout::kSeparate, false));
  a.probs = fake<const float>(4 * kGiB);
  expect_error(smoe::expert_major_forward(a, nullptr), StatusCode::kInvalidArgument, "probs must be null");
}

TEST(ExpertMajorApi, BackwardRulesNameTheArgument) {
  const ExpertMajorShape s = shape();
  auto check = [&](auto edit, StatusCode code, const char* mentions) {
    auto a = good_backward(s);
    edit(a);
    expect_error(smoe::expert_major_backward(a, nullptr), code, mentions);
  };
  using A = smoe::ExpertMajorBackwardArgs;
  check([](A& a) { a.dout = nullptr; }, StatusCode::kInvalidArgument, "dout");
  check([](A& a) { a.dx = nullptr; }, StatusCode::kInvalidArgument, "dx");
  check([](A& a) { a.dw1 = nullptr; }, StatusCode::kInvalidArgument, "dw1");
  check([](A& a) { a.dw3 = nullptr; }, StatusCode::kInvalidArgument, "dw3");
  check([](A& a) { a.dw2 = nullptr; }, StatusCode::kInvalidArgument, "dw2");
  check([](A& a) { a.dprobs = nullptr; }, StatusCode::kInvalidArgument, "dprobs");
  check([](A& a) { --a.workspace_bytes; }, StatusCode::kWorkspaceTooSmall, "expert_major_backward_workspace_size");
  check(
      [](A& a) {  // consume_saved's smaller workspace, one byte short
        a.consume_saved = true;
        a.workspace_bytes = smoe::expert_major_backward_workspace_size(a.shape, true) - 1;
      },
      StatusCode::kWorkspaceTooSmall, "expert_major_backward_workspace_size");
  check(
      [](A& a) {  // consume_saved writes the saved state: an output, so it may not overlap an input
        a.consume_saved = true;
        a.dout = static_cast<const smoe::bf16*>(a.saved) + 64;
      },
      StatusCode::kInvalidArgument, "saved (consume_saved)");
  check([](A& a) { a.dw1 = const_cast<smoe::bf16*>(a.weights.w1); }, StatusCode::kInvalidArgument, "dw1");
  check([](A& a) { a.dx = const_cast<smoe::bf16*>(a.dout); }, StatusCode::kInvalidArgument, "overlaps");
  auto a = good_backward(shape(GateUpLayout::kInterleaved));
  a.dw3 = fake<smoe::bf16>(15 * kGiB);
  expect_error(smoe::expert_major_backward(a, nullptr), StatusCode::kInvalidArgument, "dw3 must be null");
  a = good_backward(shape(GateUpLayout::kSeparate, false));
  a.dprobs = fake<float>(17 * kGiB);
  expect_error(smoe::expert_major_backward(a, nullptr), StatusCode::kInvalidArgument, "dprobs must be null");
}
