// Python's cyclic GC pauses, counted in native code (trainstream_hf/engine/gcstats.py).
//
// The counter is the callable that sits in gc.callbacks. CPython prints and drops any exception raised inside a gc
// callback, and a Python callback is where a pending SIGINT often turns into KeyboardInterrupt: a signal that
// arrives during a long collection is handled at the first bytecode that runs after it, which was the callback's,
// so Ctrl-C was lost. This one runs no bytecode: the arguments are taken as plain objects and read with the C API
// (no conversion that could call back into Python), so no signal handler can run inside it. The GIL, held by
// every caller (the collector and take()), guards the counts.
//
// For the same reason the counter can take itself out of gc.callbacks when its owner dies (remove_when_dead): a
// weakref callback that is a Python function (weakref.finalize) runs wherever the owner happens to be collected,
// in the middle of a training step, and would drop a Ctrl-C just the same.
#include <array>
#include <chrono>
#include <cstdint>
#include <optional>

#include <torch/csrc/utils/pybind.h>

#include "../include/trainstream.h"

namespace py = pybind11;

namespace trainstream {
namespace {

class GcPauses {
 public:
  // gc.callbacks calls it as callback(phase, info): phase "start" or "stop", info["generation"] in 0..2.
  void call(const py::object& phase, const py::object& info) {
    if (!PyUnicode_Check(phase.ptr()) || !PyDict_Check(info.ptr())) {
      throw py::type_error("GcPauses is a gc.callbacks entry: call it as callback(phase: str, info: dict)");
    }
    if (PyUnicode_CompareWithASCIIString(phase.ptr(), "start") == 0) {
      start_ = std::chrono::steady_clock::now();
      return;
    }
    if (!start_) return;  // started counting in the middle of a collection
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - *start_).count();
    start_.reset();
    PyObject* generation = PyDict_GetItemString(info.ptr(), "generation");  // borrowed; no exception set
    if (generation == nullptr || !PyLong_CheckExact(generation)) return;
    const long g = PyLong_AsLong(generation);
    if (g < 0 || g >= static_cast<long>(collections_.size())) {
      PyErr_Clear();  // an overflow sets one; an unknown generation is not counted
      return;
    }
    collections_[static_cast<size_t>(g)] += 1;
    seconds_ += seconds;
  }

  // (collections per generation, total seconds) since the last take; resets both.
  py::tuple take() {
    py::list collections;
    for (int64_t c : collections_) collections.append(c);
    py::tuple out = py::make_tuple(collections, seconds_);
    collections_.fill(0);
    seconds_ = 0.0;
    return out;
  }

  void watch(py::object ref) { watch_ = std::move(ref); }

 private:
  std::array<int64_t, 3> collections_{};
  double seconds_ = 0.0;
  std::optional<std::chrono::steady_clock::time_point> start_;
  py::object watch_;  // the weakref of remove_when_dead, kept so that its callback runs
};

// Drops every entry that is `item` itself (by identity: an == could run Python code) from the list `callbacks`.
void remove_identical(PyObject* callbacks, PyObject* item) {
  for (Py_ssize_t i = PyList_GET_SIZE(callbacks) - 1; i >= 0; --i) {
    if (PyList_GET_ITEM(callbacks, i) == item && PyList_SetSlice(callbacks, i, i + 1, nullptr) != 0) {
      PyErr_Clear();  // cannot fail for an index inside a list; never leave an error set in a weakref callback
    }
  }
}

// When `owner` dies, takes `self` out of `callbacks` (gc.callbacks) from native code. The native callback holds
// self and the list strongly: it lives as long as the weakref, which the counter keeps; the weakref drops the
// callback once it has run, so owner's death ends the cycle.
void remove_when_dead(py::object self, py::handle owner, py::list callbacks) {
  py::cpp_function callback([self, callbacks](py::handle) { remove_identical(callbacks.ptr(), self.ptr()); });
  PyObject* ref = PyWeakref_NewRef(owner.ptr(), callback.ptr());
  if (ref == nullptr) throw py::error_already_set();  // TypeError: cannot create weak reference to ...
  self.cast<GcPauses&>().watch(py::reinterpret_steal<py::object>(ref));
}

}  // namespace

void init_gc_pauses(py::module_& m) {
  py::class_<GcPauses>(m, "GcPauses",
                       "Counts Python's cyclic GC collections per generation and their total time; append the "
                       "object itself to gc.callbacks. Runs no Python code, so a Ctrl-C during a collection is "
                       "raised in the caller's code, not dropped inside the callback.")
      .def(py::init<>())
      .def("__call__", &GcPauses::call, py::arg("phase"), py::arg("info"))
      .def("take", &GcPauses::take,
           "([collections of generation 0, 1, 2], seconds) since the last take; resets them.")
      .def("remove_when_dead", &remove_when_dead, py::arg("owner"), py::arg("callbacks"),
           "When owner is garbage collected, removes this counter from callbacks (gc.callbacks), running no "
           "Python code.");
}

}  // namespace trainstream
