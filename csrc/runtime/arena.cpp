// PLACEHOLDER (being written): host arena.
#include "../include/trainstream.h"
namespace trainstream { void init_arena(pybind11::module_& m) {} }
