// What a region graph's C++ wrapper includes, precompiled as one header (`regions.runner.wrapper_header`). Torch
// precompiles only the first (cpp_wrapper/cpu.h); g++ then parsed the others for every graph, the dispatcher's and
// IValue's headers that its custom-op calls need above all: 5.5-8 s of each graph's compile, 3-5 s with them all
// precompiled (BENCHMARKS.md). Each is included again by the wrapper, a no-op after this. tests/test_regions.py
// checks that a wrapper includes nothing this leaves out.
#include <torch/csrc/inductor/cpp_wrapper/cpu.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/cpp_prefix.h>
#include <Python.h>
#include <sstream>
#include <cstdlib>
#include <cerrno>
