// The engine's argument rules, checked on the host before anything runs: a rejected call returns a
// Status naming the argument and the rule. Each epilogue's own rules live beside its parameters
// (epilogue/*.h) and are called from here.
#pragma once

#include "engine/args.h"

namespace smoe {
namespace engine {

Status check_varlen_m(const VarlenMArgs& a);
Status check_varlen_k(const VarlenKArgs& a);

}  // namespace engine
}  // namespace smoe
