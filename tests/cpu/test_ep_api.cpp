// EP argument rules that need no GPU and no communicator: null context, null communicator, sizes
// of an invalid context. (Everything with a communicator runs in test_ep on 2 GPUs.)
#include <gtest/gtest.h>

#include "smoe/ep.h"

TEST(EpApi, CreateRejectsNullArguments) {
  smoe::EpConfig c;
  c.max_tokens = 16, c.d = 64, c.n = 64, c.E = 8, c.K = 2;
  smoe::Status s = smoe::ep_create(nullptr, c, nullptr);
  EXPECT_EQ(s.code, smoe::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("out is null"), std::string::npos) << s.message;
  smoe::EpContext* ctx = reinterpret_cast<smoe::EpContext*>(0x1);
  s = smoe::ep_create(nullptr, c, &ctx);
  EXPECT_EQ(s.code, smoe::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("comm is null"), std::string::npos) << s.message;
  EXPECT_EQ(ctx, nullptr) << "out must be cleared on failure";
}

TEST(EpApi, NullContextIsAnErrorNotACrash) {
  smoe::EpForwardArgs f;
  smoe::Status s = smoe::ep_forward(nullptr, f, nullptr);
  EXPECT_EQ(s.code, smoe::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("ep_forward: ctx is null"), std::string::npos) << s.message;
  smoe::EpBackwardArgs b;
  s = smoe::ep_backward(nullptr, b, nullptr);
  EXPECT_NE(s.message.find("ep_backward: ctx is null"), std::string::npos) << s.message;
  EXPECT_EQ(smoe::ep_saved_state_size(nullptr, 16), 0u);
  EXPECT_EQ(smoe::ep_forward_workspace_size(nullptr, 16), 0u);
  EXPECT_EQ(smoe::ep_backward_workspace_size(nullptr, 16), 0u);
  EXPECT_EQ(smoe::ep_info(nullptr).world, 0);
  EXPECT_TRUE(smoe::ep_destroy(nullptr).ok());
}
