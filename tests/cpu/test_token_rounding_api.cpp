// Argument rules of token rounding, on the CPU. Runs without a GPU: every rejection below happens on
// the host before anything touches CUDA (the pointers are fake, well aligned unless the case says
// otherwise, and never dereferenced), and the workspace size is a host-side formula.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "smoe/smoe.h"

namespace {

using Mode = smoe::TokenRoundingMode;
using Code = smoe::StatusCode;

smoe::TokenRoundingProblem problem(int64_t T, int E, int K, int m_tile = 128,
                                   Mode mode = Mode::kNearest) {
  smoe::TokenRoundingProblem p;
  p.num_tokens = T;
  p.num_experts = E;
  p.top_k = K;
  p.m_tile = m_tile;
  p.mode = mode;
  return p;
}

void expect_error(const smoe::Status& s, Code code, const std::string& mentions) {
  EXPECT_EQ(s.code, code) << s.message;
  EXPECT_NE(s.message.find(mentions), std::string::npos)
      << "message '" << s.message << "' should name '" << mentions << "'";
}

template <typename T>
T* fake(uintptr_t addr) { return reinterpret_cast<T*>(addr); }

smoe::TokenRoundingOutputs fake_outputs() {
  smoe::TokenRoundingOutputs o;
  o.scores = fake<float>(0x10000);
  o.entry_expert = fake<int32_t>(0x20000);
  o.token_offset = fake<int32_t>(0x30000);
  o.topk_expert = fake<int32_t>(0x40000);
  o.topk_score = fake<float>(0x50000);
  o.expert_frequency = fake<int32_t>(0x60000);
  o.expert_offset = fake<int32_t>(0x70000);
  o.scatter_idx = fake<int32_t>(0x80000);
  o.reverse_scatter_idx = fake<int32_t>(0x90000);
  o.gather_idx = fake<int32_t>(0xA0000);
  o.status = fake<smoe::DeviceStatus>(0xB0000);
  return o;
}

size_t workspace_of(const smoe::TokenRoundingProblem& p) {
  size_t bytes = 0;
  const smoe::Status s = smoe::token_rounding_workspace_size(p, &bytes);
  EXPECT_TRUE(s.ok()) << s.message;
  return bytes;
}

}  // namespace

TEST(TokenRoundingValidation, ShapeRules) {
  EXPECT_TRUE(smoe::token_rounding_can_implement(problem(4096, 512, 16)).ok());
  EXPECT_TRUE(smoe::token_rounding_can_implement(problem(0, 1, 1)).ok());
  EXPECT_TRUE(smoe::token_rounding_can_implement(problem(10, 64, 8, 1)).ok());
  for (Mode m : {Mode::kNearest, Mode::kUp, Mode::kDown, Mode::kStochastic})
    EXPECT_TRUE(smoe::token_rounding_can_implement(problem(100, 64, 8, 128, m)).ok());

  expect_error(smoe::token_rounding_can_implement(problem(10, 0, 1)), Code::kInvalidArgument,
               "num_experts (E) = 0");
  expect_error(smoe::token_rounding_can_implement(problem(10, 513, 1)), Code::kInvalidArgument,
               "num_experts (E) = 513");
  expect_error(smoe::token_rounding_can_implement(problem(10, 64, 0)), Code::kInvalidArgument,
               "top_k (K) = 0");
  expect_error(smoe::token_rounding_can_implement(problem(10, 64, 17)), Code::kInvalidArgument,
               "top_k (K) = 17");
  expect_error(smoe::token_rounding_can_implement(problem(10, 4, 5)), Code::kInvalidArgument,
               "must not exceed num_experts");
  expect_error(smoe::token_rounding_can_implement(problem(-1, 4, 2)), Code::kInvalidArgument,
               "num_tokens (T) = -1");
  expect_error(smoe::token_rounding_can_implement(problem(10, 64, 8, 0)), Code::kInvalidArgument,
               "m_tile = 0");
  expect_error(smoe::token_rounding_can_implement(problem(10, 64, 8, -128)), Code::kInvalidArgument,
               "m_tile = -128");
  expect_error(smoe::token_rounding_can_implement(problem(10, 64, 8, 128, static_cast<Mode>(4))),
               Code::kInvalidArgument, "mode = 4");
  expect_error(smoe::token_rounding_can_implement(problem(10, 64, 8, 128, static_cast<Mode>(-1))),
               Code::kInvalidArgument, "mode = -1");
  smoe::TokenRoundingProblem bad_dtype = problem(10, 64, 8);
  bad_dtype.logits_dtype = static_cast<smoe::DType>(5);
  expect_error(smoe::token_rounding_can_implement(bad_dtype), Code::kInvalidArgument, "logits_dtype");

  // T*K must fit int32, and a product that overflows 64 bits must not wrap into a small one.
  expect_error(smoe::token_rounding_can_implement(problem(int64_t{1} << 28, 64, 16)),
               Code::kInvalidArgument, "T*K");
  expect_error(smoe::token_rounding_can_implement(problem((int64_t{1} << 62) + 16, 8, 4)),
               Code::kInvalidArgument, "T*K");
  EXPECT_TRUE(smoe::token_rounding_can_implement(problem(INT32_MAX, 2, 1, 1)).ok());

  // The capacity (rows and entries are int32 too): T*K = 2^31-1 fits, but E*(m_tile-1) more does not;
  // kDown never adds rows, so the same shape is fine there.
  expect_error(smoe::token_rounding_can_implement(problem(INT32_MAX, 2, 1, 128)),
               Code::kInvalidArgument, "capacity");
  EXPECT_TRUE(smoe::token_rounding_can_implement(problem(INT32_MAX, 2, 1, 128, Mode::kDown)).ok());
}

TEST(TokenRoundingValidation, Capacity) {
  // min(T*E, T*K + E*(m_tile-1)) for every mode but kDown, T*K for kDown.
  EXPECT_EQ(smoe::token_rounding_capacity(problem(1000, 64, 8, 128)), 8000 + 64 * 127);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(1000, 64, 8, 128, Mode::kUp)), 8000 + 64 * 127);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(1000, 64, 8, 128, Mode::kStochastic)),
            8000 + 64 * 127);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(1000, 64, 8, 128, Mode::kDown)), 8000);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(1000, 64, 8, 1)), 8000);  // nothing to round
  // Few tokens: an expert can take each token once, so T*E bounds it.
  EXPECT_EQ(smoe::token_rounding_capacity(problem(10, 64, 2, 128, Mode::kUp)), 640);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(1000, 64, 8, INT_MAX)), 64000);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(0, 64, 8)), 0);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(INT32_MAX, 2, 1, 1)), INT32_MAX);
  // Invalid problems: 0.
  EXPECT_EQ(smoe::token_rounding_capacity(problem(10, 64, 65)), 0);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(10, 64, 8, 0)), 0);
  EXPECT_EQ(smoe::token_rounding_capacity(problem(INT32_MAX, 2, 1, 128)), 0);
}

TEST(TokenRoundingValidation, WorkspaceSize) {
  size_t bytes = 777;
  expect_error(smoe::token_rounding_workspace_size(problem(10, 64, 8), nullptr),
               Code::kInvalidArgument, "bytes");
  // Invalid problems: the reason, and *bytes left alone.
  expect_error(smoe::token_rounding_workspace_size(problem(10, 64, 65), &bytes),
               Code::kInvalidArgument, "top_k");
  expect_error(smoe::token_rounding_workspace_size(problem(10, 64, 8, 0), &bytes),
               Code::kInvalidArgument, "m_tile");
  expect_error(smoe::token_rounding_workspace_size(problem((int64_t{1} << 62) + 16, 8, 4), &bytes),
               Code::kInvalidArgument, "T*K");
  EXPECT_EQ(bytes, 777u) << "bytes must be left alone on error";
  // T = 0 needs nothing.
  ASSERT_TRUE(smoe::token_rounding_workspace_size(problem(0, 64, 8), &bytes).ok());
  EXPECT_EQ(bytes, 0u);
  // A host-side formula (no GPU needed here), in whole 256-byte regions, growing with T.
  const size_t small = workspace_of(problem(1000, 64, 8));
  const size_t large = workspace_of(problem(100000, 64, 8));
  EXPECT_GT(small, 0u);
  EXPECT_EQ(small % smoe::kWorkspaceAlignment, 0u);
  EXPECT_GT(large, small);
  EXPECT_EQ(workspace_of(problem(1000, 64, 8)), small) << "the query is deterministic";
}

TEST(TokenRoundingValidation, RejectsBeforeAnyCudaCall) {
  const smoe::TokenRoundingProblem p = problem(100, 64, 8, 16);
  const void* logits = fake<float>(0xC0000);
  void* ws = fake<void>(0x1000000);
  const size_t ws_bytes = workspace_of(p);
  ASSERT_GT(ws_bytes, 0u);
  auto call = [&](const smoe::TokenRoundingProblem& pr, const void* lg,
                  const smoe::TokenRoundingOutputs& o, void* w, size_t wb) {
    return smoe::token_rounding_routing(pr, lg, o, w, wb, nullptr);
  };

  // A bad shape is rejected before the pointers are looked at.
  expect_error(call(problem(100, 64, 65), nullptr, smoe::TokenRoundingOutputs{}, nullptr, 0),
               Code::kInvalidArgument, "top_k");
  expect_error(call(problem(100, 64, 8, 0), logits, fake_outputs(), ws, ws_bytes),
               Code::kInvalidArgument, "m_tile");

  // Null and misaligned pointers, each named.
  struct PtrCase {
    const char* name;
    void (*mutate)(smoe::TokenRoundingOutputs*);
    Code code;
  };
  const PtrCase cases[] = {
      {"outputs.scores", [](smoe::TokenRoundingOutputs* o) { o->scores = nullptr; }, Code::kInvalidArgument},
      {"outputs.scores", [](smoe::TokenRoundingOutputs* o) { o->scores = fake<float>(0x10002); }, Code::kMisalignedPointer},
      {"outputs.entry_expert", [](smoe::TokenRoundingOutputs* o) { o->entry_expert = nullptr; }, Code::kInvalidArgument},
      {"outputs.entry_expert", [](smoe::TokenRoundingOutputs* o) { o->entry_expert = fake<int32_t>(0x20001); }, Code::kMisalignedPointer},
      {"outputs.token_offset", [](smoe::TokenRoundingOutputs* o) { o->token_offset = nullptr; }, Code::kInvalidArgument},
      {"outputs.token_offset", [](smoe::TokenRoundingOutputs* o) { o->token_offset = fake<int32_t>(0x30002); }, Code::kMisalignedPointer},
      {"outputs.topk_expert", [](smoe::TokenRoundingOutputs* o) { o->topk_expert = nullptr; }, Code::kInvalidArgument},
      {"outputs.topk_score", [](smoe::TokenRoundingOutputs* o) { o->topk_score = fake<float>(0x50003); }, Code::kMisalignedPointer},
      {"outputs.expert_frequency", [](smoe::TokenRoundingOutputs* o) { o->expert_frequency = nullptr; }, Code::kInvalidArgument},
      {"outputs.expert_offset", [](smoe::TokenRoundingOutputs* o) { o->expert_offset = fake<int32_t>(0x70002); }, Code::kMisalignedPointer},
      {"outputs.scatter_idx", [](smoe::TokenRoundingOutputs* o) { o->scatter_idx = nullptr; }, Code::kInvalidArgument},
      {"outputs.reverse_scatter_idx", [](smoe::TokenRoundingOutputs* o) { o->reverse_scatter_idx = fake<int32_t>(0x90001); }, Code::kMisalignedPointer},
      {"outputs.gather_idx", [](smoe::TokenRoundingOutputs* o) { o->gather_idx = nullptr; }, Code::kInvalidArgument},
      {"outputs.status", [](smoe::TokenRoundingOutputs* o) { o->status = nullptr; }, Code::kInvalidArgument},
      {"outputs.status", [](smoe::TokenRoundingOutputs* o) { o->status = fake<smoe::DeviceStatus>(0xB0004); }, Code::kMisalignedPointer},
  };
  for (const PtrCase& c : cases) {
    smoe::TokenRoundingOutputs o = fake_outputs();
    c.mutate(&o);
    expect_error(call(p, logits, o, ws, ws_bytes), c.code, c.name);
  }
  expect_error(call(p, nullptr, fake_outputs(), ws, ws_bytes), Code::kInvalidArgument, "logits");
  expect_error(call(p, fake<char>(0xC0002), fake_outputs(), ws, ws_bytes), Code::kMisalignedPointer,
               "logits");
  // bf16 logits need only 2-byte alignment (then the next rule, the workspace size, speaks).
  smoe::TokenRoundingProblem pb = p;
  pb.logits_dtype = smoe::DType::kBFloat16;
  expect_error(call(pb, fake<char>(0xC0001), fake_outputs(), ws, ws_bytes), Code::kMisalignedPointer,
               "2-byte");
  expect_error(call(pb, fake<char>(0xC0002), fake_outputs(), ws, workspace_of(pb) - 1),
               Code::kWorkspaceTooSmall, "workspace_bytes");

  // The workspace: null, misaligned, too small.
  expect_error(call(p, logits, fake_outputs(), nullptr, ws_bytes), Code::kInvalidArgument,
               "workspace");
  expect_error(call(p, logits, fake_outputs(), fake<void>(0x1000080), ws_bytes),
               Code::kMisalignedPointer, "workspace");
  expect_error(call(p, logits, fake_outputs(), ws, ws_bytes - 1), Code::kWorkspaceTooSmall,
               "token_rounding_workspace_size");
  expect_error(call(p, logits, fake_outputs(), ws, 0), Code::kWorkspaceTooSmall, "workspace_bytes");

  // T = 0: the [cap] and [T*K] arrays, the logits and the workspace may be null (nothing is
  // written there), but the per-expert arrays, token_offset and status are still required.
  smoe::TokenRoundingOutputs empty;
  empty.token_offset = fake<int32_t>(0x30000);
  empty.expert_frequency = fake<int32_t>(0x60000);
  empty.status = fake<smoe::DeviceStatus>(0xB0000);
  expect_error(call(problem(0, 64, 8), nullptr, empty, nullptr, 0), Code::kInvalidArgument,
               "outputs.expert_offset");
  empty.expert_offset = fake<int32_t>(0x70000);
  empty.token_offset = nullptr;
  expect_error(call(problem(0, 64, 8), nullptr, empty, nullptr, 0), Code::kInvalidArgument,
               "outputs.token_offset");
}
