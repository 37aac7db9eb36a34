// mhcrun's CPU GEMV ops as C++ kernels of torch's dispatcher, for compiled graphs: `mhcrun::qgemv_native` and
// `mhcrun::qgemv_expert_set_native` are the Python ops `mhcrun::qgemv` and `mhcrun::qgemv_expert_set`
// (mhcrun.ops.qlinear) in C++, with their arguments (the shapes they give, their fake kernels: mhcrun.ops.qgemv). A
// graph that inductor compiles with its C++ wrapper calls them without entering Python.
//
// Each reads the run's kernel library (qgemv.cpp's build, its path an argument of the op, as the Python ops take it)
// through dlopen. They do the common case only: the kernel's one call on arguments of the shapes it reads. Anything
// else (a declined call: a thread that flushes subnormals; an index outside the expert set; x of another shape) is
// handed to the Python op, which gives the result or the error the Python path gives, so each rule lives there once.
//
// Built by mhcrun.ops.qgemv.load_torch_ops (mhcrun.ops.native.build with native.torch_flags: against the torch it
// runs with), loaded by torch.ops.load_library.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <mutex>
#include <string>
#include <unordered_map>

namespace {

using QgemvFn = int (*)(int, const void*, const void*, int, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int, int);
using ExpertsFn = int (*)(int, const int64_t*, int64_t, const int64_t*, int, const float*, float*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int, int);

// The entry point `name` of the kernel library at `path`, opened once per path (never closed: the process keeps it).
void* entry(const std::string& path, const char* name) {
    static std::mutex mu;
    static std::unordered_map<std::string, void*> libs;
    std::lock_guard<std::mutex> hold(mu);
    auto it = libs.find(path);
    if (it == libs.end()) {
        void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        TORCH_CHECK(lib != nullptr, "mhcrun: cannot open the kernel library ", path, ": ", dlerror());
        it = libs.emplace(path, lib).first;
    }
    void* fn = dlsym(it->second, name);
    TORCH_CHECK(fn != nullptr, "mhcrun: the kernel library ", path, " has no ", name);
    return fn;
}

// qgemv.cpp's FORMATS (mhcrun.ops.qgemv.FORMATS): fp8 0, fp4 1 (packed bytes), float 2 (bf16); -1 for another dtype.
int format_of(const at::Tensor& data) {
    switch (data.scalar_type()) {
        case at::kFloat8_e4m3fn: return 0;
        case at::kByte: case at::kChar: return 1;
        case at::kBFloat16: return 2;
        default: return -1;
    }
}

// The Python op `name` (the reference this kernel stands for), called through the dispatcher.
at::Tensor python_qgemv(const at::Tensor& x3, const at::Tensor& data, const std::optional<at::Tensor>& scale,
                        int64_t block, int64_t groups, c10::string_view library, int64_t isa) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mhcrun::qgemv", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t,
                          c10::string_view, int64_t)>();
    return op.call(x3, data, scale, block, groups, library, isa);
}

// mhcrun::qgemv in one kernel call: x3 [M, G, in] (fp32) times the weight (data, scale, block), its rows in G groups
// -> [M, G, r] fp32 contiguous.
at::Tensor qgemv_native(const at::Tensor& x3, const at::Tensor& data, const std::optional<at::Tensor>& scale,
                        int64_t block, int64_t groups, c10::string_view library, int64_t isa) {
    const int fmt = format_of(data);
    if (fmt < 0 || x3.dim() != 3 || data.dim() != 2 || x3.size(1) != groups || groups <= 0
            || data.size(0) % groups != 0 || (scale.has_value() != (fmt != 2)))
        return python_qgemv(x3, data, scale, block, groups, library, isa);
    const int64_t m = x3.size(0), n = data.size(0), k = x3.size(2);
    const at::Tensor x = x3.to(at::kFloat).contiguous(), w = data.contiguous();
    at::Tensor s;
    int kind = 0;
    if (scale.has_value()) {
        s = scale->contiguous();
        kind = s.scalar_type() == at::kFloat ? 1 : 0;  // fp32 scales, else e8m0 bytes (mhcrun.ops.qgemv._scale_arg)
    }
    at::Tensor y = at::empty({m, n}, x3.options().dtype(at::kFloat));
    auto fn = reinterpret_cast<QgemvFn>(entry(std::string(library), "mhc_qgemv"));
    if (fn(fmt, w.data_ptr(), s.defined() ? s.data_ptr() : nullptr, kind, x.data_ptr<float>(), y.data_ptr<float>(),
           m, n, k, block, groups, static_cast<int>(isa), at::get_num_threads()))
        return python_qgemv(x3, data, scale, block, groups, library, isa);
    return y.view({m, groups, n / groups});
}

at::Tensor python_expert_set(const at::Tensor& x, const at::Tensor& ptrs, const at::Tensor& idx, int64_t fmt,
                             int64_t kind, int64_t block, int64_t out_features, int64_t in_features,
                             c10::string_view library, int64_t isa) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mhcrun::qgemv_expert_set", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t,
                          int64_t, c10::string_view, int64_t)>();
    return op.call(x, ptrs, idx, fmt, kind, block, out_features, in_features, library, isa);
}

// mhcrun::qgemv_expert_set in one kernel call: x [B, k or 1, in] through expert idx[b, j] of the set (ptrs [E, 2]:
// each expert's bytes and scales) -> [B, k, out] fp32.
at::Tensor qgemv_expert_set_native(const at::Tensor& x, const at::Tensor& ptrs, const at::Tensor& idx, int64_t fmt,
                                   int64_t kind, int64_t block, int64_t out_features, int64_t in_features,
                                   c10::string_view library, int64_t isa) {
    if (idx.dim() != 2 || x.dim() != 3 || ptrs.dim() != 2 || ptrs.size(1) != 2 || x.size(0) != idx.size(0)
            || (x.size(1) != 1 && x.size(1) != idx.size(1)) || x.size(2) != in_features)
        return python_expert_set(x, ptrs, idx, fmt, kind, block, out_features, in_features, library, isa);
    const int64_t b = idx.size(0), kk = idx.size(1);
    const at::Tensor xf = x.to(at::kFloat).contiguous(), ids = idx.to(at::kLong).contiguous();
    const at::Tensor table = ptrs.to(at::kLong).contiguous();
    at::Tensor y = at::empty({b, kk, out_features}, x.options().dtype(at::kFloat));
    auto fn = reinterpret_cast<ExpertsFn>(entry(std::string(library), "mhc_qgemv_experts"));
    if (fn(static_cast<int>(fmt), table.data_ptr<int64_t>(), table.size(0), ids.data_ptr<int64_t>(),
           static_cast<int>(kind), xf.data_ptr<float>(), y.data_ptr<float>(), b, kk, xf.size(1), out_features,
           in_features, block, static_cast<int>(isa), at::get_num_threads()))
        return python_expert_set(x, ptrs, idx, fmt, kind, block, out_features, in_features, library, isa);
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mhcrun, m) {
    m.def("qgemv_native(Tensor x3, Tensor data, Tensor? scale, int block, int groups, str library, int isa) -> Tensor");
    m.def("qgemv_expert_set_native(Tensor x, Tensor ptrs, Tensor idx, int fmt, int kind, int block, int out_features, "
          "int in_features, str library, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(mhcrun, CPU, m) {
    m.impl("qgemv_native", qgemv_native);
    m.impl("qgemv_expert_set_native", qgemv_expert_set_native);
}
