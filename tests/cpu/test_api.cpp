// Argument validation of the public API. Runs without a GPU: every rejection below must happen on
// the host, before anything touches CUDA (the pointers are fake and never dereferenced).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "common/grid_stride.h"
#include "moe/memory_plan.h"
#include "smoe/smoe.h"

namespace {

smoe::RoutingProblem problem(int64_t T, int E, int K) {
  smoe::RoutingProblem p;
  p.num_tokens = T;
  p.num_experts = E;
  p.top_k = K;
  return p;
}

void expect_error(const smoe::Status& s, smoe::StatusCode code, const std::string& mentions) {
  EXPECT_EQ(s.code, code) << s.message;
  EXPECT_NE(s.message.find(mentions), std::string::npos)
      << "message '" << s.message << "' should name '" << mentions << "'";
}

// Fake, well-aligned device addresses: validation must reject before any use.
template <typename T>
T* fake(uintptr_t addr) { return reinterpret_cast<T*>(addr); }

smoe::RoutingOutputs fake_outputs() {
  smoe::RoutingOutputs o;
  o.scores = fake<float>(0x10000);
  o.topk_expert = fake<int32_t>(0x20000);
  o.expert_frequency = fake<int32_t>(0x30000);
  o.expert_offset = fake<int32_t>(0x40000);
  o.scatter_idx = fake<int32_t>(0x50000);
  o.reverse_scatter_idx = fake<int32_t>(0x60000);
  o.gather_idx = fake<int32_t>(0x70000);
  o.status = fake<smoe::DeviceStatus>(0x80000);
  return o;
}

}  // namespace

TEST(RoutingValidation, RangesOfEAndK) {
  EXPECT_TRUE(smoe::routing_can_implement(problem(10, 512, 16)).ok());
  EXPECT_TRUE(smoe::routing_can_implement(problem(0, 1, 1)).ok());
  expect_error(smoe::routing_can_implement(problem(10, 0, 1)), smoe::StatusCode::kInvalidArgument, "num_experts");
  expect_error(smoe::routing_can_implement(problem(10, 513, 1)), smoe::StatusCode::kInvalidArgument, "num_experts");
  expect_error(smoe::routing_can_implement(problem(10, 64, 0)), smoe::StatusCode::kInvalidArgument, "top_k");
  expect_error(smoe::routing_can_implement(problem(10, 64, 17)), smoe::StatusCode::kInvalidArgument, "top_k");
  expect_error(smoe::routing_can_implement(problem(10, 4, 5)), smoe::StatusCode::kInvalidArgument, "must not exceed num_experts");
  expect_error(smoe::routing_can_implement(problem(-1, 4, 2)), smoe::StatusCode::kInvalidArgument, "num_tokens");
  expect_error(smoe::routing_can_implement(problem(int64_t{1} << 28, 64, 16)), smoe::StatusCode::kInvalidArgument, "T*K");
}

TEST(RoutingValidation, RejectsBeforeLaunch) {
  const smoe::RoutingProblem p = problem(100, 64, 8);
  const void* logits = fake<float>(0x90000);
  void* ws = fake<void>(0x100000);
  // Bad shape: rejected before pointers are looked at.
  expect_error(smoe::topk_routing(problem(100, 64, 65), logits, fake_outputs(), ws, 1 << 20, nullptr),
               smoe::StatusCode::kInvalidArgument, "top_k");
  // Misaligned pointers, each named.
  expect_error(smoe::topk_routing(p, fake<char>(0x90001), fake_outputs(), ws, 1 << 20, nullptr),
               smoe::StatusCode::kMisalignedPointer, "logits");
  smoe::RoutingOutputs o = fake_outputs();
  o.scatter_idx = fake<int32_t>(0x50002);
  expect_error(smoe::topk_routing(p, logits, o, ws, 1 << 20, nullptr), smoe::StatusCode::kMisalignedPointer,
               "outputs.scatter_idx");
  expect_error(smoe::topk_routing(p, logits, fake_outputs(), fake<void>(0x100080), 1 << 20, nullptr),
               smoe::StatusCode::kMisalignedPointer, "workspace");
  o = fake_outputs();
  o.status = fake<smoe::DeviceStatus>(0x80004);
  expect_error(smoe::topk_routing(p, logits, o, ws, 1 << 20, nullptr), smoe::StatusCode::kMisalignedPointer,
               "outputs.status");
  // Null pointers.
  o = fake_outputs();
  o.gather_idx = nullptr;
  expect_error(smoe::topk_routing(p, logits, o, ws, 1 << 20, nullptr), smoe::StatusCode::kInvalidArgument,
               "outputs.gather_idx");
  expect_error(smoe::topk_routing(p, nullptr, fake_outputs(), ws, 1 << 20, nullptr),
               smoe::StatusCode::kInvalidArgument, "logits");
  // bf16 logits need only 2-byte alignment.
  smoe::RoutingProblem pb = p;
  pb.logits_dtype = smoe::DType::kBFloat16;
  expect_error(smoe::topk_routing(pb, fake<char>(0x90001), fake_outputs(), ws, 1 << 20, nullptr),
               smoe::StatusCode::kMisalignedPointer, "2-byte");
}

TEST(LayerValidation, ShapeRules) {
  smoe::MoEShape s{4096, 1536, 256, 128, 8};
  EXPECT_TRUE(smoe::moe_can_implement(s).ok());
  smoe::MoEShape bad = s;
  bad.d = 100;
  expect_error(smoe::moe_can_implement(bad), smoe::StatusCode::kInvalidArgument, "d = 100");
  bad = s;
  bad.n = 96;
  expect_error(smoe::moe_can_implement(bad), smoe::StatusCode::kInvalidArgument, "n = 96");
  bad = s;
  bad.K = 0;
  expect_error(smoe::moe_can_implement(bad), smoe::StatusCode::kInvalidArgument, "top_k");
  // The saved state follows the plan 4*T*K*n + O(T*K) bytes.
  const double plan = 4.0 * s.T * s.K * s.n;
  const double saved = static_cast<double>(smoe::moe_saved_state_size(s));
  EXPECT_GE(saved, plan);
  EXPECT_LE(saved, plan + 64.0 * s.T * s.K + 1e5);
}

// The size query is host arithmetic (the grouping's counting sort has no CUB size query to ask a
// GPU): a valid problem gets its bytes on any machine, with or without a GPU; T*K = 0 needs 0 bytes.
TEST(RoutingValidation, WorkspaceSizeReportsWhy) {
  size_t bytes = 777;
  const smoe::Status st = smoe::routing_workspace_size(problem(4096, 64, 8), &bytes);
  ASSERT_TRUE(st.ok()) << st.message;
  EXPECT_GT(bytes, 0u);
  EXPECT_EQ(bytes % smoe::kWorkspaceAlignment, 0u);
  EXPECT_EQ(bytes, smoe::routing_workspace_size(problem(4096, 64, 8)));
  ASSERT_TRUE(smoe::routing_workspace_size(problem(0, 64, 8), &bytes).ok());
  EXPECT_EQ(bytes, 0u);
  expect_error(smoe::routing_workspace_size(problem(10, 64, 8), nullptr), smoe::StatusCode::kInvalidArgument, "bytes");
}

// Products that overflow 64 bits must not wrap into a small, accepted value (T = 2^62 + 16 with
// K = 4 wrapped to T*K = 64 before the checked arithmetic), and the size queries must say 0.
TEST(LayerValidation, OverflowingProductsRejected) {
  smoe::RoutingProblem rp{(int64_t{1} << 62) + 16, 8, 4, smoe::DType::kFloat32};
  smoe::Status st = smoe::routing_can_implement(rp);
  EXPECT_EQ(st.code, smoe::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message.find("T*K"), std::string::npos) << st.message;
  EXPECT_EQ(smoe::routing_workspace_size(rp), 0u);
  size_t bytes = 12345;
  expect_error(smoe::routing_workspace_size(rp, &bytes), smoe::StatusCode::kInvalidArgument, "T*K");
  EXPECT_EQ(bytes, 12345u) << "bytes must be left alone on error";

  smoe::MoEShape s{(int64_t{1} << 62) + 16, 64, 64, 8, 4};
  st = smoe::moe_can_implement(s);
  EXPECT_EQ(st.code, smoe::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message.find("T*K"), std::string::npos) << st.message;
  EXPECT_EQ(smoe::moe_saved_state_size(s), 0u);
  EXPECT_EQ(smoe::moe_forward_workspace_size(s), 0u);
  EXPECT_EQ(smoe::moe_backward_workspace_size(s), 0u);

  // T*K fits int32, but T*K rows of width max(2n, d) do not fit the byte limit.
  smoe::MoEShape wide{1 << 20, 64, 1 << 30, 16, 16};
  st = smoe::moe_can_implement(wide);
  EXPECT_EQ(st.code, smoe::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message.find("max(2n, d)"), std::string::npos) << st.message;
  EXPECT_EQ(smoe::moe_saved_state_size(wide), 0u);

  // A legitimate large shape (DeepSeek-V3.2, T = 32768) passes.
  EXPECT_TRUE(smoe::moe_can_implement(smoe::MoEShape{32768, 7168, 2048, 256, 8}).ok());
}

TEST(StatusNames, AllCodesNamed) {
  EXPECT_STREQ(smoe::status_code_name(smoe::StatusCode::kOk), "ok");
  EXPECT_STREQ(smoe::status_code_name(smoe::StatusCode::kMisalignedPointer), "misaligned pointer");
}

// Every pointer and size argument of moe_forward / moe_backward against its rule, on the CPU: each
// case must be rejected with its own code and argument name BEFORE any CUDA call (a call that got
// as far as the device would report kCudaError here, where there is none).
namespace {
// Buffers 4 GiB apart (kSlot * i): disjoint for every shape used here, so that only the
// mutation under test breaks a rule (outputs may not overlap inputs or each other).
constexpr uintptr_t kSlot = uintptr_t{1} << 32;
smoe::MoEForwardArgs good_forward(const smoe::MoEShape& s) {
  smoe::MoEForwardArgs a;
  a.shape = s;
  a.x = fake<const smoe::bf16>(1 * kSlot);
  a.weights.w_router = fake<const smoe::bf16>(2 * kSlot);
  a.weights.w1 = fake<const smoe::bf16>(3 * kSlot);
  a.weights.w2 = fake<const smoe::bf16>(4 * kSlot);
  a.out = fake<smoe::bf16>(5 * kSlot);
  a.saved = fake<void>(6 * kSlot);
  a.saved_bytes = smoe::moe_saved_state_size(s);
  a.workspace = fake<void>(7 * kSlot);
  a.workspace_bytes = smoe::moe_forward_workspace_size(s);
  a.status = fake<smoe::DeviceStatus>(8 * kSlot);
  return a;
}
smoe::MoEBackwardArgs good_backward(const smoe::MoEShape& s) {
  smoe::MoEBackwardArgs a;
  a.shape = s;
  a.x = fake<const smoe::bf16>(1 * kSlot);
  a.weights.w_router = fake<const smoe::bf16>(2 * kSlot);
  a.weights.w1 = fake<const smoe::bf16>(3 * kSlot);
  a.weights.w2 = fake<const smoe::bf16>(4 * kSlot);
  a.dout = fake<const smoe::bf16>(5 * kSlot);
  a.saved = fake<const void>(6 * kSlot);
  a.saved_bytes = smoe::moe_saved_state_size(s);
  a.dx = fake<smoe::bf16>(9 * kSlot);
  a.dw_router = fake<smoe::bf16>(10 * kSlot);
  a.dw1 = fake<smoe::bf16>(11 * kSlot);
  a.dw2 = fake<smoe::bf16>(12 * kSlot);
  a.workspace = fake<void>(7 * kSlot);
  a.workspace_bytes = smoe::moe_backward_workspace_size(s);  // host arithmetic: no device needed
  return a;
}
}  // namespace

TEST(LayerValidation, ForwardArgumentsRejectedBeforeAnyCudaCall) {
  const smoe::MoEShape s{1000, 512, 256, 16, 4};
  using C = smoe::StatusCode;
  struct Case {
    const char* name;
    void (*mutate)(smoe::MoEForwardArgs*);
    C code;
  };
  const Case cases[] = {
      {"d = 96", [](smoe::MoEForwardArgs* a) { a->shape.d = 96; }, C::kInvalidArgument},
      {"x is null", [](smoe::MoEForwardArgs* a) { a->x = nullptr; }, C::kInvalidArgument},
      {"x = ", [](smoe::MoEForwardArgs* a) { a->x = fake<const smoe::bf16>(1 * kSlot + 2); }, C::kMisalignedPointer},
      {"weights.w_router is null", [](smoe::MoEForwardArgs* a) { a->weights.w_router = nullptr; }, C::kInvalidArgument},
      {"weights.w1 = ", [](smoe::MoEForwardArgs* a) { a->weights.w1 = fake<const smoe::bf16>(3 * kSlot + 8); }, C::kMisalignedPointer},
      {"weights.w2 is null", [](smoe::MoEForwardArgs* a) { a->weights.w2 = nullptr; }, C::kInvalidArgument},
      {"saved is null", [](smoe::MoEForwardArgs* a) { a->saved = nullptr; }, C::kInvalidArgument},
      {"saved_bytes", [](smoe::MoEForwardArgs* a) { a->saved_bytes -= 1; }, C::kWorkspaceTooSmall},
      {"out is null", [](smoe::MoEForwardArgs* a) { a->out = nullptr; }, C::kInvalidArgument},
      {"status is null", [](smoe::MoEForwardArgs* a) { a->status = nullptr; }, C::kInvalidArgument},
      {"workspace = ", [](smoe::MoEForwardArgs* a) { a->workspace = fake<void>(7 * kSlot + 0x80); }, C::kMisalignedPointer},
      {"workspace_bytes", [](smoe::MoEForwardArgs* a) { a->workspace_bytes -= 1; }, C::kWorkspaceTooSmall},
      // Aliasing: an output on an input, on another output, or a partial overlap by one element.
      {"out (1024000 bytes) overlaps x", [](smoe::MoEForwardArgs* a) { a->out = const_cast<smoe::bf16*>(a->x); }, C::kInvalidArgument},
      {"out (1024000 bytes) overlaps weights.w2", [](smoe::MoEForwardArgs* a) { a->out = fake<smoe::bf16>(4 * kSlot - 1024000 + 16); }, C::kInvalidArgument},
      {"saved", [](smoe::MoEForwardArgs* a) { a->saved = static_cast<char*>(a->workspace) + 1024; }, C::kInvalidArgument},
      {"status", [](smoe::MoEForwardArgs* a) { a->status = fake<smoe::DeviceStatus>(5 * kSlot + 64); }, C::kInvalidArgument},
      // Gate/up as two tensors: w3 aligned, and w1 / w3 each [E][n][d] (4 MiB here) not under an output.
      {"weights.w3 = ", [](smoe::MoEForwardArgs* a) { a->weights.w3 = fake<const smoe::bf16>(13 * kSlot + 8); }, C::kMisalignedPointer},
      {"out (1024000 bytes) overlaps weights.w3",
       [](smoe::MoEForwardArgs* a) { a->weights.w3 = fake<const smoe::bf16>(13 * kSlot); a->out = fake<smoe::bf16>(13 * kSlot + 4194304 - 16); },
       C::kInvalidArgument},
  };
  for (const Case& c : cases) {
    smoe::MoEForwardArgs a = good_forward(s);
    c.mutate(&a);
    expect_error(smoe::moe_forward(a, nullptr), c.code, c.name);
  }
}

TEST(LayerValidation, BackwardArgumentsRejectedBeforeAnyCudaCall) {
  const smoe::MoEShape s{1000, 512, 256, 16, 4};
  using C = smoe::StatusCode;
  struct Case {
    const char* name;
    void (*mutate)(smoe::MoEBackwardArgs*);
    C code;
  };
  const Case cases[] = {
      {"n = 100", [](smoe::MoEBackwardArgs* a) { a->shape.n = 100; }, C::kInvalidArgument},
      {"x is null", [](smoe::MoEBackwardArgs* a) { a->x = nullptr; }, C::kInvalidArgument},
      {"weights.w1 is null", [](smoe::MoEBackwardArgs* a) { a->weights.w1 = nullptr; }, C::kInvalidArgument},
      {"saved_bytes", [](smoe::MoEBackwardArgs* a) { a->saved_bytes = 64; }, C::kWorkspaceTooSmall},
      {"dout is null", [](smoe::MoEBackwardArgs* a) { a->dout = nullptr; }, C::kInvalidArgument},
      {"dout = ", [](smoe::MoEBackwardArgs* a) { a->dout = fake<const smoe::bf16>(5 * kSlot + 4); }, C::kMisalignedPointer},
      {"dx is null", [](smoe::MoEBackwardArgs* a) { a->dx = nullptr; }, C::kInvalidArgument},
      {"dw_router is null", [](smoe::MoEBackwardArgs* a) { a->dw_router = nullptr; }, C::kInvalidArgument},
      {"dw1 = ", [](smoe::MoEBackwardArgs* a) { a->dw1 = fake<smoe::bf16>(11 * kSlot + 2); }, C::kMisalignedPointer},
      {"dw2 is null", [](smoe::MoEBackwardArgs* a) { a->dw2 = nullptr; }, C::kInvalidArgument},
      {"dw1 (8388608 bytes) overlaps weights.w1", [](smoe::MoEBackwardArgs* a) { a->dw1 = const_cast<smoe::bf16*>(a->weights.w1); }, C::kInvalidArgument},
      {"dx (1024000 bytes) overlaps dout", [](smoe::MoEBackwardArgs* a) { a->dx = const_cast<smoe::bf16*>(a->dout); }, C::kInvalidArgument},
      {"dw_router", [](smoe::MoEBackwardArgs* a) { a->dw_router = a->dw2 + 64; }, C::kInvalidArgument},
      {"workspace", [](smoe::MoEBackwardArgs* a) { a->workspace = const_cast<void*>(a->saved); }, C::kInvalidArgument},
      {"workspace_bytes", [](smoe::MoEBackwardArgs* a) { a->workspace_bytes -= 1; }, C::kWorkspaceTooSmall},
      {"dx (1024000 bytes) overlaps x", [](smoe::MoEBackwardArgs* a) { a->dx = fake<smoe::bf16>(1 * kSlot + 1024000 - 16); }, C::kInvalidArgument},
      // Gate/up as two tensors: dw3 exactly with w3; dw1 / dw3 / w3 each [E][n][d] = 4 MiB.
      {"dw3 must be null", [](smoe::MoEBackwardArgs* a) { a->dw3 = fake<smoe::bf16>(14 * kSlot); }, C::kInvalidArgument},
      {"dw3 (weights.w3 is set) is null", [](smoe::MoEBackwardArgs* a) { a->weights.w3 = fake<const smoe::bf16>(13 * kSlot); }, C::kInvalidArgument},
      {"dw3 (4194304 bytes) overlaps weights.w3",
       [](smoe::MoEBackwardArgs* a) { a->weights.w3 = fake<const smoe::bf16>(13 * kSlot); a->dw3 = fake<smoe::bf16>(13 * kSlot + 4194304 - 16); },
       C::kInvalidArgument},
      {"dw1 (4194304 bytes) overlaps dw3",
       [](smoe::MoEBackwardArgs* a) { a->weights.w3 = fake<const smoe::bf16>(13 * kSlot); a->dw3 = a->dw1 + 2097152 - 8; },
       C::kInvalidArgument},
      // consume_saved writes the saved state: an output then, so it may not overlap an input; its
      // workspace is the smaller query's, and one byte less is refused.
      {"saved (consume_saved)",
       [](smoe::MoEBackwardArgs* a) { a->consume_saved = true; a->x = static_cast<const smoe::bf16*>(a->saved) + 64; },
       C::kInvalidArgument},
      {"workspace_bytes",
       [](smoe::MoEBackwardArgs* a) {
         a->consume_saved = true;
         a->workspace_bytes = smoe::moe_backward_workspace_size(a->shape, true) - 1;
       },
       C::kWorkspaceTooSmall},
  };
  for (const Case& c : cases) {
    smoe::MoEBackwardArgs a = good_backward(s);
    c.mutate(&a);
    expect_error(smoe::moe_backward(a, nullptr), c.code, c.name);
  }
}

// The backward workspace size is host arithmetic on the shape (no device query: the same bytes on
// this GPU-less machine as on an H200), here derived by hand region by region, each rounded up to
// 256 bytes (memory_plan.cpp, backward_ws). T = 1000, d = 512, n = 256, E = 16, K = 4: R = T*K = 4000.
TEST(LayerSizes, BackwardWorkspaceIsHostArithmetic) {
  const smoe::MoEShape s{1000, 512, 256, 16, 4};
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t R = 4000;
  // A' and the dS partials (dead after dW2) share bytes with dX~ (written after): the larger side.
  const size_t early = up(R * 256 * 2)            // A' [R][n] bf16          2048000
                       + up(R * 2 * 4);           // dS partials [R][n/128]    32000
  const size_t late = up(R * 512 * 2);            // dX~ [R][d] bf16         4096000
  const size_t rows_part = up(R * 512 * 2)        // dH [R][2n] bf16         4096000
                           + std::max(early, late)
                           + up(4) + up(17 * 4);  // valid flag, expert_offset [E+1]: 256 + 256
  const size_t router_part = (size_t{32} << 20)     // cuBLAS workspace     33554432
                             + up(R * 4)            // dS [R] fp32             16128
                             + up(1000 * 16 * 2)    // dlogits [T][E] bf16     32000
                             + up(16 * 512 * 4)     // dW_r [E][d] fp32        32768
                             + up(4000 * 4);        // dl [T*K] fp32 (top-K)   16128
  EXPECT_EQ(rows_part, 8192512u);
  EXPECT_EQ(router_part, 33651456u);
  EXPECT_GT(smoe::moe_backward_workspace_size(s), 0u);
  EXPECT_EQ(smoe::moe_backward_workspace_size(s), rows_part + router_part);  // 41843968
  smoe::MoEShape provided = s;
  provided.router = smoe::MoERouter::kProvided;  // no router: no cuBLAS, dS, dlogits, dW_r, dl
  EXPECT_EQ(smoe::moe_backward_workspace_size(provided), rows_part);
  // consume_saved: dH is written over the saved H, so its region goes (8192512 - 4096000 rows part).
  EXPECT_EQ(smoe::moe_backward_workspace_size(s, true), rows_part - up(R * 512 * 2) + router_part);  // 37747968
  EXPECT_EQ(smoe::moe_backward_workspace_size(provided, true), rows_part - up(R * 512 * 2));
  EXPECT_EQ(smoe::moe_backward_workspace_size(s, false), smoe::moe_backward_workspace_size(s));
}

// Lifetimes in the backward workspace (backward.cu, one stream: dA' -> ds_rowsum -> dW2 -> router
// backward -> dW1 -> dX~ -> dx_sum). dX~ is written after the last reads of A' (dW2) and of the dS
// partials (ds_rowsum), so it shares their bytes; it must share none with a buffer that is read after
// dX~ is written (dH by dX~ itself; dl and dx_router by dx_sum; valid and expert_offset throughout) or
// that the router backward writes (dS, dlogits, dW_r, logits), nor with the cuBLAS workspace.
TEST(LayerSizes, BackwardWorkspaceSharesOnlyDeadBytes) {
  struct Span {
    const void* p;
    size_t bytes;
    const char* name;
  };
  auto overlap = [](const Span& a, const Span& b) {
    const char *pa = static_cast<const char*>(a.p), *pb = static_cast<const char*>(b.p);
    return a.p && b.p && a.bytes && b.bytes && pa < pb + b.bytes && pb < pa + a.bytes;
  };
  char* base = reinterpret_cast<char*>(uintptr_t{1} << 40);  // never dereferenced: the plan only adds offsets
  for (const smoe::MoERouter router :
       {smoe::MoERouter::kTopKSoftmax, smoe::MoERouter::kTokenRounding, smoe::MoERouter::kProvided}) {
    for (const auto& dn : {std::pair<int, int>{512, 256}, std::pair<int, int>{256, 1024}}) {  // d > n and d < n
      for (const bool consume : {false, true}) {  // consume_saved: no dH here (it goes over the saved H)
        smoe::MoEShape s{1000, dn.first, dn.second, 16, 4};
        s.router = router;
        const size_t R = static_cast<size_t>(smoe::moe_row_capacity(s)), T = 1000, E = 16, d = s.d, n = s.n;
        const smoe::plan::BackwardWs w = smoe::plan::backward_ws(s, base, consume);
        EXPECT_EQ(w.dH == nullptr, consume);
        EXPECT_EQ(w.total, smoe::moe_backward_workspace_size(s, consume));
        const Span dxt{w.dXt, R * d * 2, "dX~"};
        const Span dead[] = {{w.a_prime, R * n * 2, "A'"}, {w.ds_partial, R * ((n + 127) / 128) * 4, "dS partials"}};
        const Span live[] = {{w.cublas, smoe::plan::kCublasWorkspace, "cuBLAS"}, {w.dH, R * 2 * n * 2, "dH"},
                             {w.dS, R * 4, "dS"}, {w.dl, T * 4 * 4, "dl"}, {w.dlogits, T * E * 2, "dlogits"},
                             {w.dwr32, E * d * 4, "dW_r"}, {w.logits, T * E * 4, "logits"},
                             {w.dx_router, T * d * 4, "dx_router"}, {w.valid, 4, "valid"},
                             {w.expert_offset, (E + 1) * 4, "expert_offset"}};
        const std::string at = "router " + std::to_string(static_cast<int>(router)) + ", d " + std::to_string(d) +
                               (consume ? ", consume_saved" : "");
        EXPECT_TRUE(overlap(dxt, dead[0])) << at << ": dX~ should reuse A''s bytes";
        for (const Span& l : live) {
          EXPECT_FALSE(overlap(dxt, l)) << at << ": dX~ shares bytes with " << l.name;
          for (const Span& e : dead) EXPECT_FALSE(overlap(e, l)) << at << ": " << e.name << " shares bytes with " << l.name;
        }
        for (const Span& x : {dxt, dead[0], dead[1]})
          EXPECT_LE(static_cast<const char*>(x.p) + x.bytes, base + w.total) << at << ": " << x.name << " past the end";
        EXPECT_FALSE(overlap(dead[0], dead[1])) << at;
      }
    }
  }
}

// Routing modes of the layer: their own rules, checked before any CUDA call like the rest.
TEST(LayerValidation, RoutingModesRules) {
  using C = smoe::StatusCode;
  smoe::MoEShape s{1000, 512, 256, 16, 4};
  s.router = static_cast<smoe::MoERouter>(7);
  expect_error(smoe::moe_can_implement(s), C::kInvalidArgument, "router = 7");
  s.router = smoe::MoERouter::kTokenRounding;
  s.rounding = static_cast<smoe::TokenRoundingMode>(9);
  EXPECT_FALSE(smoe::moe_can_implement(s).ok()) << "a rounding mode outside the enum must be rejected";
  EXPECT_EQ(smoe::moe_saved_state_size(s), 0u);

  // Row capacity: T*K, or the worst case of token rounding with the engine's tile.
  const int tile = smoe::moe_token_rounding_tile(s);
  EXPECT_EQ(tile, 128);
  for (smoe::TokenRoundingMode m : {smoe::TokenRoundingMode::kNearest, smoe::TokenRoundingMode::kUp,
                                    smoe::TokenRoundingMode::kStochastic}) {
    s.rounding = m;
    EXPECT_EQ(smoe::moe_row_capacity(s), std::min<int64_t>(1000 * 16, 1000 * 4 + 16 * (tile - 1)));
  }
  s.rounding = smoe::TokenRoundingMode::kDown;
  EXPECT_EQ(smoe::moe_row_capacity(s), 4000);
  s.router = smoe::MoERouter::kProvided;
  EXPECT_EQ(smoe::moe_row_capacity(s), 4000);
  smoe::MoEShape topk{1000, 512, 256, 16, 4};
  smoe::MoEShape tr = topk;
  tr.router = smoe::MoERouter::kTokenRounding;
  tr.rounding = smoe::TokenRoundingMode::kUp;
  EXPECT_GT(smoe::moe_saved_state_size(tr), smoe::moe_saved_state_size(topk)) << "TR holds more rows";
  EXPECT_GT(smoe::moe_forward_workspace_size(tr), smoe::moe_forward_workspace_size(topk));
}

TEST(LayerValidation, ProvidedRoutingArgumentsRejectedBeforeAnyCudaCall) {
  using C = smoe::StatusCode;
  smoe::MoEShape s{1000, 512, 256, 16, 4, smoe::MoERouter::kProvided};
  auto good = [&]() {
    smoe::MoEForwardArgs a = good_forward(s);
    a.routed_expert = fake<const int32_t>(13 * kSlot);
    a.routed_scores = fake<const float>(14 * kSlot);
    return a;
  };
  smoe::MoEForwardArgs a = good();
  a.routed_expert = nullptr;
  expect_error(smoe::moe_forward(a, nullptr), C::kInvalidArgument, "routed_expert");
  a = good();
  a.routed_scores = fake<const float>(14 * kSlot + 2);
  expect_error(smoe::moe_forward(a, nullptr), C::kMisalignedPointer, "routed_scores");
  a = good();
  a.out = fake<smoe::bf16>(13 * kSlot + 64);  // the output on the caller's routing
  expect_error(smoe::moe_forward(a, nullptr), C::kInvalidArgument, "overlaps routed_expert");
  // The router weights are not used: null passes their check (the call then stops at the workspace).
  a = good();
  a.weights.w_router = nullptr;
  a.workspace_bytes -= 1;
  expect_error(smoe::moe_forward(a, nullptr), C::kWorkspaceTooSmall, "workspace_bytes");

  smoe::MoEBackwardArgs b = good_backward(s);
  b.dscores = nullptr;
  expect_error(smoe::moe_backward(b, nullptr), C::kInvalidArgument, "dscores");
  b = good_backward(s);
  b.dscores = fake<float>(15 * kSlot);
  b.dw_router = nullptr;  // not written with provided routing
  b.weights.w_router = nullptr;
  b.dw2 = nullptr;  // checked after the router arguments: the error proves they passed
  expect_error(smoe::moe_backward(b, nullptr), C::kInvalidArgument, "dw2 is null");
  b = good_backward(s);
  b.dscores = fake<float>(5 * kSlot);  // on dout
  expect_error(smoe::moe_backward(b, nullptr), C::kInvalidArgument, "dscores");
}

// T = 0 is a valid batch (an empty micro-batch): token tensors may be null.
TEST(LayerValidation, ZeroTokensAcceptNullTokenTensors) {
  using C = smoe::StatusCode;
  for (smoe::MoERouter r : {smoe::MoERouter::kTopKSoftmax, smoe::MoERouter::kTokenRounding, smoe::MoERouter::kProvided}) {
    const smoe::MoEShape s{0, 512, 256, 16, 4, r};
    ASSERT_TRUE(smoe::moe_can_implement(s).ok());
    EXPECT_EQ(smoe::moe_row_capacity(s), 0);
    smoe::MoEForwardArgs a = good_forward(s);
    a.x = nullptr;
    a.out = nullptr;
    a.status = nullptr;  // checked after x and out: the error proves they passed
    expect_error(smoe::moe_forward(a, nullptr), C::kInvalidArgument, "status is null");
    smoe::MoEBackwardArgs b = good_backward(s);
    b.x = nullptr;
    b.dout = nullptr;
    b.dx = nullptr;
    b.dscores = nullptr;  // no slot either
    b.dw2 = nullptr;      // checked after the token tensors
    expect_error(smoe::moe_backward(b, nullptr), C::kInvalidArgument, "dw2 is null");
  }
}

// provided_routing: the caller's ids and scores and the outputs against their rules, before any CUDA
// call (ids themselves are device data: checked on the device, see GpuLayerRouting.ProvidedInvalid*).
TEST(RoutingValidation, ProvidedRoutingRejectsBeforeLaunch) {
  using C = smoe::StatusCode;
  const smoe::RoutingProblem p = problem(100, 64, 8);
  const int32_t* ids = fake<const int32_t>(0xA0000);
  const float* sc = fake<const float>(0xB0000);
  void* ws = fake<void>(0x100000);
  expect_error(smoe::provided_routing(problem(100, 64, 65), ids, sc, fake_outputs(), ws, 1 << 20, nullptr),
               C::kInvalidArgument, "provided_routing: top_k");
  expect_error(smoe::provided_routing(p, nullptr, sc, fake_outputs(), ws, 1 << 20, nullptr), C::kInvalidArgument,
               "expert is null");
  expect_error(smoe::provided_routing(p, ids, fake<const float>(0xB0002), fake_outputs(), ws, 1 << 20, nullptr),
               C::kMisalignedPointer, "scores");
  smoe::RoutingOutputs o = fake_outputs();
  o.token_offset = fake<int32_t>(0xC0001);
  expect_error(smoe::provided_routing(p, ids, sc, o, ws, 1 << 20, nullptr), C::kMisalignedPointer,
               "outputs.token_offset");
  o = fake_outputs();
  o.reverse_scatter_idx = nullptr;
  expect_error(smoe::provided_routing(p, ids, sc, o, ws, 1 << 20, nullptr), C::kInvalidArgument,
               "outputs.reverse_scatter_idx");
}

// The grid helper caps every elementwise launch; a flag-gated kernel (nan_fill: nothing to do on a
// valid backward) gets the small cap. At the large one its 65536 blocks cost 0.3 ms per backward.
TEST(GridStride, BlocksAreCapped) {
  using smoe::detail::grid_blocks;
  EXPECT_EQ(grid_blocks(0, 256), 1u);
  EXPECT_EQ(grid_blocks(1000, 256), 4u);
  EXPECT_EQ(grid_blocks(int64_t{1} << 40, 256), static_cast<unsigned>(smoe::detail::kGridCapWork));
  EXPECT_EQ(grid_blocks(int64_t{1} << 40, 256, smoe::detail::kGridCapGated), 1024u);
  EXPECT_LE(smoe::detail::kGridCapGated * 256, int64_t{1} << 20);  // gated grids stay ~1 wave
}
