// The dispatch tables: from a typed configuration (config.h) to the instantiation that runs it. Built
// from the one instance list (engine_instances/instances.inc); the entry points (engine.cpp) and the
// tuner (tuner.cpp) both launch through them.
#pragma once

#include <cuda_runtime_api.h>

#include "engine/args.h"
#include "engine/config.h"

namespace smoe {
namespace engine {

// What an instantiation's function does. kSetup: everything a launch does on the host before the
// launch itself (the kernel's shared-memory attribute; for clusters, how many fit on the device),
// so that a caller which must change state before the launch (the consuming backward, engine.h's
// prepare_varlen_m) meets those failures first; of `a` it reads only what picks the kernel
// (halves), and it launches nothing. kLaunch: that, then the launch.
enum class LaunchStep { kSetup, kLaunch };

using RunVarlenM = Status (*)(const VarlenMArgs&, int sm_count, cudaStream_t, LaunchStep);
// Takes the kernel's arguments: as_gather_p (heuristic.h) of a Q-gathered call.
using RunVarlenK = Status (*)(const VarlenKArgs&, int sm_count, cudaStream_t, LaunchStep);

// Null where this build has no such instantiation (or it is of the other grouping).
RunVarlenM find_varlen_m(const EngineConfig& c);
RunVarlenK find_varlen_k(const EngineConfig& c);

}  // namespace engine
}  // namespace smoe
