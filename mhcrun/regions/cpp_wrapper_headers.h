// What a region graph's C++ wrapper includes, precompiled as one header (`regions.runner.wrapper_header`). Torch
// precompiles only the first (cpp_wrapper/cpu.h); g++ then parsed the others for every graph, the kernels'
// cpp_prefix.h above all. The wrapper calls the kernel's ops by their C shims (`regions.shims`), not through the
// dispatcher, so neither the dispatcher's nor IValue's headers are here. Each is included again by the wrapper, a
// no-op after this. tests/test_regions.py checks that a wrapper includes nothing this leaves out.
#include <torch/csrc/inductor/cpp_wrapper/cpu.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/cpp_prefix.h>
#include <Python.h>
#include <sstream>
#include <cstdlib>
#include <cerrno>
