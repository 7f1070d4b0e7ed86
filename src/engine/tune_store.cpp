#include "engine/tune_store.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

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
  // The file's entries now (another process may have added some), this process's on top, written
  // through a unique temporary file renamed over it. Read, merge and rename happen under an
  // exclusive flock on `path.lock`, so processes that share the file (ranks of one job, runs on a
  // shared home) add to it instead of replacing each other's entries. A file that exists but does
  // not parse is left alone (false: the choices stay in memory). Called with mu held.
  bool write() {
    if (path.empty()) return true;
    std::error_code ec;
    const std::filesystem::path p(path);
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
    const int lock = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock < 0) return false;
    while (::flock(lock, LOCK_EX) != 0)
      if (errno != EINTR) {
        ::close(lock);
        return false;
      }
    const bool ok = write_locked();
    ::close(lock);  // releases the lock
    return ok;
  }
  bool write_locked() {
    TuneCache merged;
    const std::string old = read_file(path);
    if (!old.empty() && !merged.merge_json(old)) return false;  // not ours to replace
    if (!merged.merge_json(cache.to_json())) return false;
    const std::string text = merged.to_json();
    std::string tmp = path + ".tmp.XXXXXX";
    const int fd = ::mkstemp(tmp.data());
    if (fd < 0) return false;
    bool ok = true;
    for (size_t done = 0; ok && done < text.size();) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n > 0) done += static_cast<size_t>(n);
      else ok = n < 0 && errno == EINTR;
    }
    if (::close(fd) != 0) ok = false;
    if (ok) ::chmod(tmp.c_str(), 0644);  // mkstemp makes it 0600; the cache is the user's, readable
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
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
