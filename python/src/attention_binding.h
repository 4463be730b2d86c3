// kallpa._kallpa's attention functions: _attention, _explain, _backends (wrapped by
// python/kallpa/_attention.py, which allocates outputs and normalises index arrays).
#pragma once

#include <nanobind/nanobind.h>

namespace kallpa::python {

void bind_attention(nanobind::module_& m);

}  // namespace kallpa::python
