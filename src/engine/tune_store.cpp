#include "engine/tune_store.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <unistd.h>

namespace smoe {
namespace engine {
namespace {

const char* env(const char* name) { return std::getenv(name); }

// The file's text, "" when there is none.
std::string read_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return "";
  std::stringstream text;
  text << f.rdbuf();
  return text.str();
}

struct Store {
  std::mutex mu;
  std::string path;
  TuneCache cache;
  bool warned = false;
  Store() { load(); }
  // The path from the environment and the file's entries; this process's measured ones dropped.
  void load() {
    path = tune_cache_path(env);
    cache = TuneCache();
    warned = false;
    const std::string text = path.empty() ? "" : read_file(path);
    if (!text.empty() && !cache.merge_json(text))
      std::fprintf(stderr, "[smoe engine] %s does not parse as a tune cache: ignored\n", path.c_str());
  }
  // The file's entries now (another process may have added some), this process's on top. Called
  // with mu held.
  bool write() {
    if (path.empty()) return true;
    TuneCache merged;
    merged.merge_json(read_file(path));  // unparsable: replaced by ours
    if (!merged.merge_json(cache.to_json())) return false;
    std::error_code ec;
    const std::filesystem::path p(path);
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
    const std::string tmp = path + ".tmp." + std::to_string(static_cast<long long>(getpid()));
    const std::string text = merged.to_json();
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) return false;
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      return false;
    }
    return true;
  }
};

Store& store() {
  static Store s;
  return s;
}

}  // namespace

std::optional<EngineConfig> tuned_choice(const TuneKey& k) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.cache.get(k);
}

EngineConfig store_tuned(const TuneKey& k, const EngineConfig& winner) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  if (const std::optional<EngineConfig> c = s.cache.get(k)) return *c;
  if (!s.cache.put(k, winner)) return winner;  // not of the key's kind or not built: never from the tuner
  if (!s.write() && !s.warned) {
    s.warned = true;
    std::fprintf(stderr, "[smoe engine] cannot write the tune cache %s: measured choices kept in memory only\n",
                 s.path.c_str());
  }
  return winner;
}

std::string tune_store_path() {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.path;
}

void reload_tune_store_from_env() {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  s.load();
}

}  // namespace engine
}  // namespace smoe
