// The quarantine journal: one JSON object per line, appended whenever a registry quarantines a
// backend (health check, run-time failures, a sampled-row check, a crashed plugin, by hand) and
// when a journaled build passes the fuller check again ("cleared"). It is what keeps a restart
// from trusting a build that was caught serving wrong answers.
//
//   {"event":"quarantined","backend":"cpu-flash","identity":"cpu-flash@1.2","scope":"backend",
//    "source":"shadow_check","reason":"...","time":"2025-01-31T12:00:00Z"}
//
// Writing is best effort: a journal that cannot be written is a logged warning, never a failure
// of the call that quarantined. Reading skips a corrupt line with a warning naming the line.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kallpa/status.h"

namespace kallpa {

struct JournalRecord {
  std::string event;     // "quarantined" or "cleared"
  std::string backend;   // name
  std::string identity;  // AttentionBackend::identity()
  std::string scope;     // "backend" (entirely) or a size bucket ("keys<=2^13/decode/f32/dense/cpu")
  std::string source;    // health_check, run_failures, first_use_check, shadow_check, recheck, manual, ...
  std::string reason;
  std::string time;  // UTC, ISO 8601
};

class QuarantineJournal {
 public:
  explicit QuarantineJournal(std::string path) : path_(std::move(path)) {}

  // KALLPA_QUARANTINE_JOURNAL when set, else $XDG_STATE_HOME/kallpa/quarantine.jsonl, else
  // $HOME/.local/state/kallpa/quarantine.jsonl; empty when none of them is set.
  static std::string default_path();

  const std::string& path() const noexcept { return path_; }
  // Creates the file's directory when missing. An error says what could not be written.
  Status append(const JournalRecord& record) const;
  // Every well-formed record in order; a missing file is an empty journal.
  std::vector<JournalRecord> read() const;

 private:
  std::string path_;
  mutable std::mutex mu_;  // appends from several threads land as whole lines
};

// The quarantines still open after replaying `records`: by identity, the last "quarantined" record
// not followed by a "cleared" one for the same identity.
std::map<std::string, JournalRecord> open_quarantines(const std::vector<JournalRecord>& records);

// The current time as the journal writes it ("2025-01-31T12:00:00Z").
std::string journal_time_now();

}  // namespace kallpa
