// kallpa._kallpa's engine: _Model (a loaded model file) with tokenize, detokenize, the chat template
// and a generation call that reports text through a callback (python/kallpa/_engine.py turns that
// into a stream).
#pragma once

#include <nanobind/nanobind.h>

namespace kallpa::python {

void bind_engine(nanobind::module_& m);

}  // namespace kallpa::python
