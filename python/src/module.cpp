// kallpa._kallpa: the native half of the Python package (python/kallpa). Attention through the
// dispatcher on caller-owned arrays, the backend registry, and the engine; errors become the
// kallpa.Error subclasses of python/kallpa/_errors.py.
#include <nanobind/nanobind.h>

#include <exception>

#include "attention_binding.h"
#include "engine_binding.h"
#include "kallpa/status.h"
#include "status_error.h"

namespace nb = nanobind;

namespace {

// Raises the kallpa.Error subclass for a StatusError's code (kallpa._errors.from_status).
void translate(const std::exception_ptr& p, void* /*payload*/) {
  try {
    std::rethrow_exception(p);
  } catch (const kallpa::python::StatusError& e) {
    try {
      const kallpa::Status& s = e.status();
      nb::object value = e.value() ? nb::object(nb::str(e.value()->c_str())) : nb::none();
      nb::object error = nb::module_::import_("kallpa._errors")
                             .attr("from_status")(nb::str(kallpa::error_code_name(s.code()).data(),
                                                          kallpa::error_code_name(s.code()).size()),
                                                  nb::str(s.field().c_str()), nb::str(s.message().c_str()), value);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    } catch (nb::python_error& pe) {
      pe.restore();
    }
  }
}

}  // namespace

NB_MODULE(_kallpa, m) {
  m.doc() = "kallpa's native bindings; use the kallpa package, not this module.";
  nb::register_exception_translator(&translate);
  kallpa::python::bind_attention(m);
  kallpa::python::bind_engine(m);
}
