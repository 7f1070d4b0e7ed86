// The process's measured choices: the tune cache file (tune_cache_path) read on first use, plus what
// this process measured (tuner.h), which is written back to the file. Thread-safe.
#pragma once

#include <optional>
#include <string>

#include "engine/config.h"
#include "engine/tune_cache.h"

namespace smoe {
namespace engine {

// The key's measured choice, if the file or this process has one.
std::optional<EngineConfig> tuned_choice(const TuneKey& k);

// Records a measured winner unless the key already has a choice (another thread measured it first)
// and returns the key's choice afterwards, so every caller of one key runs the same configuration.
// Then rewrites the file: its current entries, with this process's on top, to a temporary file
// renamed over it (a reader sees the old file or the new, never half of one). A file that cannot be
// written costs a warning on stderr once, not the call.
EngineConfig store_tuned(const TuneKey& k, const EngineConfig& winner);

// Where store_tuned writes ("" when no path is known: then nothing is written).
std::string tune_store_path();
// Forget this process's entries and read the path and the file again (tests, after changing
// SMOE_ENGINE_TUNE_CACHE; not meant to race engine calls).
void reload_tune_store_from_env();

}  // namespace engine
}  // namespace smoe
