"""Speed of the quantised-weight decoders and GEMMs of mhcrun.ops.qlinear against the reference dequantisers.

    python benchmarks/bench_qgemm.py              # decoders + GEMV on CPU (about a minute)
    python benchmarks/bench_qgemm.py --chunks     # also sweep qlinear.CHUNK_BYTES
    python benchmarks/bench_qgemm.py --compiled   # also qlinear inside torch.compile (inductor)
    python benchmarks/bench_qgemm.py --cuda       # the CUDA paths (_scaled_mm and dequantise), on a GPU

Prints G elements/s of each decoder (reference: quant.dequantize_fp8 / dequantize_fp4 and the bare
`w.float()` cast), and for qlinear with x [1, in] (decode: the fused kernel, mhcrun/ops/qgemv.cpp) and
[37, in] (prefill) the effective GB/s of quantised weight bytes read, with the torch chunk decoders (the kernel
off, as with MHCRUN_CPU_KERNEL=0) beside it, and memcpy bandwidth (`b.copy_(a)` of 256 MB, bytes copied per second).
Each number is the best of several repeats: these machines are noisy.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mhcrun.errors import run_script
from mhcrun.ops import qlinear as ql
from mhcrun.ops.qgemv import KERNEL_OFF, CpuKernel, open_cpu_kernel
from mhcrun.ops.quant import dequantize_fp4, dequantize_fp8, fp8_simulate, quantize_weight_fp4, quantize_weight_fp8
from mhcrun.ops.qweight import QWeight
from mhcrun.settings import Env


def best_time(fn, repeats: int = 5, min_s: float = 0.2, sync=lambda: None) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(min_s / one))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def weights(out_f: int, in_f: int, fmt: str):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    if fmt == "fp8":
        return quantize_weight_fp8(w, 128)
    return quantize_weight_fp4(w, 32)


def memcpy_gbs() -> float:
    a = torch.ones(64 * 1024 * 1024)  # 256 MB
    b = torch.empty_like(a)
    return a.numel() * 4 / best_time(lambda: b.copy_(a), repeats=3) / 1e9


def bench_decoders(cpu: CpuKernel) -> None:
    print("decoders, G elements/s (weight 4096 x 4096 fp8 / 4096 x 4096 fp4)")
    q8, s8 = weights(4096, 4096, "fp8")
    q4, s4 = weights(4096, 4096, "fp4")
    n = 4096 * 4096
    out = torch.empty(4096, 4096)
    w8, w4 = QWeight(q8, s8, 128).checked(), QWeight(q4, s4, 32).checked()
    rows = [
        ("fp8 w.float()", lambda: q8.float()),
        ("fp8 reference dequantize_fp8", lambda: dequantize_fp8(q8, s8, 128)),
        ("fp8 fast decode_fp8", lambda: ql.decode(w8, out=out, cpu=cpu)),
        ("fp4 reference dequantize_fp4", lambda: dequantize_fp4(q4, s4, 32)),
        ("fp4 fast decode_fp4", lambda: ql.decode(w4, out=out, cpu=cpu)),
    ]
    for name, fn in rows:
        print(f"  {name:32s} {n / best_time(fn, repeats=3) / 1e9:7.2f}")
    # in-cache rate of the chunk kernels alone (one chunk, decoded over and over)
    r = ql._chunk_rows(4096, 4096, 128)
    d8 = ql._RowDecoder(w8, r, cpu)
    d4 = ql._RowDecoder(w4, r, cpu)
    buf = torch.empty(r, 4096)
    for name, dec in (("fp8 chunk kernel (in cache)", d8), ("fp4 chunk kernel (in cache)", d4)):
        print(f"  {name:32s} {r * 4096 / best_time(lambda d=dec: d.rows(0, r, buf)) / 1e9:7.2f}")


def dequantize_ref(q, s, fmt):
    return dequantize_fp8(q, s, 128) if fmt == "fp8" else dequantize_fp4(q, s, 32)


def gemm_case(fmt: str, out_f: int, in_f: int, m: int, cpu: CpuKernel) -> None:
    q, s = weights(out_f, in_f, fmt)
    qbytes = q.numel() * q.element_size()
    ref_w = dequantize_ref(q, s, fmt)
    block = 128 if fmt == "fp8" else 32
    x = torch.randn(m, in_f)
    w = QWeight(q, s, block).checked()
    t_q = best_time(lambda: ql.qlinear(x, w, cpu=cpu))
    t_a = best_time(lambda: ql.qlinear(x, w, True, cpu=cpu))
    t_t = best_time(lambda: ql.qlinear(x, w, cpu=KERNEL_OFF))
    t_f = best_time(lambda: F.linear(x, ref_w))
    t_r = best_time(lambda: F.linear(x, dequantize_ref(q, s, fmt)), repeats=2)
    print(f"  {fmt} [{out_f} x {in_f}] x [{m}, {in_f}]: qlinear {t_q * 1e3:7.2f} ms "
          f"= {qbytes / t_q / 1e9:6.2f} GB/s of quantised weight (act_quant {t_a * 1e3:.2f} ms; torch decoders "
          f"{t_t * 1e3:.2f} ms = {qbytes / t_t / 1e9:.2f} GB/s); "
          f"reference dequantise + F.linear {t_r * 1e3:7.1f} ms; F.linear on a ready fp32 weight "
          f"{t_f * 1e3:.2f} ms = {ref_w.numel() * 4 / t_f / 1e9:.1f} GB/s of fp32")


def bench_gemv(chunk_sweep: bool, cpu: CpuKernel) -> None:
    bw = memcpy_gbs()
    print(f"memcpy b.copy_(a) 256 MB: {bw:.1f} GB/s (bytes copied per second)")
    cases = [("fp8", 4096, 4096), ("fp4", 2048, 4096)]
    for fmt, out_f, in_f in cases:
        for m in (1, 37):
            gemm_case(fmt, out_f, in_f, m, cpu)
    head = torch.randn(8192, 4096).to(torch.bfloat16)
    x = torch.randn(1, 4096)
    wh = QWeight(head).checked()
    t = best_time(lambda: ql.qlinear(x, wh, cpu=cpu))
    t_c = best_time(lambda: ql.qlinear(x, wh, cpu=KERNEL_OFF))
    t_f = best_time(lambda: F.linear(x, head.float()))
    print(f"  bf16 [8192 x 4096] x fp32 [1, 4096]: qlinear {t * 1e3:.2f} ms = {head.numel() * 2 / t / 1e9:.2f} "
          f"GB/s of bf16; chunked {t_c * 1e3:.2f} ms; F.linear(x, w.float()) {t_f * 1e3:.2f} ms")
    if chunk_sweep:
        print("CHUNK_BYTES sweep (GEMV x [1, in], torch decoders): GB/s of quantised weight")
        saved = ql.CHUNK_BYTES
        for cb in (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23):
            ql.CHUNK_BYTES = cb
            res = []
            for fmt, out_f, in_f in cases:
                q, s = weights(out_f, in_f, fmt)
                x = torch.randn(1, in_f)
                w = QWeight(q, s, 128 if fmt == "fp8" else 32).checked()
                t = best_time(lambda x=x, w=w: ql.qlinear(x, w, cpu=KERNEL_OFF))
                res.append(f"{fmt} {q.numel() * q.element_size() / t / 1e9:6.2f}")
            print(f"  {cb >> 10:5d} KiB: " + ", ".join(res))
        ql.CHUNK_BYTES = saved


def cuda_variants() -> None:
    """Which spellings of the DeepSeek-recipe FP8 GEMM this torch / GPU accepts (M = 37 and M = 1)."""
    dev = torch.device("cuda")
    q, s = weights(512, 1024, "fp8")
    q, s = q.to(dev), s.to(dev)
    w = dequantize_fp8(q, s, 128)
    for m in (37, 1):
        cuda_variants_m(m, q, s, w)


def cuda_variants_m(m: int, q: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> None:
    st = getattr(F, "ScalingType", None)
    x = torch.randn(m, 1024, device=q.device)
    xq = fp8_simulate(x, 128)
    ref = F.linear(xq, w)
    norm = xq.abs() @ w.abs().T
    a, sa, b, sb = ql._scaled_mm_operands(x, q, s)
    codes, sx = ql.act_quant_fp8_codes(x)
    sa_raw = sx.t().contiguous().t()
    variants = {
        "F.scaled_mm out fp32": lambda: F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128,
                                                    output_dtype=torch.float32),
        "F.scaled_mm out bf16": lambda: F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128,
                                                    output_dtype=torch.bfloat16),
        "torch._scaled_mm out fp32": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32),
        "F.scaled_mm M unpadded": lambda: F.scaled_mm(codes, b, sa_raw, st.BlockWise1x128, sb,
                                                      st.BlockWise128x128, output_dtype=torch.float32),
    }
    for name, fn in variants.items():
        try:
            y = fn()[:m].float()
            torch.cuda.synchronize()
            err = ((y - ref).abs() / (norm + 1e-30)).max().item()
            print(f"  M={m} {name}: ok, max |y - ref| / (|xq| @ |w|^T) = {err:.2e}")
        except Exception as e:  # report and go on
            print(f"  M={m} {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def bench_cuda() -> None:
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda,
          "capability", torch.cuda.get_device_capability())
    cuda_variants()
    for out_f, in_f in ((4096, 4096), (7168, 2048), (24576, 7168)):
        q, s = weights(out_f, in_f, "fp8")
        q, s = q.to(dev), s.to(dev)
        w = dequantize_fp8(q, s, 128)
        for m in (1, 37, 4096):
            x = torch.randn(m, in_f, device=dev)
            ref = F.linear(fp8_simulate(x, 128), w)
            wq = QWeight(q, s, 128).checked()
            y = ql._scaled_mm_fp8(x, wq, ql.ScaledMM())
            if y is None:
                print(f"  [{out_f} x {in_f}] M={m}: _scaled_mm path not taken")
                continue
            err = ((y - ref).abs() / (fp8_simulate(x, 128).abs() @ w.abs().T + 1e-30)).max().item()
            t_s = best_time(lambda x=x, wq=wq: ql._scaled_mm_fp8(x, wq, ql.ScaledMM()), sync=sync)
            t_q = best_time(lambda x=x, q=q, s=s: F.linear(fp8_simulate(x, 128), dequantize_fp8(q, s, 128)),
                            sync=sync)
            t_d = best_time(lambda x=x, w=w: F.linear(fp8_simulate(x, 128), w), sync=sync)
            print(f"  [{out_f} x {in_f}] M={m}: scaled_mm {t_s * 1e6:8.1f} us; dequantise + fp32 F.linear "
                  f"{t_q * 1e6:8.1f} us; F.linear on a ready fp32 weight {t_d * 1e6:8.1f} us; "
                  f"max |y - ref| / (|xq| @ |w|^T) = {err:.2e}")


def bench_compiled(cpu: CpuKernel) -> None:
    """qlinear inside torch.compile (inductor): the fused decode GEMV (x [1, in]) vs whole-tensor dequantisation
    (x [16, in], above FUSED_MAX_ROWS), against eager."""
    print("torch.compile(qlinear) with inductor, x [1, in]; e8m0 scales passed as uint8 bytes")
    for fmt, out_f, in_f in (("fp8", 4096, 4096), ("fp4", 2048, 4096)):
        compiled_case(fmt, out_f, in_f, cpu)


def compiled_case(fmt: str, out_f: int, in_f: int, cpu: CpuKernel) -> None:
    q, s = weights(out_f, in_f, fmt)
    s = s.view(torch.uint8)  # inductor cannot take float8_e8m0fnu graph inputs
    block = 128 if fmt == "fp8" else 32
    x = torch.randn(1, in_f)
    w = QWeight(q, s, block).checked()
    res = [f"eager {best_time(lambda: ql.qlinear(x, w, cpu=cpu)) * 1e3:.2f} ms"]
    for name, xs in (("fused GEMV", x), ("whole dequantise (16 rows)", torch.randn(16, in_f))):
        torch._dynamo.reset()
        f = torch.compile(lambda x, d, s: ql.qlinear(x, QWeight(d, s, w.block, w.kernel), cpu=cpu), fullgraph=True)
        t0 = time.perf_counter()
        f(xs, q, s)
        t_c = time.perf_counter() - t0
        res.append(f"compiled {name} {best_time(lambda f=f, xs=xs: f(xs, q, s)) * 1e3:.2f} ms "
                   f"(compile {t_c:.1f} s)")
    print(f"  {fmt} [{out_f} x {in_f}]: " + "; ".join(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", action="store_true", help="sweep CHUNK_BYTES")
    ap.add_argument("--cuda", action="store_true", help="the CUDA paths only")
    ap.add_argument("--compiled", action="store_true", help="also qlinear under torch.compile (inductor)")
    args = ap.parse_args()
    if args.cuda:
        bench_cuda()
        return
    cpu = open_cpu_kernel(Env.read())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CHUNK_BYTES {ql.CHUNK_BYTES}, "
          f"CPU kernel {cpu.status()}")
    bench_decoders(cpu)
    bench_gemv(args.chunks, cpu)
    if args.compiled:
        bench_compiled(cpu)


if __name__ == "__main__":
    run_script(main)
