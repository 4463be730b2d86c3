// The quarantine journal (quarantine_journal.h): JSON lines through nlohmann-json.
#include "kallpa/quarantine_journal.h"

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

namespace kallpa {

std::string QuarantineJournal::default_path() {
  if (const char* p = std::getenv("KALLPA_QUARANTINE_JOURNAL"); p != nullptr && *p != '\0') return p;
  if (const char* x = std::getenv("XDG_STATE_HOME"); x != nullptr && *x != '\0') {
    return (std::filesystem::path(x) / "kallpa" / "quarantine.jsonl").string();
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return (std::filesystem::path(h) / ".local" / "state" / "kallpa" / "quarantine.jsonl").string();
  }
  return {};
}

std::string journal_time_now() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

Status QuarantineJournal::append(const JournalRecord& r) const {
  const nlohmann::json line = {{"event", r.event}, {"backend", r.backend}, {"identity", r.identity},
                               {"scope", r.scope}, {"source", r.source},   {"reason", r.reason},
                               {"time", r.time}};
  // Replacement keeps a reason with invalid UTF-8 (from a plugin) from making the line unwritable.
  const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard lock(mu_);
  std::error_code ec;
  const std::filesystem::path path(path_);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) return Status(ErrorCode::internal, path_, fmt::format("cannot create its directory: {}", ec.message()));
  std::ofstream out(path, std::ios::app | std::ios::binary);
  if (!out) return Status(ErrorCode::internal, path_, "cannot open the quarantine journal for appending");
  out << text;
  out.flush();
  if (!out) return Status(ErrorCode::internal, path_, "cannot write the quarantine journal");
  return {};
}

std::vector<JournalRecord> QuarantineJournal::read() const {
  std::vector<JournalRecord> records;
  std::lock_guard lock(mu_);
  std::ifstream in(path_, std::ios::binary);
  if (!in) return records;
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto text = [&](const char* key) -> const std::string* {
      if (!j.is_object()) return nullptr;
      auto it = j.find(key);
      return it != j.end() && it->is_string() ? it->get_ptr<const std::string*>() : nullptr;
    };
    const std::string* event = text("event");
    const std::string* identity = text("identity");
    if (event == nullptr || identity == nullptr || (*event != "quarantined" && *event != "cleared")) {
      spdlog::warn("kallpa: quarantine journal {} line {} is not a journal record; skipped", path_, number);
      continue;
    }
    JournalRecord r;
    r.event = *event;
    r.identity = *identity;
    for (auto [key, field] :
         {std::pair{"backend", &r.backend}, std::pair{"scope", &r.scope}, std::pair{"source", &r.source},
          std::pair{"reason", &r.reason}, std::pair{"time", &r.time}}) {
      if (const std::string* v = text(key)) *field = *v;
    }
    records.push_back(std::move(r));
  }
  return records;
}

std::map<std::string, JournalRecord> open_quarantines(const std::vector<JournalRecord>& records) {
  std::map<std::string, JournalRecord> open;
  for (const JournalRecord& r : records) {
    if (r.event == "cleared") {
      open.erase(r.identity);
    } else {
      open.insert_or_assign(r.identity, r);
    }
  }
  return open;
}

}  // namespace kallpa
