#include "engine/tune_cache.h"

#include <cctype>
#include <cstdlib>
#include <limits>
#include <vector>

#include "engine/heuristic.h"

namespace smoe {
namespace engine {
namespace {

constexpr Kind kKinds[] = {Kind::up_swiglu,   Kind::down_store,    Kind::dx_store, Kind::da_dswiglu,
                           Kind::dw_gather_p, Kind::dw_gather_p_t, Kind::dw_tma};
constexpr Sched kScheds[] = {Sched::kCoop, Sched::kPingPong, Sched::kPingPongStaged, Sched::kPingPongStaged2,
                             Sched::kPingPong64};

// The file's format: 2 since TuneKey has hbm_gbps. A versioned object, not the first format's bare
// array, so that a build from before (which reads only the array) finds the file unparsable and leaves
// it alone: it would otherwise read the entries without their hbm_gbps, merge the H100's and the H200's
// choices for one shape into one, and write them back without it, lost to every later build.
constexpr int64_t kFileVersion = 2;

std::optional<Kind> parse_kind(const std::string& s) {
  for (Kind k : kKinds)
    if (s == kind_name(k)) return k;
  return std::nullopt;
}

// The flat JSON objects of to_json: {"key": "string" | integer | true | false, ...}.
struct Obj {
  std::map<std::string, std::string> str;
  std::map<std::string, int64_t> num;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  // The whole text: the versioned object to_json writes, {"version": 2, "entries": [...]}, or the
  // bare array of the first format (entries without hbm_gbps). Any other version: false.
  bool document(std::vector<Obj>* out) {
    ws();
    if (i_ < s_.size() && s_[i_] == '[') return array(out) && end();
    std::string k;
    int64_t version = 0;
    if (!eat('{') || !string(&k) || k != "version" || !eat(':') || !number(&version) || version != kFileVersion)
      return false;
    if (!eat(',') || !string(&k) || k != "entries" || !eat(':') || !array(out)) return false;
    return eat('}') && end();
  }

 private:
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool end() {
    ws();
    return i_ == s_.size();
  }
  bool array(std::vector<Obj>* out) {
    if (!eat('[')) return false;
    if (eat(']')) return true;
    do {
      Obj o;
      if (!object(&o)) return false;
      out->push_back(o);
    } while (eat(','));
    return eat(']');
  }
  bool number(int64_t* v) {
    ws();
    const size_t b = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    if (i_ == b || (i_ == b + 1 && s_[b] == '-') || i_ - b > 18) return false;
    *v = std::strtoll(s_.c_str() + b, nullptr, 10);
    return true;
  }
  bool string(std::string* out) {
    if (!eat('"')) return false;
    out->clear();
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\') return false;  // to_json writes no escapes
      out->push_back(s_[i_++]);
    }
    return i_ < s_.size() && s_[i_++] == '"';
  }
  bool object(Obj* o) {
    if (!eat('{')) return false;
    if (eat('}')) return true;
    do {
      std::string k;
      if (!string(&k) || !eat(':')) return false;
      ws();
      if (i_ < s_.size() && s_[i_] == '"') {
        std::string v;
        if (!string(&v)) return false;
        o->str[k] = v;
      } else if (s_.compare(i_, 4, "true") == 0) {
        i_ += 4;
        o->num[k] = 1;
      } else if (s_.compare(i_, 5, "false") == 0) {
        i_ += 5;
        o->num[k] = 0;
      } else {
        int64_t v = 0;
        if (!number(&v)) return false;
        o->num[k] = v;
      }
    } while (eat(','));
    return eat('}');
  }
  const std::string& s_;
  size_t i_ = 0;
};

}  // namespace

int rows_bucket(int64_t rows, int E) {
  int64_t per = E > 0 ? rows / E : rows;
  int b = 0;
  while (per > 1) {
    per >>= 1;
    ++b;
  }
  return b;
}

std::string to_string(const TuneKey& k) {
  return std::string(kind_name(k.kind)) + " N=" + std::to_string(k.N) + " K=" + std::to_string(k.K) +
         " E=" + std::to_string(k.E) + " rows_bucket=" + std::to_string(k.rows_bucket) +
         " halves=" + std::to_string(k.halves) + " sm_count=" + std::to_string(k.sm_count) +
         " hbm_gbps=" + std::to_string(k.hbm_gbps);
}

TuneKey tune_key(const VarlenMArgs& a, const DeviceFacts& dev) {
  const bool two_tensor = a.halves || a.B2 != nullptr;  // dX~ with B2 has no halves flag, another kernel path
  return TuneKey{kind_of(a), a.N, a.K, a.num_experts, rows_bucket(a.rows, a.num_experts), two_tensor,
                 dev.sm_count, dev.hbm_gbps};
}

TuneKey tune_key(const VarlenKArgs& a_in, const DeviceFacts& dev) {
  const VarlenKArgs a = as_gather_p(a_in);
  return TuneKey{kind_of(a_in), a.N, a.M, a.num_experts, rows_bucket(a.rows, a.num_experts), false,
                 dev.sm_count, dev.hbm_gbps};
}

std::optional<EngineConfig> parse_config(const std::string& label) {
  // Exact inverse of to_string over every (kind, schedule, BN, cluster) it can spell.
  for (Kind k : kKinds)
    for (Sched s : kScheds)
      for (int bn : {128, 192, 256})
        for (int c : {1, 2}) {
          const EngineConfig cfg{k, s, bn, c};
          if (to_string(cfg) == label) return cfg;
        }
  return std::nullopt;
}

bool TuneCache::put(const TuneKey& k, const EngineConfig& c) {
  if (c.kind != k.kind || !is_built(c)) return false;
  map_[k] = c;
  return true;
}

std::optional<EngineConfig> TuneCache::get(const TuneKey& k) const {
  const auto it = map_.find(k);
  if (it == map_.end()) return std::nullopt;
  return it->second;
}

std::string TuneCache::to_json() const {
  std::string s = "{\"version\": " + std::to_string(kFileVersion) + ", \"entries\": [";
  bool first = true;
  for (const auto& [k, c] : map_) {
    s += first ? "\n" : ",\n";
    first = false;
    s += "  {\"kind\": \"" + std::string(kind_name(k.kind)) + "\", \"N\": " + std::to_string(k.N) + ", \"K\": " +
         std::to_string(k.K) + ", \"E\": " + std::to_string(k.E) + ", \"rows_bucket\": " +
         std::to_string(k.rows_bucket) + ", \"halves\": " + (k.halves ? "true" : "false") +
         ", \"sm_count\": " + std::to_string(k.sm_count) + ", \"hbm_gbps\": " + std::to_string(k.hbm_gbps) +
         ", \"config\": \"" + to_string(c) + "\"}";
  }
  for (const auto& [key, obj] : foreign_) {  // after ours, in their own sorted order
    s += first ? "\n" : ",\n";
    first = false;
    s += "  " + obj;
  }
  return s + (first ? "]}\n" : "\n]}\n");
}

namespace {

// One entry as to_json writes it (the canonical text that keeps and deduplicates foreign entries).
std::string entry_text(const Obj& o) {
  std::string s = "{\"kind\": \"" + o.str.at("kind") + "\"";
  for (const char* n : {"N", "K", "E", "rows_bucket"}) s += std::string(", \"") + n + "\": " + std::to_string(o.num.at(n));
  s += std::string(", \"halves\": ") + (o.num.at("halves") ? "true" : "false");
  s += ", \"sm_count\": " + std::to_string(o.num.at("sm_count"));
  if (o.num.count("hbm_gbps")) s += ", \"hbm_gbps\": " + std::to_string(o.num.at("hbm_gbps"));
  return s + ", \"config\": \"" + o.str.at("config") + "\"}";
}

bool fits_int(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

}  // namespace

bool TuneCache::merge_json(const std::string& json) {
  std::vector<Obj> objs;
  if (!Reader(json).document(&objs)) return false;
  std::map<TuneKey, EngineConfig> add;
  std::map<std::string, std::string> foreign;
  for (const Obj& o : objs) {
    const char* nums[] = {"N", "K", "E", "rows_bucket", "halves", "sm_count"};
    for (const char* n : nums)
      if (!o.num.count(n) || !fits_int(o.num.at(n))) return false;  // malformed: the whole text is
    if (!o.str.count("kind") || !o.str.count("config")) return false;
    if (o.str.count("hbm_gbps") || (o.num.count("hbm_gbps") && !fits_int(o.num.at("hbm_gbps")))) return false;
    const std::optional<Kind> kind = parse_kind(o.str.at("kind"));
    const std::optional<EngineConfig> c = parse_config(o.str.at("config"));
    // Another build's entry, or one from before the key had the device's bandwidth: kept, not used.
    if (!kind || !c || c->kind != *kind || !is_built(*c) || !o.num.count("hbm_gbps")) {
      const std::string text = entry_text(o);
      foreign[text] = text;
      continue;
    }
    TuneKey k{*kind,
              static_cast<int>(o.num.at("N")),
              static_cast<int>(o.num.at("K")),
              static_cast<int>(o.num.at("E")),
              static_cast<int>(o.num.at("rows_bucket")),
              o.num.at("halves") != 0,
              static_cast<int>(o.num.at("sm_count")),
              static_cast<int>(o.num.at("hbm_gbps"))};
    add[k] = *c;
  }
  for (const auto& [k, c] : add) map_[k] = c;
  for (const auto& [k, t] : foreign) foreign_[k] = t;
  return true;
}

std::string tune_cache_path(const char* (*lookup)(const char*)) {
  if (const char* p = lookup("SMOE_ENGINE_TUNE_CACHE"); p != nullptr && p[0] != '\0') return p;
  if (const char* x = lookup("XDG_CACHE_HOME"); x != nullptr && x[0] != '\0')
    return std::string(x) + "/smoe/engine_tune.json";
  if (const char* h = lookup("HOME"); h != nullptr && h[0] != '\0') return std::string(h) + "/.cache/smoe/engine_tune.json";
  return "";
}

}  // namespace engine
}  // namespace smoe
