#include "output.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace kallpa::cli {

void Table::add_row(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  rows_.push_back(std::move(cells));
}

void Table::print(std::FILE* out) const {
  std::vector<std::size_t> width(columns_.size());
  for (std::size_t c = 0; c < columns_.size(); ++c) {
    width[c] = columns_[c].header.size();
    for (const auto& row : rows_) width[c] = std::max(width[c], row[c].size());
  }
  auto print_row = [&](auto cell_of) {
    std::string line;
    for (std::size_t c = 0; c < columns_.size(); ++c) {
      const std::string& cell = cell_of(c);
      const bool last = c + 1 == columns_.size();
      if (c > 0) line += "  ";
      if (last && columns_[c].align == Align::left) {
        line += cell;
      } else if (columns_[c].align == Align::right) {
        line += fmt::format("{:>{}}", cell, width[c]);
      } else {
        line += fmt::format("{:<{}}", cell, width[c]);
      }
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    fmt::print(out, "{}\n", line);
  };
  print_row([&](std::size_t c) -> const std::string& { return columns_[c].header; });
  for (const auto& row : rows_) {
    print_row([&](std::size_t c) -> const std::string& { return row[c]; });
  }
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds)) return "-";
  if (seconds < 1e-6) return fmt::format("{:.0f} ns", seconds * 1e9);
  if (seconds < 1e-3) return fmt::format("{:.3g} us", seconds * 1e6);
  if (seconds < 1.0) return fmt::format("{:.3g} ms", seconds * 1e3);
  return fmt::format("{:.3g} s", seconds);
}

std::string format_error(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return "inf";
  if (value == 0.0) return "0";
  return fmt::format("{:.2g}", value);
}

std::string format_rate(double value) {
  if (!std::isfinite(value)) return "-";
  if (value >= 100.0) return fmt::format("{:.0f}", value);
  return fmt::format("{:.3g}", value);
}

void print_error(std::string_view context, const Status& status) {
  if (context.empty()) {
    fmt::print(stderr, "kallpa: {}\n", status.to_string());
  } else {
    fmt::print(stderr, "kallpa: {}: {}\n", context, status.to_string());
  }
}

}  // namespace kallpa::cli
