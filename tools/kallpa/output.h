// Text output helpers for the CLI: aligned tables and human-readable numbers.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "kallpa/status.h"

namespace kallpa::cli {

// A plain-text table. Columns are padded to their widest cell; the last column is never padded,
// so a long free-text column (a reason) can go last without widening the table.
class Table {
 public:
  enum class Align { left, right };
  struct Column {
    std::string header;
    Align align = Align::left;
  };

  explicit Table(std::vector<Column> columns) : columns_(std::move(columns)) {}
  void add_row(std::vector<std::string> cells);
  void print(std::FILE* out) const;

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// "812 ns", "12.3 us", "4.56 ms", "1.23 s".
std::string format_duration(double seconds);
// Compact scientific notation for errors: "0", "3.1e-07", "nan", "inf".
std::string format_error(double value);
// "1.23" / "123" GFLOP/s style number with three significant figures.
std::string format_rate(double value);

// "kallpa: <context>: <code>: <field>: <message>" on stderr.
void print_error(std::string_view context, const Status& status);

}  // namespace kallpa::cli
