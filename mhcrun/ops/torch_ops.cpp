// mhcrun's CPU kernel ops as C++ kernels of torch's dispatcher, for compiled graphs: `mhcrun::qgemv_native`,
// `mhcrun::qgemv_expert_set_native`, `mhcrun::hc_post_pre_native`, `mhcrun::attend_native`,
// `mhcrun::index_topk_native` and `mhcrun::compress_step_native` are the Python ops `mhcrun::qgemv`,
// `mhcrun::qgemv_expert_set` (mhcrun.ops.qlinear), `mhcrun::hc_post_pre_cpu` (mhcrun.nki.ops), `mhcrun::attend_cpu`
// (mhcrun.ops.attention), `mhcrun::index_topk_cpu` (mhcrun.ops.index) and `mhcrun::compress_step_cpu`
// (mhcrun.ops.compress) in C++, with their arguments (the shapes they give, their fake kernels: mhcrun.ops.qgemv). A
// graph that inductor compiles with its C++ wrapper calls them by their C shims (below) without entering Python.
//
// Each reads the run's kernel library (qgemv.cpp's build, its path an argument of the op, as the Python ops take it)
// through dlopen. They do the common case only: the kernel's one call on arguments of the shapes it reads. Anything
// else (a declined call: a thread that flushes subnormals; an index outside the expert set; x of another shape) is
// handed to the Python op, which gives the result or the error the Python path gives, so each rule lives there once.
//
// Built by mhcrun.ops.qgemv.load_torch_ops (mhcrun.ops.native.build with native.torch_flags: against the torch it
// runs with), loaded by torch.ops.load_library (its symbols global, for the wrappers to find the shims).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <tuple>
#include <vector>
#include <string>
#include <unordered_map>

namespace {

using QgemvFn = int (*)(int, const void*, const void*, int, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int, int);
using ExpertsFn = int (*)(int, const int64_t*, int64_t, const int64_t*, int, const float*, float*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int, int);

// The entry point `name` of the kernel library at `path`, looked up once per path and name (the library opened once
// per path and never closed: the process keeps it).
void* entry(const std::string& path, const char* name) {
    static std::mutex mu;
    static std::unordered_map<std::string, void*> libs, fns;
    std::lock_guard<std::mutex> hold(mu);
    const std::string key = path + '\n' + name;
    if (auto found = fns.find(key); found != fns.end()) return found->second;
    auto it = libs.find(path);
    if (it == libs.end()) {
        void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        TORCH_CHECK(lib != nullptr, "mhcrun: cannot open the kernel library ", path, ": ", dlerror());
        it = libs.emplace(path, lib).first;
    }
    void* fn = dlsym(it->second, name);
    TORCH_CHECK(fn != nullptr, "mhcrun: the kernel library ", path, " has no ", name);
    return fns.emplace(key, fn).first->second;
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
        kind = s.scalar_type() == at::kFloat ? 1 : 0;  // fp32 scales, else e8m0 bytes (mhcrun.ops.qweight.QWeight.operands)
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

using PostPreFn = int (*)(int, const void*, const void*, const float*, const float*, void*, const float*, const float*,
                         const float*, const float*, void*, float*, float*, int64_t, int64_t, int64_t, int64_t, float,
                         float, float*, int, int);
using AttendFn = int (*)(const float*, const float*, const uint8_t*, const float*, const uint8_t*, const float*, float*,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int);
using Four = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Whether every tensor of ts is a CPU tensor of `dtype`.
bool cpu_of(std::initializer_list<const at::Tensor*> ts, at::ScalarType dtype) {
    for (const at::Tensor* t : ts)
        if (!t->device().is_cpu() || t->scalar_type() != dtype) return false;
    return true;
}

Four python_post_pre(const at::Tensor& y, const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb,
                     const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base, const at::Tensor& weight,
                     int64_t iters, double eps, double norm_eps, c10::string_view library, int64_t isa) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mhcrun::hc_post_pre_cpu", "")
        .typed<Four(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, double, c10::string_view,
                    int64_t)>();
    return op.call(y, res, post, comb, fn, scale, base, weight, iters, eps, norm_eps, library, isa);
}

// mhcrun::hc_post_pre_cpu in one kernel call (mhc_hc_post_pre): y [..., d], res [..., n, d] (fp32 or bf16, the same),
// post [..., n], comb [..., n, n], fn [(2+n)*n, n*d], scale [3], base [(2+n)*n], weight [d] fp32 -> (the streams
// [..., n, d], h [..., d] in res's dtype, post [..., n], comb [..., n, n] fp32).
Four hc_post_pre_native(const at::Tensor& y, const at::Tensor& res, const at::Tensor& post, const at::Tensor& comb,
                        const at::Tensor& fn, const at::Tensor& scale, const at::Tensor& base, const at::Tensor& weight,
                        int64_t iters, double eps, double norm_eps, c10::string_view library, int64_t isa) {
    auto fallback = [&] { return python_post_pre(y, res, post, comb, fn, scale, base, weight, iters, eps, norm_eps,
                                                 library, isa); };
    const auto dt = res.scalar_type();
    if (res.dim() < 2 || (dt != at::kFloat && dt != at::kBFloat16) || !cpu_of({&y, &res}, dt)
            || !cpu_of({&post, &comb, &fn, &scale, &base, &weight}, at::kFloat))
        return fallback();
    const int64_t n = res.size(-2), d = res.size(-1), m = (2 + n) * n;
    std::vector<int64_t> lead(res.sizes().begin(), res.sizes().end() - 2), lead_d(lead), lead_n(lead), lead_nn(lead);
    lead_d.push_back(d), lead_n.push_back(n), lead_nn.push_back(n), lead_nn.push_back(n);
    if (y.sizes() != at::IntArrayRef(lead_d) || post.sizes() != at::IntArrayRef(lead_n)
            || comb.sizes() != at::IntArrayRef(lead_nn) || fn.dim() != 2 || fn.size(0) != m || fn.size(1) != n * d
            || scale.numel() != 3 || base.numel() != m || weight.numel() != d)
        return fallback();
    const at::Tensor yc = y.contiguous(), rc = res.contiguous(), pc = post.contiguous(), cc = comb.contiguous();
    const at::Tensor fc = fn.contiguous(), sc = scale.contiguous(), bc = base.contiguous(), wc = weight.contiguous();
    at::Tensor streams = at::empty_like(rc), h = at::empty(lead_d, res.options());
    at::Tensor post_out = at::empty(lead_n, post.options()), comb_out = at::empty(lead_nn, comb.options());
    auto call = reinterpret_cast<PostPreFn>(entry(std::string(library), "mhc_hc_post_pre"));
    if (call(dt == at::kBFloat16, yc.data_ptr(), rc.data_ptr(), pc.data_ptr<float>(), cc.data_ptr<float>(),
             streams.data_ptr(), fc.data_ptr<float>(), sc.data_ptr<float>(), bc.data_ptr<float>(), wc.data_ptr<float>(),
             h.data_ptr(), post_out.data_ptr<float>(), comb_out.data_ptr<float>(), rc.numel() / (n * d), n, d, iters,
             static_cast<float>(eps), static_cast<float>(norm_eps), nullptr, static_cast<int>(isa),
             at::get_num_threads()))
        return fallback();
    return {streams, h, post_out, comb_out};
}

at::Tensor python_attend(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& mask, const at::Tensor& sink,
                         double scale, const std::optional<at::Tensor>& sel, const std::optional<at::Tensor>& sel_mask,
                         c10::string_view library, int64_t isa) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mhcrun::attend_cpu", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                          const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, c10::string_view,
                          int64_t)>();
    return op.call(q, kv, mask, sink, scale, sel, sel_mask, library, isa);
}

// mhcrun::attend_cpu in one kernel call (mhc_attend): q [b, s, h, d] attending to kv [b, n, d] where mask [b, s, n],
// and to sel [b, s, k, d] where sel_mask [b, s, k], with the sinks [h] -> o [b, s, h, d] fp32.
at::Tensor attend_native(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& mask, const at::Tensor& sink,
                         double scale, const std::optional<at::Tensor>& sel, const std::optional<at::Tensor>& sel_mask,
                         c10::string_view library, int64_t isa) {
    auto fallback = [&] { return python_attend(q, kv, mask, sink, scale, sel, sel_mask, library, isa); };
    if (q.dim() != 4 || sel.has_value() != sel_mask.has_value() || !cpu_of({&q, &kv, &sink}, at::kFloat)
            || !cpu_of({&mask}, at::kBool))
        return fallback();
    const int64_t b = q.size(0), s = q.size(1), h = q.size(2), d = q.size(3), n = kv.dim() == 3 ? kv.size(1) : -1;
    const int64_t k = sel.has_value() ? sel->size(-2) : 0;
    if (kv.sizes() != at::IntArrayRef({b, n, d}) || mask.sizes() != at::IntArrayRef({b, s, n})
            || sink.sizes() != at::IntArrayRef({h}))
        return fallback();
    if (sel.has_value() && (!cpu_of({&*sel}, at::kFloat) || !cpu_of({&*sel_mask}, at::kBool)
                            || sel->sizes() != at::IntArrayRef({b, s, k, d})
                            || sel_mask->sizes() != at::IntArrayRef({b, s, k})))
        return fallback();
    const at::Tensor qc = q.contiguous(), kc = kv.contiguous(), mc = mask.contiguous(), snc = sink.contiguous();
    const at::Tensor selc = sel.has_value() ? sel->contiguous() : at::Tensor();
    const at::Tensor smc = sel.has_value() ? sel_mask->contiguous() : at::Tensor();
    at::Tensor o = at::empty_like(qc);
    auto call = reinterpret_cast<AttendFn>(entry(std::string(library), "mhc_attend"));
    if (call(qc.data_ptr<float>(), kc.data_ptr<float>(), reinterpret_cast<const uint8_t*>(mc.data_ptr<bool>()),
             k ? selc.data_ptr<float>() : nullptr, k ? reinterpret_cast<const uint8_t*>(smc.data_ptr<bool>()) : nullptr,
             snc.data_ptr<float>(), o.data_ptr<float>(), b, s, h, n, k, d, static_cast<float>(scale),
             static_cast<int>(std::min<int64_t>(isa, 2)), at::get_num_threads()))
        return fallback();
    return o;
}

using IndexTopkFn = int (*)(const float*, const float*, const uint8_t*, const float*, const int64_t*, const int64_t*,
                            int64_t*, uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int, int);
using Two = std::tuple<at::Tensor, at::Tensor>;

Two python_index_topk(const at::Tensor& q, const at::Tensor& w, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& rows, const at::Tensor& closed, int64_t n, int64_t topk, int64_t block,
                      c10::string_view library, int64_t isa) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mhcrun::index_topk_cpu", "")
        .typed<Two(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, int64_t, int64_t, int64_t, c10::string_view, int64_t)>();
    return op.call(q, w, packed, scale, rows, closed, n, topk, block, library, isa);
}

// mhcrun::index_topk_cpu in one kernel call (mhc_index_topk): q [b, s, h, d], w [b, s, h] fp32 against the first n
// entries of the fp4 key cache (packed [B, L, d / 2] uint8, scale [B, L, ceil(d / block)] fp32) at rows [b], entries
// j < closed [b, s] valid -> (entries int64, valid bool) [b, s, min(topk, n)].
Two index_topk_native(const at::Tensor& q, const at::Tensor& w, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& rows, const at::Tensor& closed, int64_t n, int64_t topk, int64_t block,
                      c10::string_view library, int64_t isa) {
    auto fallback = [&] { return python_index_topk(q, w, packed, scale, rows, closed, n, topk, block, library, isa); };
    if (q.dim() != 4 || packed.dim() != 3 || !cpu_of({&q, &w, &scale}, at::kFloat) || !cpu_of({&packed}, at::kByte)
            || !cpu_of({&rows, &closed}, at::kLong))
        return fallback();
    const int64_t b = q.size(0), s = q.size(1), h = q.size(2), d = q.size(3);
    if (b * s < 1 || n < 1 || n > packed.size(1) || topk < 1 || block < 1
            || w.sizes() != at::IntArrayRef({b, s, h}) || rows.sizes() != at::IntArrayRef({b})
            || closed.sizes() != at::IntArrayRef({b, s}) || packed.size(2) * 2 != d
            || scale.sizes() != at::IntArrayRef({packed.size(0), packed.size(1), (d + block - 1) / block}))
        return fallback();
    const at::Tensor qc = q.contiguous(), wc = w.contiguous(), pc = packed.contiguous(), sc = scale.contiguous();
    const at::Tensor rc = rows.contiguous(), cc = closed.contiguous();
    const int64_t kk = std::min(topk, n);
    at::Tensor entries = at::empty({b, s, kk}, rows.options());
    at::Tensor valid = at::empty({b, s, kk}, q.options().dtype(at::kBool));
    auto call = reinterpret_cast<IndexTopkFn>(entry(std::string(library), "mhc_index_topk"));
    if (call(qc.data_ptr<float>(), wc.data_ptr<float>(), pc.data_ptr<uint8_t>(), sc.data_ptr<float>(),
             rc.data_ptr<int64_t>(), cc.data_ptr<int64_t>(), entries.data_ptr<int64_t>(),
             reinterpret_cast<uint8_t*>(valid.data_ptr<bool>()), b, s, h, d, packed.size(0), packed.size(1), n, topk,
             block, static_cast<int>(std::min<int64_t>(isa, 2)), at::get_num_threads()))
        return fallback();
    return {entries, valid};
}

using CompressStepFn = int (*)(float*, float*, const int64_t*, const float*, const float*, const float*,
                              const int64_t*, float*, uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

Two python_compress_step(at::Tensor& kv_state, at::Tensor& score_state, const at::Tensor& rows, const at::Tensor& kv,
                         const at::Tensor& raw, const at::Tensor& ape, const at::Tensor& start, int64_t ratio,
                         bool overlap, c10::string_view library, int64_t isa) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mhcrun::compress_step_cpu", "")
        .typed<Two(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, int64_t, bool, c10::string_view, int64_t)>();
    return op.call(kv_state, score_state, rows, kv, raw, ape, start, ratio, overlap, library, isa);
}

// mhcrun::compress_step_cpu in one kernel call: a compressor's decode step, one token a row (kv, raw [b, 1, c] fp32,
// raw before its bias ape [ratio, c]) at positions start [b] >= 1 into the state rows rows [b] of kv_state,
// score_state [n_rows, lead + ratio, c] (written in place), by qgemv.cpp's mhc_compress_step -> (pooled [b, c / (overlap
// ? 2 : 1)], zeros where no group closed; closed [b] bool); the Python op where it declines (a start below 1 among them).
Two compress_step_native(at::Tensor& kv_state, at::Tensor& score_state, const at::Tensor& rows, const at::Tensor& kv,
                         const at::Tensor& raw, const at::Tensor& ape, const at::Tensor& start, int64_t ratio,
                         bool overlap, c10::string_view library, int64_t isa) {
    auto fallback = [&] {
        return python_compress_step(kv_state, score_state, rows, kv, raw, ape, start, ratio, overlap, library, isa);
    };
    if (kv.dim() != 3 || kv.size(1) != 1 || kv_state.dim() != 3 || ratio < 1
            || !cpu_of({&kv_state, &score_state, &kv, &raw, &ape}, at::kFloat) || !cpu_of({&rows, &start}, at::kLong)
            || !kv_state.is_contiguous() || !score_state.is_contiguous() || score_state.sizes() != kv_state.sizes())
        return fallback();
    const int64_t b = kv.size(0), c = kv.size(2), lead = overlap ? ratio : 0;
    if (b < 1 || raw.sizes() != kv.sizes() || kv_state.size(2) != c || ape.sizes() != at::IntArrayRef({ratio, c})
            || rows.sizes() != at::IntArrayRef({b}) || start.sizes() != at::IntArrayRef({b}))
        return fallback();
    const at::Tensor kc = kv.contiguous(), gc = raw.contiguous(), ac = ape.contiguous();
    const at::Tensor rowc = rows.contiguous(), sc = start.contiguous();
    at::Tensor pooled = at::empty({b, overlap ? c / 2 : c}, kv.options());
    at::Tensor closed = at::empty({b}, kv.options().dtype(at::kBool));
    const int status = reinterpret_cast<CompressStepFn>(entry(std::string(library), "mhc_compress_step"))(
        kv_state.data_ptr<float>(), score_state.data_ptr<float>(), rowc.data_ptr<int64_t>(), kc.data_ptr<float>(),
        gc.data_ptr<float>(), ac.data_ptr<float>(), sc.data_ptr<int64_t>(), pooled.data_ptr<float>(),
        reinterpret_cast<uint8_t*>(closed.data_ptr<bool>()), b, c, kv_state.size(0), kv_state.size(1), ratio, lead);
    if (status) return fallback();  // nothing was written
    return {pooled, closed};
}

}  // namespace

// The ops' C shims: a graph's C++ wrapper calls `aoti_torch_cpu_<op>` directly, with tensor handles, rather than the
// op through the dispatcher with a stack of IValues (inductor's `aot_inductor.custom_ops_to_c_shims`: each op's
// declaration follows from its schema, mhcrun.regions.shims). The wrappers then need neither the dispatcher's headers
// nor their code: each graph compiles in less time, and a call costs less. Inductor's calling convention: a Tensor a
// handle, a Tensor? a pointer to one (null: None), int int64_t, float double, bool int32_t, str a C string, each output
// a handle written through a pointer. An error is thrown, as through the dispatcher (the error code is never
// FAILURE): the graph's call raises the op's own error (a Python op's, where the kernel declined the call). Each
// call is recorded under the op's name, as the dispatcher records it, for torch's profiler (a check of a flag when
// none runs).
namespace shim {

at::Tensor& tensor(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }

std::optional<at::Tensor> optional(AtenTensorHandle* h) {
    return h ? std::optional<at::Tensor>(tensor(*h)) : std::nullopt;
}

AtenTensorHandle handle(at::Tensor t) { return torch::aot_inductor::new_tensor_handle(std::move(t)); }

}  // namespace shim

#define MHCRUN_SHIM extern "C" __attribute__((visibility("default"))) AOTITorchError

MHCRUN_SHIM aoti_torch_cpu_qgemv_native(AtenTensorHandle x3, AtenTensorHandle data, AtenTensorHandle* scale,
                                        int64_t block, int64_t groups, const char* library, int64_t isa,
                                        AtenTensorHandle* y) {
    RECORD_FUNCTION("mhcrun::qgemv_native", std::vector<c10::IValue>());
    *y = shim::handle(qgemv_native(shim::tensor(x3), shim::tensor(data), shim::optional(scale), block, groups,
                                   library, isa));
    return AOTI_TORCH_SUCCESS;
}

MHCRUN_SHIM aoti_torch_cpu_qgemv_expert_set_native(AtenTensorHandle x, AtenTensorHandle ptrs, AtenTensorHandle idx,
                                                   int64_t fmt, int64_t kind, int64_t block, int64_t out_features,
                                                   int64_t in_features, const char* library, int64_t isa,
                                                   AtenTensorHandle* y) {
    RECORD_FUNCTION("mhcrun::qgemv_expert_set_native", std::vector<c10::IValue>());
    *y = shim::handle(qgemv_expert_set_native(shim::tensor(x), shim::tensor(ptrs), shim::tensor(idx), fmt, kind,
                                              block, out_features, in_features, library, isa));
    return AOTI_TORCH_SUCCESS;
}

MHCRUN_SHIM aoti_torch_cpu_hc_post_pre_native(AtenTensorHandle y, AtenTensorHandle residual, AtenTensorHandle post,
                                              AtenTensorHandle comb, AtenTensorHandle fn, AtenTensorHandle scale,
                                              AtenTensorHandle base, AtenTensorHandle weight, int64_t iters,
                                              double eps, double norm_eps, const char* library, int64_t isa,
                                              AtenTensorHandle* streams, AtenTensorHandle* h,
                                              AtenTensorHandle* post_out, AtenTensorHandle* comb_out) {
    RECORD_FUNCTION("mhcrun::hc_post_pre_native", std::vector<c10::IValue>());
    auto [s, hh, p, c] = hc_post_pre_native(shim::tensor(y), shim::tensor(residual), shim::tensor(post),
                                            shim::tensor(comb), shim::tensor(fn), shim::tensor(scale),
                                            shim::tensor(base), shim::tensor(weight), iters, eps, norm_eps,
                                            library, isa);
    *streams = shim::handle(s);
    *h = shim::handle(hh);
    *post_out = shim::handle(p);
    *comb_out = shim::handle(c);
    return AOTI_TORCH_SUCCESS;
}

MHCRUN_SHIM aoti_torch_cpu_attend_native(AtenTensorHandle q, AtenTensorHandle kv, AtenTensorHandle mask,
                                         AtenTensorHandle sink, double scale, AtenTensorHandle* sel,
                                         AtenTensorHandle* sel_mask, const char* library, int64_t isa,
                                         AtenTensorHandle* o) {
    RECORD_FUNCTION("mhcrun::attend_native", std::vector<c10::IValue>());
    *o = shim::handle(attend_native(shim::tensor(q), shim::tensor(kv), shim::tensor(mask), shim::tensor(sink),
                                    scale, shim::optional(sel), shim::optional(sel_mask), library, isa));
    return AOTI_TORCH_SUCCESS;
}

MHCRUN_SHIM aoti_torch_cpu_index_topk_native(AtenTensorHandle q, AtenTensorHandle w, AtenTensorHandle packed,
                                             AtenTensorHandle scale, AtenTensorHandle rows, AtenTensorHandle closed,
                                             int64_t n, int64_t topk, int64_t block, const char* library, int64_t isa,
                                             AtenTensorHandle* entries, AtenTensorHandle* valid) {
    RECORD_FUNCTION("mhcrun::index_topk_native", std::vector<c10::IValue>());
    auto [e, v] = index_topk_native(shim::tensor(q), shim::tensor(w), shim::tensor(packed), shim::tensor(scale),
                                    shim::tensor(rows), shim::tensor(closed), n, topk, block, library, isa);
    *entries = shim::handle(e);
    *valid = shim::handle(v);
    return AOTI_TORCH_SUCCESS;
}

MHCRUN_SHIM aoti_torch_cpu_compress_step_native(AtenTensorHandle kv_state, AtenTensorHandle score_state,
                                                AtenTensorHandle rows, AtenTensorHandle kv, AtenTensorHandle raw,
                                                AtenTensorHandle ape, AtenTensorHandle start, int64_t ratio,
                                                int32_t overlap, const char* library, int64_t isa,
                                                AtenTensorHandle* pooled, AtenTensorHandle* closed) {
    RECORD_FUNCTION("mhcrun::compress_step_native", std::vector<c10::IValue>());
    auto [p, c] = compress_step_native(shim::tensor(kv_state), shim::tensor(score_state), shim::tensor(rows),
                                       shim::tensor(kv), shim::tensor(raw), shim::tensor(ape), shim::tensor(start),
                                       ratio, overlap != 0, library, isa);
    *pooled = shim::handle(p);
    *closed = shim::handle(c);
    return AOTI_TORCH_SUCCESS;
}

TORCH_LIBRARY_FRAGMENT(mhcrun, m) {
    m.def("qgemv_native(Tensor x3, Tensor data, Tensor? scale, int block, int groups, str library, int isa) -> Tensor");
    m.def("qgemv_expert_set_native(Tensor x, Tensor ptrs, Tensor idx, int fmt, int kind, int block, int out_features, "
          "int in_features, str library, int isa) -> Tensor");
    m.def("hc_post_pre_native(Tensor y, Tensor residual, Tensor post, Tensor comb, Tensor fn, Tensor scale, "
          "Tensor base, Tensor weight, int iters, float eps, float norm_eps, str library, int isa) -> "
          "(Tensor, Tensor, Tensor, Tensor)");
    m.def("attend_native(Tensor q, Tensor kv, Tensor mask, Tensor sink, float scale, Tensor? sel, Tensor? sel_mask, "
          "str library, int isa) -> Tensor");
    m.def("index_topk_native(Tensor q, Tensor w, Tensor packed, Tensor scale, Tensor rows, Tensor closed, int n, "
          "int topk, int block, str library, int isa) -> (Tensor, Tensor)");
    m.def("compress_step_native(Tensor(a!) kv_state, Tensor(b!) score_state, Tensor rows, Tensor kv, Tensor raw, "
          "Tensor ape, Tensor start, int ratio, bool overlap, str library, int isa) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mhcrun, CPU, m) {
    m.impl("qgemv_native", qgemv_native);
    m.impl("qgemv_expert_set_native", qgemv_expert_set_native);
    m.impl("hc_post_pre_native", hc_post_pre_native);
    m.impl("attend_native", attend_native);
    m.impl("index_topk_native", index_topk_native);
    m.impl("compress_step_native", compress_step_native);
}
