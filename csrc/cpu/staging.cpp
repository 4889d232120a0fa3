// PLACEHOLDER (being written): staging pool.
#include "../include/trainstream.h"
namespace trainstream { void init_staging(pybind11::module_& m) {} }
