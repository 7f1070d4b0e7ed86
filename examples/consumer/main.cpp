// Sizes a MoE layer's buffers through the public API (host-only queries) and runs the float64
// reference's routing on a tiny problem: proof that the installed package links and works. On a
// Hopper GPU a real engine would now allocate the buffers and call smoe::moe_forward/backward.
#include <cstdio>
#include <vector>

#include "smoe/reference.h"
#include "smoe/smoe.h"

int main() {
  smoe::MoEShape s;
  s.T = 4096;
  s.d = 2048;
  s.n = 1024;
  s.E = 64;
  s.K = 8;
  const smoe::Status ok = smoe::moe_can_implement(s);
  std::printf("moe_can_implement(OLMoE-like, T=4096): %s\n", ok.ok() ? "ok" : ok.message.c_str());
  std::printf("saved state %zu bytes, forward workspace %zu bytes\n", smoe::moe_saved_state_size(s),
              smoe::moe_forward_workspace_size(s));
  s.d = 100;  // breaks a rule: the error names the argument and the rule
  const smoe::Status bad = smoe::moe_can_implement(s);
  std::printf("d = 100: %s\n", bad.message.c_str());
  // The float64 reference (smoe::reference): top-2 of 4 experts for one token.
  const smoe::ref::TopKRouting r = smoe::ref::topk_softmax_ref({0.5, 2.0, -1.0, 1.0}, 1, 4, 2);
  std::printf("reference top-2: experts %d, %d scores %.4f, %.4f\n", r.expert[0], r.expert[1], r.score[0],
              r.score[1]);
  const bool ref_ok = r.expert[0] == 1 && r.expert[1] == 3;
  return ok.ok() && !bad.ok() && ref_ok ? 0 : 1;
}
