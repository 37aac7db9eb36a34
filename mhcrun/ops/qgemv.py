"""The CPU decode GEMV over weights kept quantised: `qgemv.cpp`, built on first use and called through ctypes.

Decoding quantised weights with torch ops takes several passes over every chunk (`qlinear`'s chunk
decoders), which leaves a decode step bound by arithmetic instead of memory. This kernel reads each weight
byte once, decodes it in registers (AVX-512, or AVX2) and multiplies it into up to four rows of x at a time, on
torch's OpenMP threads. It covers FP8 e4m3 with tile scales, packed FP4 e2m1 with group scales and bf16
weights, for a few rows of x (decode); `qlinear` keeps its torch path as the reference and for everything
else (prefill, other CPUs, a weight whose scales could overflow: `QWeight.kernel`, decided at load).

A run opens the kernel once, `open_cpu_kernel(env)`, and passes the `CpuKernel` down (`RunOptions.cpu`): it is
built by `mhcrun.ops.native` with the run's compiler into its kernel cache, and runs AVX-512 where the CPU has
it, else AVX2 (MHCRUN_CPU_KERNEL=avx2 in the run's `Env` picks AVX2 on an AVX-512 CPU, to compare or test both).
Without a compiler, on a CPU with neither, or with MHCRUN_CPU_KERNEL=0, the kernel is off (`CpuKernel.on` is
False, its methods decline and the callers take torch's path); `status()` says why. Where no run opened one
(a model built without a runner) the kernel is `KERNEL_OFF`.

With AVX-512 BF16 (isa avx512bf16) the rows multiply FP8/FP4 weights decoded to bf16 by BF16 dot products where x
is exact in bf16 (`takes_bf16`); with it and with AVX2, FP4 weights by 16-bit integer dot products first where x
is FP8-rounded (`takes_int`).

It also multiplies a prefill chunk's rows by FP8/FP4 weights (`qgemm`): bf16 panels of 32 output rows, each
decoded once, by AMX tiles where the CPU has them (Intel's Sapphire Rapids and later), else by the BF16 dot
products of avx512bf16; and, with AVX2, a prefill chunk's routed FP4 experts (`moe_routed`, a slice of the chunk a
call): int16 panels of 16 weight rows decoded once, four rows of x at a time (qgemv.cpp's `run_panels`).

The same library runs the mHC steps of eager decode rows (`hc_post`, `hc_post_pre`, `hc_head`: one call each instead
of ~200 small torch ops a site; `mhcrun.nki.ops` dispatches to them as backend "cpu"), and eager decode's
other small steps, each in one call (`mhcrun.model.eager_first` picks them outside graphs): attention (`attend`:
sparse_attn's ~20 ops and four small GEMMs; `attend_decode`: a decode step's whole attention, reading the FP8 ring
and compressed entries where they lie), the indexer's scores and top-k (`index_topk`), RMSNorm (`rms_norm`), RoPE
(`rope_tail`), a compressor's step that closes no group (`open_group`) and one that closes one (`close_group`), the
encoding and decoding of kv cache entries (`kv_fp8_encode`, `kv_fp8`, `kv_fp4`), the indexer queries' FP4 rounding
(`fp4_simulate`), the indexer keys' encoding (`kv_fp4_encode`) and the window mask (`window_mask`); a Linear's
activation rounding and GEMV together (`linear`), the gate (`route`), and a step's routed experts and its shared
expert (`moe_routed`). Of these, the bitwise ones a prefill's rows take too, over the run's threads (`hc_post`,
`rope_tail`, `fp4_simulate`).

Routed experts that compiled graphs read in place are an `ExpertSet`: the addresses of each expert's bytes and
scales as one int64 tensor (a graph input like any module tensor) and the layout they share.
"""

from __future__ import annotations

import ctypes
import functools
import math
import subprocess
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mhcrun.ops import native
from mhcrun.ops.qweight import FORMATS as WEIGHT_FORMATS
from mhcrun.ops.qweight import QWeight
from mhcrun.settings import CPU_KERNEL_CAPS, Env

SOURCE = Path(__file__).with_name("qgemv.cpp")
TORCH_OPS = Path(__file__).with_name("torch_ops.cpp")
RC_EXPERT = 8  # qgemv.cpp: a routed expert index outside its set
MAX_ROWS = 16  # rows of x (tokens x batch) up to which the kernel beats dequantise-then-matmul
HEAD_ROWS = 128  # rows a token may bring to a per-head step (its heads: V4's 128 at most)
ROUTED_CALL_BYTES = 128 << 20  # a routed call's transients where its panels take a prefill's many routes
FORMATS = {name: i for i, name in enumerate(WEIGHT_FORMATS)}  # the C++ codes (`QWeight.operands`); float: bf16 only
SCORE_FUNCS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}  # the router's score functions (qgemv.cpp's mhc_route)
# qgemv.cpp's instruction sets; MHCRUN_CPU_KERNEL=<name> caps them there. avx512bf16: AVX-512 that multiplies FP8/FP4
# weights by BF16 dot products where x is exact in bf16 (after the FP8 activation rounding), else as avx512
ISAS = {"avx512bf16": 3, "avx512": 2, "avx2": 1}
# what multiplies a prefill chunk by FP8/FP4 weights (`qgemm`): AMX tiles, or the BF16 dot products of avx512bf16
GEMMS = {"amx": 4, "avx512bf16": 3}
CAPS = {name: {**ISAS, "amx": GEMMS["amx"]}[name] for name in CPU_KERNEL_CAPS}  # MHCRUN_CPU_KERNEL's caps
# rows of x from which each engine's panels (`qgemm`) beat the GEMV rows (BENCHMARKS.md, issue 20): AMX from 8; the BF16
# dot products from 16, where a dense weight's GEMV rows stop (MAX_ROWS; below it a GEMV job of many rows takes the
# same panels itself, qgemv.cpp's JOB_ROWS_*), so that a long prefill chunk's routed experts go expert by expert
# through them (a Zen 4 VM: an FP4 [1,024 x 2,048] weight 108-125 G multiply-adds/s by the panels at 16 rows against
# 50 by the GEMV rows, 178-205 from 64 rows)
GEMM_ROWS = {GEMMS["amx"]: 8, GEMMS["avx512bf16"]: 16}


@dataclass(frozen=True)
class CpuKernel:
    """The fused kernel as a run uses it: the built library's path, the instruction set its GEMVs run in
    (`ISAS`, 0 off: then `why` is the status line) and what multiplies prefill chunks (`GEMMS`, 0: torch's fp32
    path). Made by `open_cpu_kernel`; a custom op rebuilds it from (library, isa)."""

    library: str = ""
    isa: int = 0
    why: str = ""
    gemm: int = 0
    ops: str = ""  # the kernel's torch ops (`load_torch_ops`), loaded: compiled graphs call them, in C++ ("": none)
    reads_ahead: bool = False  # whether a CPU decode step runs in a parallel region reading ahead (`StepScope`)

    @property
    def on(self) -> bool:
        return self.isa > 0

    def status(self) -> str:
        """One line: the instruction set decode GEMVs on quantised CPU weights run in, and the AMX tiles where
        prefill chunks take them, or why they take torch's path ("avx512bf16", "avx512 + amx", "avx2",
        "off (MHCRUN_CPU_KERNEL=0)", "off: <why>")."""
        name = next((name for name, isa in ISAS.items() if isa == self.isa), self.why)
        return f"{name} + amx" if self.gemm == GEMMS["amx"] else name

    def takes(self, w: QWeight, rows: int) -> bool:
        """Whether `qgemv` takes this weight for `rows` rows of x: the weight's own answer (`QWeight.kernel`,
        decided when it was loaded) and the kernel on. Safe while torch.compile traces, where the answer is fixed
        into the graph."""
        return w.kernel and rows <= MAX_ROWS and self.on

    def routed_routes(self, w1: ExpertSet, w2: ExpertSet) -> int:
        """The most routes (tokens times k) a `moe_routed` call takes: MAX_ROWS rows an expert on average (beyond
        decode's sizes the GEMV rows lose to GEMMs of dequantised experts), or where panels multiply the experts'
        many rows (AVX2's: FP4, e8m0 groups of 32, whole chunks of 128 inputs; avx512bf16's BF16 panels: FP4 and FP8
        in blocks of 32, from gemm::JOB_ROWS_FP4 / _FP8 rows an expert, where x and the scales qualify), as many as
        ROUTED_CALL_BYTES of the call's transients hold (`route_bytes`; the layouts the panels take, as the C++
        decides them: `mhc_panels_take`): a panel decoded once serves more rows (a 1,024-token prefill of the
        mid-size config takes two calls, not seven: BENCHMARKS.md)."""
        most = MAX_ROWS * w1.ptrs.shape[0]
        panels = self.on and all(load_library(self.library).mhc_panels_take(s.fmt, s.kind, s.block, s.in_features,
                                                                            self.isa) for s in (w1, w2))
        return max(most, ROUTED_CALL_BYTES // route_bytes(w2.out_features, w1.out_features)) if panels else most

    def gemm_first(self, rows: int) -> bool:
        """Whether `rows` rows of x take the panels (`qgemm`) before the GEMV rows: from the engine's GEMM_ROWS on."""
        return bool(self.gemm) and rows >= GEMM_ROWS[self.gemm]

    def qgemv(self, x3: Tensor, w: QWeight, groups: int) -> Tensor | None:
        """y [M, G, N/G] fp32 = x3 [M, G, K] (fp32) times the rows of the 2-D weight in G groups, or None when the
        kernel does not take it (`takes`) or declines (then the caller takes the torch path). A row holding an
        e4m3 NaN code comes out NaN, as dequantise-then-multiply gives it."""
        m = x3.shape[0]
        if not self.takes(w, m):
            return None
        o = w.operands
        y = self.gemv_at(o.fmt, o.data, o.scale, o.fp32_scale, x3, o.out_features, w.block)
        return None if y is None else y.view(m, groups, o.out_features // groups)

    def linear(self, x: Tensor, w: QWeight, act_block: int) -> Tensor | None:
        """`qlinear` of an eager decode step in one call: y [..., out] fp32 = x [..., in] (fp32; first rounded to FP8 in
        blocks of `act_block` when it is not 0, bitwise as `act_quant_fp8`) times a weight the kernel takes, for the few
        rows of x the GEMV rows take (`takes`, not `gemm_first`); None where it does not apply or declines (then the
        caller takes its usual path)."""
        if x.dtype != torch.float32 or not x.is_cpu:
            return None
        o = w.operands
        k = o.in_features
        rows = x.numel() // k if k and x.shape[-1] == k else 0  # x of another width: the caller's error
        if not rows or not self.takes(w, rows) or self.gemm_first(rows):
            return None
        xf = x.contiguous()
        y = torch.empty(*x.shape[:-1], o.out_features)
        rc = load_library(self.library).mhc_qlinear(o.fmt, o.data, o.scale, o.fp32_scale, xf.data_ptr(), y.data_ptr(),
                                                    rows, o.out_features, k, w.block, act_block, self.isa,
                                                    torch.get_num_threads())
        return None if rc else y

    def gemv_at(self, fmt: int, data: int, scale: int | None, kind: int, x3: Tensor, n: int,
                block: int) -> Tensor | None:
        """y [M, n] fp32 = x3 [M, G, K] times the weight [n, K] whose bytes lie at address `data` (format `fmt`:
        `FORMATS`; its scales at `scale`, kind 0 e8m0 bytes or 1 fp32), its rows in G groups. The caller keeps
        those bytes alive through the call. None when the kernel is off or declines (the calling thread flushes
        subnormals)."""
        if not self.on:
            return None
        m, groups, k = x3.shape
        x = x3.float().contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        rc = load_library(self.library).mhc_qgemv(fmt, data, scale, kind, x.data_ptr(), y.data_ptr(), m, n, k,
                                                  block, groups, self.isa, torch.get_num_threads())
        return None if rc else y

    def experts_at(self, s: ExpertSet, idx: Tensor, x: Tensor) -> Tensor | None:
        """y [B, k, out] fp32 = x [B, k or 1, in] through expert idx[b, j] of the set `s` (the experts' bytes read where
        they lie), in one call: the rows of each expert multiplied together, all the experts' rows in one parallel
        region. The caller keeps the bytes alive. None when the kernel is off or declines; ValueError where x's shape
        does not fit the routes and the experts or an index lies outside the set (nothing is read)."""
        if not self.on:
            return None
        check_routes(s, idx, x.shape[-1])
        b, kk = idx.shape
        if x.dim() != 3 or x.shape[0] != b or x.shape[1] not in (1, kk):
            raise ValueError(f"routed experts: x {list(x.shape)} for routes {list(idx.shape)}: x must be "
                             f"[{b}, 1 or {kk}, {s.in_features}]")
        xf = x.float().contiguous()
        ids = idx.to(torch.int64).contiguous()
        table = s.ptrs.to(torch.int64).contiguous()
        y = torch.empty(b, kk, s.out_features, dtype=torch.float32)
        rc = load_library(self.library).mhc_qgemv_experts(
            s.fmt, table.data_ptr(), table.shape[0], ids.data_ptr(), s.kind, xf.data_ptr(), y.data_ptr(), b, kk,
            xf.shape[1], s.out_features, xf.shape[2], s.block, self.isa, torch.get_num_threads())
        return routed_result(rc, y, ids, table.shape[0])

    def moe_routed(self, x: Tensor, weights: Tensor, idx: Tensor, w1: ExpertSet, w3: ExpertSet, w2: ExpertSet,
                   limit: float, act_block: int) -> Tensor | None:
        """MoE.routed_gathered of decode rows in one call (`mhc_moe_routed`): x [T, d] fp32 through each row's k routed
        experts idx [T, k] (the sets read in place; x rounded to FP8 first when act_block is not 0, and the experts'
        hidden values before w2), weighted by weights [T, k], the k results summed in order -> [T, d] fp32: the torch
        path's result within rounding (silu's exp is the C library's; the rest the same operations in the same order).
        Also a prefill chunk's, while its routes come to at most `routed_routes` (which bounds the call's transients;
        `MoE.routed` takes a longer chunk a slice at a time; with AVX2 an FP4 expert of four rows or more takes the
        panels). None where it does not apply or declines (non-finite values: torch's rules then apply); ValueError as
        `experts_at`'s."""
        t, d = x.shape if x.dim() == 2 else (0, 0)
        sets = (w1, w3, w2)
        # the MAX_ROWS floor first: a decode step's calls (eight a step) never need routed_routes
        over = idx.numel() > MAX_ROWS * w1.ptrs.shape[0] and idx.numel() > self.routed_routes(w1, w2)
        if not self.on or not t or over or x.dtype != torch.float32 \
                or not x.is_cpu \
                or weights.dtype != torch.float32 or weights.shape != idx.shape or idx.shape[0] != t \
                or len({(s.fmt, s.kind, s.block, s.ptrs.shape) for s in sets}) != 1 \
                or w1.out_features != w3.out_features or w2.out_features != d:
            return None
        inter = w1.out_features
        check_routes(w1, idx, d)
        check_routes(w3, idx, d)
        check_routes(w2, idx, inter)
        xf, wf, ids = x.contiguous(), weights.contiguous(), idx.to(torch.int64).contiguous()
        p1, p3, p2 = (s.ptrs.to(torch.int64).contiguous() for s in sets)
        y = torch.empty(t, d)
        rc = load_library(self.library).mhc_moe_routed(
            w1.fmt, p1.data_ptr(), p3.data_ptr(), p2.data_ptr(), p1.shape[0], w1.kind, ids.data_ptr(), wf.data_ptr(),
            xf.data_ptr(), y.data_ptr(), t, idx.shape[1], d, inter, w1.block, limit, act_block, self.isa,
            torch.get_num_threads())
        return routed_result(rc, y, ids, p1.shape[0])

    def qgemm(self, x2: Tensor, w: QWeight) -> Tensor | None:
        """y [M, out] fp32 = x2 [M, in] times an FP8/FP4 weight the kernel takes, by AMX tiles or BF16 dot products
        (`gemm`): a prefill chunk's GEMM, each block of 32 output rows decoded into a bf16 panel once
        (`mhc_qgemm_bf16`, exact up to the summation order where x and the scales qualify); None where it does not
        apply (no GEMM engine, a float weight, x or the scales that do not qualify): the caller then takes its fp32
        path."""
        if not self.gemm or not w.kernel or w.fmt == "float" or not x2.is_cpu:
            return None
        m, k = x2.shape
        o = w.operands
        x = x2.float().contiguous()
        y = torch.empty(m, o.out_features, dtype=torch.float32)
        rc = load_library(self.library).mhc_qgemm_bf16(o.fmt, o.data, o.scale, o.fp32_scale, x.data_ptr(),
                                                       y.data_ptr(), m, o.out_features, k, w.block, self.gemm,
                                                       torch.get_num_threads())
        return None if rc else y

    def takes_bf16(self, x: Tensor) -> bool:
        """Whether GEMVs over FP8/FP4 weights multiply this x by BF16 dot products (isa avx512bf16): every value
        exact in bf16, and zero or finite and at least 2**-110 in magnitude (so that no product or sum is
        subnormal, which vdpbf16ps flushes); qgemv.cpp's avx512bf16 namespace says why that is exact."""
        xf = x.float().contiguous()
        return self.isa == ISAS["avx512bf16"] and bool(load_library(self.library).mhc_takes_bf16(xf.data_ptr(),
                                                                                                 xf.numel()))

    def takes_int(self, x: Tensor) -> bool:
        """Whether GEMVs over FP4 weights multiply this x [..., K] by 16-bit integer dot products (isa avx512bf16,
        which has AVX-512 VNNI, or avx2): every value finite, and each chunk of 128 inputs of a row within 30 bits of
        its lowest set bit, inside 2**-125 .. 2**100 (as FP8-rounded x always is); qgemv.cpp's "x as integers" says
        why that is exact. FP4 GEMVs prefer these rows to the BF16 dot products and to the fp32 rows."""
        xf = x.float().contiguous()
        k = xf.shape[-1] if xf.dim() else 0
        return self.isa in (ISAS["avx512bf16"], ISAS["avx2"]) and k > 0 and bool(
            load_library(self.library).mhc_takes_int(xf.data_ptr(), xf.numel() // k, k))

    def fp4_simulate(self, x: Tensor, block: int) -> Tensor | None:
        """mhcrun.ops.quant.fp4_simulate(x, block), bitwise, in one call (`mhc_fp4_simulate`), for a CPU fp32 x (an
        indexer query's heads; a prefill's over the run's threads); None where it does not apply (non-finite x
        included)."""
        k = x.shape[-1] if x.dim() else 0
        if not self.on or x.dtype != torch.float32 or not x.is_cpu or not k:
            return None
        y = x.clone(memory_format=torch.contiguous_format)
        return None if load_library(self.library).mhc_fp4_simulate(y.data_ptr(), y.numel() // k, k, block,
                                                                   torch.get_num_threads()) else y

    def hadamard(self, x: Tensor) -> Tensor | None:
        """mhcrun.ops.quant.hadamard(x), bitwise, in one call (`mhc_hadamard`: its butterflies in its order), for a CPU
        fp32 x whose last dim is a power of two (indexer queries and keys; a prefill's rows over the run's threads);
        None where it does not apply."""
        n = x.shape[-1] if x.dim() else 0
        if not self.on or x.dtype != torch.float32 or not x.is_cpu or n <= 0 or n & (n - 1) or not x.numel():
            return None
        x = x.contiguous()
        y = torch.empty_like(x)
        rc = load_library(self.library).mhc_hadamard(x.data_ptr(), y.data_ptr(), x.numel() // n, n, n**-0.5,
                                                     torch.get_num_threads())
        return None if rc else y

    def decodes(self, w: QWeight) -> bool:
        """Whether `decode_rows` takes this weight (an fp8 / fp4 one the kernel takes, the kernel on)."""
        return w.kernel and w.fmt != "float" and self.on

    def decode_rows(self, w: QWeight, r0: int, r1: int, out: Tensor) -> bool:
        """Rows [r0, r1) of a 2-D fp8 / fp4 weight the kernel takes, dequantised into out (contiguous fp32
        [r1 - r0, in]) in one pass, bitwise as the reference dequantisers; False when it does not apply (then the
        caller decodes with torch). AVX-512 where the GEMVs run it, else AVX2."""
        if not self.decodes(w):
            return False
        o = w.operands
        rc = load_library(self.library).mhc_decode_rows(o.fmt, o.data, o.scale, o.fp32_scale, out.data_ptr(), r0, r1,
                                                        o.out_features, o.in_features, w.block, self.isa,
                                                        torch.get_num_threads())
        return rc == 0

    def act_quant_fp8(self, x: Tensor, block: int) -> Tensor | None:
        """fp8_simulate(x, block, pow2_scale=True) (DeepSeek's act_quant before an FP8/FP4 GEMM), bitwise, for a
        CPU fp32/bf16 x of any number of rows (decode's few, a prefill chunk's many: rows split over torch's
        threads); None when it does not apply (then the caller takes the torch path)."""
        k = x.shape[-1]
        if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu or not k or not self.on:
            return None
        src = x.float().contiguous()
        y = torch.empty_like(src)
        if load_library(self.library).mhc_act_quant_fp8(src.data_ptr(), y.data_ptr(), x.numel() // k, k, block,
                                                        self.isa, torch.get_num_threads()):
            return None
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def hc_takes(self, streams: Tensor, *ts: Tensor, rows: int | None = MAX_ROWS) -> bool:
        """Whether the mHC steps' C++ (`hc_post`, `hc_pre`) takes streams [..., n, d] (and ts): the kernel on, CPU
        tensors, fp32 or bf16 streams, at most `rows` rows (None: any; the pre step's at most MAX_ROWS: above, its
        mixes are a GEMM that torch does faster than the C++ does row by row)."""
        return (self.on and all(t.is_cpu for t in (streams, *ts)) and streams.dim() >= 2
                and streams.dtype in (torch.float32, torch.bfloat16) and streams.numel() > 0
                and (rows is None or streams.numel() <= rows * streams.shape[-1] * streams.shape[-2]))

    def hc_post(self, y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor | None:
        """mhcrun.ops.hc.hc_post, bitwise, in one call: y [..., d], residual [..., n, d] (same dtype: fp32 or bf16),
        post [..., n], comb [..., n, n] fp32 -> [..., n, d], any number of rows (a prefill's over the run's threads: one
        pass where torch's take 2n + 1); None where it does not apply (`hc_takes`)."""
        if not self.hc_takes(residual, post, comb, rows=None) or y.dtype != residual.dtype \
                or post.dtype != torch.float32 or comb.dtype != torch.float32:
            return None
        *lead, n, d = residual.shape
        y, residual, post, comb = (t.contiguous() for t in (y, residual, post, comb))
        out = torch.empty_like(residual)
        rc = load_library(self.library).mhc_hc_post(int(y.dtype == torch.bfloat16), y.data_ptr(), residual.data_ptr(),
                                                    post.data_ptr(), comb.data_ptr(), out.data_ptr(),
                                                    residual.numel() // (n * d), n, d, self.isa,
                                                    torch.get_num_threads())
        return None if rc else out

    def hc_pre(self, x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, weight: Tensor, iters: int, eps: float,
               norm_eps: float) -> tuple[Tensor, Tensor, Tensor] | None:
        """The pre step of a site and its sublayer's RMSNorm (mhcrun.nki.ops.hc_pre's reference) in one call:
        x [..., n, d] (fp32 or bf16), fn [(2+n)*n, n*d], scale [3], base [(2+n)*n], weight [d] fp32 -> h [..., d],
        post [..., n], comb [..., n, n] (fp32), within rounding of the reference (its GEMV, mean squares and
        softmax summed in another order); None where it does not apply (`hc_takes`)."""
        out = self.hc_post_pre(None, x, None, None, fn, scale, base, weight, iters, eps, norm_eps)
        return None if out is None else out[1:]

    def hc_head(self, x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, eps: float, norm_eps: float) -> Tensor | None:
        """mhcrun.ops.hc.hc_head (V4's final collapse) in one call (`mhc_hc_pre` without post): x [..., n, d] (fp32 or
        bf16), fn [n, n*d], scale [1], base [n] fp32 -> [..., d] in x's dtype, within rounding of the reference (the
        mixes summed in another order; the collapse in stream order, as it); None where it does not apply
        (`hc_takes`)."""
        if not self.hc_takes(x, fn, scale, base) or any(t.dtype != torch.float32 for t in (fn, scale, base)):
            return None
        *lead, n, d = x.shape
        if fn.shape != (n, n * d) or base.shape != (n,) or scale.numel() != 1:
            return None
        x, fn, scale, base = (v.contiguous() for v in (x, fn, scale, base))
        h = x.new_empty((*lead, d))
        rc = load_library(self.library).mhc_hc_pre(int(x.dtype == torch.bfloat16), x.data_ptr(), fn.data_ptr(),
                                                    scale.data_ptr(), base.data_ptr(), None, h.data_ptr(), None, None,
                                                    x.numel() // (n * d), n, d, 0, eps, norm_eps, None, self.isa,
                                                    torch.get_num_threads())
        return None if rc else h

    def finish(self, y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
               eps: float, hc_norm_eps: float, norm: Tensor, norm_eps: float, head: Tensor | None,
               act: int) -> tuple[Tensor, Tensor] | None:
        """`Transformer.finish` of decode rows in one call (`mhc_finish`: the calls of its eager path, in its order, so
        the same values): `hc_post` of the carried streams (y [b, 1, d], residual [b, 1, n, d], post, comb; fp32),
        `hc_head` of them (fn, scale, base, eps, hc_norm_eps), `rms_norm` by norm [d] (norm_eps), then `linear` of the
        head (`head`: its `weight_table`; act its activation block) -> (logits [b, vocab], the streams [b, 1, n, d]);
        None where it does not apply or a call declines."""
        if not self.hc_takes(residual, post, comb) or residual.dim() != 4 or residual.shape[1] != 1 or head is None \
                or not cpu_fp32(y, residual, post, comb, fn, scale, base, norm):
            return None
        b, _, n, d = residual.shape
        ((vocab, k),) = table_shapes(head)
        if self.gemm_first(b) or k != d or y.shape != (b, 1, d) or post.shape != (b, 1, n) \
                or comb.shape != (b, 1, n, n) or fn.shape != (n, n * d) or base.shape != (n,) or scale.numel() != 1 \
                or norm.shape != (d,):
            return None
        y, residual, post, comb, fn, scale, base, norm = (t.contiguous() for t in (y, residual, post, comb, fn, scale,
                                                                                   base, norm))
        streams, logits = torch.empty_like(residual), torch.empty(b, vocab)
        rc = load_library(self.library).mhc_finish(
            y.data_ptr(), residual.data_ptr(), post.data_ptr(), comb.data_ptr(), streams.data_ptr(), fn.data_ptr(),
            scale.data_ptr(), base.data_ptr(), eps, hc_norm_eps, norm.data_ptr(), norm_eps, head.data_ptr(), act,
            logits.data_ptr(), b, n, d, self.isa, torch.get_num_threads())
        return None if rc else (logits, streams)

    def hc_post_pre(self, y: Tensor | None, residual: Tensor, post: Tensor | None, comb: Tensor | None, fn: Tensor,
                    scale: Tensor, base: Tensor, weight: Tensor, iters: int, eps: float,
                    norm_eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """`hc_post` of (y, residual, post, comb), then `hc_pre` of its streams, in one call -> (the streams, h, post,
        comb); with y None, `hc_pre` of residual alone (the streams returned as they are). None where either does not
        apply."""
        x = residual
        if not self.post_pre_fits(y, x, post, comb, fn, scale, base, weight):
            return None
        if torch.compiler.is_compiling():  # a graph calls the op whose C++ makes this call (torch_ops.cpp)
            return None if y is None or not self.ops else torch.ops.mhcrun.hc_post_pre_native(
                y, x, post, comb, fn, scale, base, weight, iters, eps, norm_eps, self.library, self.isa)
        args, out, held = self._post_pre_call(y, x, post, comb, fn, scale, base, weight, iters, eps, norm_eps)
        rc = load_library(self.library).mhc_hc_post_pre(*args)
        del held  # what the call read: alive through it
        return None if rc else out

    def post_pre_fits(self, y: Tensor | None, x: Tensor, post: Tensor | None, comb: Tensor | None, fn: Tensor,
                      scale: Tensor, base: Tensor, weight: Tensor) -> bool:
        """Whether `hc_post_pre` takes these (`hc_takes`, fp32 mixes, the shapes the C++ reads as they are)."""
        if not self.hc_takes(x, fn, scale, base, weight) or not cpu_fp32(fn, scale, base, weight):
            return False
        if y is not None and (y.dtype != x.dtype or not cpu_fp32(post, comb) or not self.hc_takes(x, post, comb)):
            return False
        n, d, m = x.shape[-2], x.shape[-1], (2 + x.shape[-2]) * x.shape[-2]
        return (fn.shape == (m, n * d) and scale.numel() == 3 and base.numel() == m and weight.numel() == d
                and (y is None or (y.shape == x.shape[:-2] + (d,) and post.shape == x.shape[:-1]
                                   and comb.shape == x.shape[:-1] + (n,))))

    def _post_pre_call(self, y: Tensor | None, x: Tensor, post: Tensor | None, comb: Tensor | None, fn: Tensor,
                       scale: Tensor, base: Tensor, weight: Tensor, iters: int, eps: float,
                       norm_eps: float) -> tuple[list, tuple[Tensor, Tensor, Tensor, Tensor], tuple]:
        """`mhc_hc_post_pre`'s arguments for `hc_post_pre`'s (checked there), the results it writes (the streams, h,
        post, comb) and the tensors whose addresses the arguments hold (contiguous copies among them), which the caller
        keeps until the call returns."""
        n, d = x.shape[-2], x.shape[-1]
        lead, t = x.shape[:-2], x.numel() // (n * d)
        x, fn, scale, base, weight = (v.contiguous() for v in (x, fn, scale, base, weight))
        h = x.new_empty((*lead, d))
        post_out, comb_out = torch.empty((*lead, n)), torch.empty((*lead, n, n))
        if y is not None:
            y, post, comb = (v.contiguous() for v in (y, post, comb))
        streams = x if y is None else torch.empty_like(x)
        ptrs = [None if v is None else v.data_ptr() for v in (y, x, post, comb, None if y is None else streams)]
        return ([int(x.dtype == torch.bfloat16), *ptrs, fn.data_ptr(), scale.data_ptr(), base.data_ptr(),
                 weight.data_ptr(), h.data_ptr(), post_out.data_ptr(), comb_out.data_ptr(), t, n, d, iters, eps,
                 norm_eps, None, self.isa, torch.get_num_threads()], (streams, h, post_out, comb_out),
                (y, x, post, comb, fn, scale, base, weight))

    def ffn_half(self, y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor,
                 base: Tensor, weight: Tensor, iters: int, eps: float, norm_eps: float,
                 moe: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """`Block.ffn_half` of CPU eager decode rows in one call (`mhc_ffn_half`): `hc_post_pre` of the carried streams
        and the MoE site's mixes (its arguments), then `moe_step` of its h (moe: `moe_step`'s arguments after x), as
        the block's calls make them, so the same values -> (the streams [b, s, n, d], the MoE's y [b, s, d], post,
        comb); None where either does not apply or declines."""
        if residual.dim() != 4 or not self.post_pre_fits(y, residual, post, comb, fn, scale, base, weight):
            return None
        b, s, _, d = residual.shape
        args, (streams, h, post_out, comb_out), held = self._post_pre_call(y, residual, post, comb, fn, scale, base,
                                                                           weight, iters, eps, norm_eps)
        step = self._moe_step_call(h.view(b * s, d), *moe)
        if step is None:
            return None
        moe_args, out, moe_held = step
        rc = load_library(self.library).mhc_ffn_half(*args, *moe_args)
        del held, moe_held  # what the call read: alive through it
        return None if rc else (streams, out.view(b, s, d), post_out, comb_out)

    def attend(self, q: Tensor, kv: Tensor, mask: Tensor, sink: Tensor, scale: float, sel: Tensor | None = None,
               sel_mask: Tensor | None = None) -> Tensor | None:
        """mhcrun.ops.attention.sparse_attn (same arguments) in one call (`mhc_attend`), within rounding of it (its
        sums in another order), for fp32 CPU tensors and at most MAX_ROWS queries a batch row (decode); None where
        it does not apply (the caller then takes sparse_attn)."""
        ts = (q, kv) if sel is None else (q, kv, sel)
        if not self.on or q.dim() != 4 or q.shape[1] > MAX_ROWS or (sel is None) != (sel_mask is None) \
                or any(t.dtype != torch.float32 or not t.is_cpu for t in ts):
            return None
        b, s, h, d = q.shape
        n, k = kv.shape[1], 0 if sel is None else sel.shape[2]
        shapes = [(kv, (b, n, d)), (mask, (b, s, n)), (sink, (h,))]
        if sel is not None:
            shapes += [(sel, (b, s, k, d)), (sel_mask, (b, s, k))]
        if any(tuple(t.shape) != want for t, want in shapes):  # the C++ reads these shapes as they are, no broadcast
            return None
        if torch.compiler.is_compiling():  # a graph calls the op whose C++ makes this call (torch_ops.cpp)
            return None if not self.ops else torch.ops.mhcrun.attend_native(
                q, kv, mask.to(torch.bool), sink.float(), scale, sel,
                None if sel_mask is None else sel_mask.to(torch.bool), self.library, self.isa)
        q, kv = q.contiguous(), kv.contiguous()
        mask = mask.to(torch.bool).contiguous()
        sel = None if sel is None else sel.contiguous()
        sel_mask = None if sel_mask is None else sel_mask.to(torch.bool).contiguous()
        sink = sink.float().contiguous()
        o = torch.empty_like(q)
        rc = load_library(self.library).mhc_attend(q.data_ptr(), kv.data_ptr(), mask.data_ptr(),
                                                   None if sel is None else sel.data_ptr(),
                                                   None if sel_mask is None else sel_mask.data_ptr(), sink.data_ptr(),
                                                   o.data_ptr(), b, s, h, n, k, d, scale, min(self.isa, 2),
                                                   torch.get_num_threads())
        return None if rc else o

    def attend_decode(self, q: Tensor, kv: Tensor, ring: dict[str, Tensor], rows: Tensor, start: Tensor,
                      comp: dict[str, Tensor] | None, idx: Tensor | None, valid: Tensor | None, sink: Tensor,
                      scale: float, block: int) -> Tensor | None:
        """Eager decode's attention of one token a row in one call (`mhc_attend_decode`): kv [b, 1, d] encoded into the
        window ring (`ring`: the kv cache's fp8 parts "fp8", "scale", "rope" [B, window, ...], pow2 scales) at slot
        start % window of rows `rows` [b], bitwise as kvcache.encode and Cache.store; then q [b, 1, h, d] attends to
        the ring's window (window_mask's keys) and to the entries idx [b, 1, k] of the compressor's cache `comp` (the
        same format) that `valid` [b, 1, k] marks, as sparse_attn (within rounding of it) -> o [b, 1, h, d]. fp32 CPU
        tensors; None where it does not apply (a non-finite kv included: then nothing was written)."""
        call = self._attend_decode_call(q, kv, ring, rows, start, comp, idx, valid, sink, scale, block)
        if call is None:
            return None
        args, held = call
        o = torch.empty_like(q)
        rc = load_library(self.library).mhc_attend_decode(*args[:13], o.data_ptr(), *args[13:])
        del held  # what the call read: alive through it
        return None if rc else o

    def attend_output(self, q: Tensor, kv: Tensor, ring: dict[str, Tensor], rows: Tensor, start: Tensor,
                      comp: dict[str, Tensor] | None, idx: Tensor | None, valid: Tensor | None, sink: Tensor,
                      scale: float, block: int, table: Tensor | None, act_b: int, cos: Tensor, sin: Tensor,
                      groups: int, rope_dim: int, opened: tuple | None = None) -> Tensor | None:
        """`attend_decode` (its arguments) and then `attn_output` of its o (its arguments after o) in one call
        (`mhc_attend_output`: the same calls, so the same values) -> [b, 1, wo_b rows]; with `opened` (`compress_open`'s
        arguments: the compressor's step before the attention, closing no group) that call first, all in one
        (`mhc_open_attend_output`). None where any does not apply or a call declines (the tokens may then be in the
        open groups' slots and the ring already: the caller's calls write the same)."""
        call = self._attend_decode_call(q, kv, ring, rows, start, comp, idx, valid, sink, scale, block)
        out = None if call is None else self._attn_output_call(q.shape, table, act_b, cos, sin, groups, rope_dim)
        first = None if out is None or opened is None else self._compress_open_call(*opened)
        if out is None or (opened is not None and first is None):
            return None
        (args, held), (before_o, after_o, y, out_held) = call, out
        lib = load_library(self.library)
        if first is None:
            rc = lib.mhc_attend_output(*args, *before_o, *after_o)
        else:
            rc = lib.mhc_open_attend_output(*first[0], *args, *before_o, *after_o)
        del held, out_held, first  # what the call read: alive through it
        return None if rc else y

    def _attend_decode_call(self, q: Tensor, kv: Tensor, ring: dict[str, Tensor], rows: Tensor, start: Tensor,
                            comp: dict[str, Tensor] | None, idx: Tensor | None, valid: Tensor | None, sink: Tensor,
                            scale: float, block: int) -> tuple[list, tuple] | None:
        """`mhc_attend_decode`'s arguments but o (`attend_decode`'s, checked) and the tensors whose addresses they
        hold (contiguous copies among them), which the caller keeps until the call returns; None where they do not
        fit."""
        parts = [ring] if comp is None else [ring, comp]
        if not self.on or self.isa < 1 or q.dim() != 4 or q.shape[1] != 1 or kv.shape != (q.shape[0], 1, q.shape[3]) \
                or any(t.dtype != torch.float32 or not t.is_cpu for t in (q, kv, sink)) \
                or any(set(p) != {"fp8", "scale", "rope"} or p["fp8"].dtype != torch.float8_e4m3fn
                       or p["scale"].dtype != torch.float32 or p["rope"].dtype != torch.float32
                       or not p["fp8"].is_cpu or not all(t.is_contiguous() for t in p.values())
                       for p in parts) \
                or rows.dtype != torch.int64 or start.dtype != torch.int64 or (comp is None) != (idx is None):
            return None
        b, _, h, d = q.shape
        n_rows, win, nope = ring["fp8"].shape
        rd = d - nope
        k = 0 if idx is None else idx.shape[-1]
        shapes = [(ring["scale"], (n_rows, win, -(-nope // block))), (ring["rope"], (n_rows, win, rd)),
                  (rows, (b,)), (start, (b,)), (sink, (h,))]
        if comp is not None:
            c_len = comp["fp8"].shape[1]
            shapes += [(comp["fp8"], (n_rows, c_len, nope)), (comp["rope"], (n_rows, c_len, rd)),
                       (comp["scale"], (n_rows, c_len, -(-nope // block))), (idx, (b, 1, k)),
                       (valid, (b, 1, k))]
        if rd < 0 or any(tuple(t.shape) != want for t, want in shapes) \
                or (idx is not None and idx.dtype != torch.int64):
            return None
        q, kv, rows, start, sink = (t.contiguous() for t in (q, kv, rows, start, sink))
        if comp is not None:
            idx, valid = idx.contiguous(), valid.to(torch.bool).contiguous()
        c = comp or {}

        def ptr(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        return ([q.data_ptr(), kv.data_ptr(), ring["fp8"].data_ptr(), ring["scale"].data_ptr(), ring["rope"].data_ptr(),
                 rows.data_ptr(), start.data_ptr(), ptr(c.get("fp8")), ptr(c.get("scale")), ptr(c.get("rope")),
                 ptr(idx), ptr(valid), sink.data_ptr(), b, h, d, rd, block, n_rows, win,
                 0 if comp is None else c["fp8"].shape[1], k, scale, min(self.isa, 2), torch.get_num_threads()],
                (q, kv, rows, start, sink, idx, valid))

    def route(self, x: Tensor, weight: Tensor, bias: Tensor | None, hash_ids: Tensor | None, topk: int,
              route_scale: float, score_func: str) -> tuple[Tensor, Tensor] | None:
        """`moe.gate_scores` and `moe.route` in one call (`mhc_route`): x [T, d], weight [E, d], bias [E] fp32 (or
        None), hash_ids [T, k] int64 (or None) -> (weights [T, k] fp32, expert ids [T, k] int64), the scores within
        rounding of torch's, exact ties to the lower expert; for decode's few rows (at most MAX_ROWS); None where it
        does not apply (a NaN score included)."""
        if not self.routes(x, weight, bias, hash_ids, topk, score_func):
            return None
        t, d = x.shape
        e = weight.shape[0]
        x, weight = x.contiguous(), weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        hash_ids = None if hash_ids is None else hash_ids.contiguous()
        weights, idx = torch.empty(t, topk), torch.empty(t, topk, dtype=torch.int64)
        rc = load_library(self.library).mhc_route(x.data_ptr(), weight.data_ptr(),
                                                  None if bias is None else bias.data_ptr(),
                                                  None if hash_ids is None else hash_ids.data_ptr(),
                                                  weights.data_ptr(), idx.data_ptr(), t, d, e, topk,
                                                  SCORE_FUNCS[score_func], route_scale, min(self.isa, 2),
                                                  torch.get_num_threads())
        return None if rc else (weights, idx)

    def routes(self, x: Tensor, weight: Tensor, bias: Tensor | None, hash_ids: Tensor | None, topk: int,
               score_func: str) -> bool:
        """Whether `route` takes these arguments (its shapes and dtypes, decode's few rows, the kernel on)."""
        if not self.on or score_func not in SCORE_FUNCS or x.dim() != 2 or weight.dim() != 2 \
                or not cpu_fp32(x, weight) or (bias is not None and not cpu_fp32(bias)):
            return False
        t, d = x.shape
        e = weight.shape[0]
        return (0 < t <= MAX_ROWS and weight.shape[1] == d and 0 < topk <= e
                and (bias is None or bias.shape == (e,))
                and (hash_ids is None or (hash_ids.shape == (t, topk) and hash_ids.dtype == torch.int64)))

    def moe_step(self, x: Tensor, gate: Tensor, bias: Tensor | None, hash_ids: Tensor | None, topk: int,
                 route_scale: float, score_func: str, sets: Tensor | None, act: tuple[int, int],
                 limit: float) -> Tensor | None:
        """`MoE.forward` of decode rows on one rank in one call (`mhc_moe_step`: the calls of its eager path, `route`,
        `moe_routed` of the routed experts and of the shared one, in its order, and its sum: the same values): x [T, d]
        fp32, the layer's router gate [E, d], bias and hash_ids as `route`'s, `sets` the layer's experts on rows of d
        (`moe_table`), act the routed and the shared experts' activation blocks -> y [T, d] fp32; None where it does not
        apply or a call declines (the caller's calls one by one then say why)."""
        step = self._moe_step_call(x, gate, bias, hash_ids, topk, route_scale, score_func, sets, act, limit)
        if step is None:
            return None
        args, y, held = step
        rc = load_library(self.library).mhc_moe_step(*args)
        del held  # what the call read: alive through it
        return None if rc else y

    def _moe_step_call(self, x: Tensor, gate: Tensor, bias: Tensor | None, hash_ids: Tensor | None, topk: int,
                       route_scale: float, score_func: str, sets: Tensor | None, act: tuple[int, int],
                       limit: float) -> tuple[list, Tensor, tuple] | None:
        """`mhc_moe_step`'s arguments for `moe_step`'s, the y it writes and the tensors whose addresses the arguments
        hold, which the caller keeps until the call returns; None where it does not apply (x's values are not read
        here: `ffn_half` hands over the h its call writes first)."""
        if sets is None or not self.routes(x, gate, bias, hash_ids, topk, score_func):
            return None
        t, d = x.shape
        x, gate = x.contiguous(), gate.contiguous()
        bias = None if bias is None else bias.contiguous()
        hash_ids = None if hash_ids is None else hash_ids.contiguous()
        y = torch.empty(t, d)
        return ([x.data_ptr(), gate.data_ptr(), None if bias is None else bias.data_ptr(),
                 None if hash_ids is None else hash_ids.data_ptr(), gate.shape[0], topk, SCORE_FUNCS[score_func],
                 route_scale, sets.data_ptr(), *act, limit, y.data_ptr(), t, d, self.isa, torch.get_num_threads()], y,
                (x, gate, bias, hash_ids, sets))

    def rms_norm(self, x: Tensor, weight: Tensor | None, eps: float) -> Tensor | None:
        """mhcrun.ops.norm.rms_norm in one call (`mhc_rms_norm`) for fp32 CPU x [..., d] of decode's few rows (at most
        MAX_ROWS) and an fp32 weight [d], or with weight None x * rsqrt(mean(x^2) + eps) of decode's rows of heads (the
        attention's weightless per-head norm: at most MAX_ROWS * HEAD_ROWS rows): the products bitwise torch's, the
        mean of squares within rounding of it; None where it does not apply."""
        d = x.shape[-1] if x.dim() else 0
        weighs = weight is not None
        rows = MAX_ROWS if weighs else MAX_ROWS * HEAD_ROWS
        if not self.on or not d or x.dtype != torch.float32 or not x.is_cpu or x.numel() // d > rows \
                or (weighs and (weight.dtype != torch.float32 or not weight.is_cpu or weight.shape != (d,))):
            return None
        xc = x.contiguous()
        out = torch.empty_like(xc)
        w_ptr = weight.contiguous().data_ptr() if weighs else None
        rc = load_library(self.library).mhc_rms_norm(xc.data_ptr(), w_ptr, out.data_ptr(), x.numel() // d, d, eps,
                                                     self.isa)
        return None if rc else out

    def rope_tail(self, x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, inverse: bool = False) -> Tensor | None:
        """mhcrun.ops.rope.apply_rope_tail, bitwise, in one call (`mhc_rope_tail`): fp32 CPU x [..., dim], cos and sin
        [..., rope_dim // 2] of x's rank whose leading dims are x's first ones followed by ones (a head dim they
        share), any number of rows (a prefill's over the run's threads); None where it does not apply."""
        ts = (x, cos, sin)
        if not self.on or any(t.dtype != torch.float32 or not t.is_cpu for t in ts) \
                or cos.shape != sin.shape or cos.dim() != x.dim() or 2 * cos.shape[-1] != rope_dim \
                or not 0 < rope_dim <= x.shape[-1]:
            return None
        lead = tuple(cos.shape[:-1])
        while lead and lead[-1] == 1:
            lead = lead[:-1]
        rows = math.prod(lead)
        if tuple(x.shape[:len(lead)]) != lead or not x.numel():
            return None
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(x)
        load_library(self.library).mhc_rope_tail(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows,
                                                 x.numel() // (rows * x.shape[-1]), x.shape[-1], rope_dim,
                                                 int(inverse), torch.get_num_threads())
        return out

    def attn_project(self, x: Tensor, table: Tensor | None, act: tuple[int, int, int], q_norm: Tensor, kv_norm: Tensor,
                     eps: float, cos: Tensor, sin: Tensor, heads: int,
                     rope_dim: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """`Attention.project` of decode rows in one call (`mhc_attn_project`: the calls of its eager path, in its
        order, so the same values): x [b, s, d] fp32, `table` the weights wq_a, wq_b, wkv (`weight_table`), act their
        activation blocks (0: none), q_norm [q_lora] and kv_norm [hd] fp32 (eps: theirs, the heads' norm's too), cos,
        sin [b, s, rope_dim / 2] -> (qr [b, s, q_lora], q [b, s, heads, hd], kv [b, s, hd]); None where it does not
        apply (as `linear` for any of the weights, or a call declining)."""
        b, s, d = x.shape if x.dim() == 3 else (0, 0, 0)
        m = b * s
        if not self.on or not m or m > MAX_ROWS or self.gemm_first(m) or table is None or x.dtype != torch.float32 \
                or not x.is_cpu:
            return None
        (q_lora, k_a), (n_q, k_b), (hd, k_kv) = table_shapes(table)
        if k_a != d or k_kv != d or k_b != q_lora or n_q != heads * hd or q_norm.shape != (q_lora,) \
                or kv_norm.shape != (hd,) or cos.shape != (b, s, rope_dim // 2) or sin.shape != cos.shape \
                or not 0 < rope_dim <= hd or rope_dim % 2 \
                or not cpu_fp32(q_norm, kv_norm, cos, sin):
            return None
        x, q_norm, kv_norm, cos, sin = (t.contiguous() for t in (x, q_norm, kv_norm, cos, sin))
        qr, q, kv = torch.empty(b, s, q_lora), torch.empty(b, s, heads, hd), torch.empty(b, s, hd)
        rc = load_library(self.library).mhc_attn_project(
            table.data_ptr(), *act, x.data_ptr(), q_norm.data_ptr(), kv_norm.data_ptr(), eps, cos.data_ptr(),
            sin.data_ptr(), qr.data_ptr(), q.data_ptr(), kv.data_ptr(), m, heads, hd, rope_dim, self.isa,
            torch.get_num_threads())
        return None if rc else (qr, q, kv)

    def index_queries(self, qr: Tensor, table: Tensor | None, act_b: int, cos: Tensor, sin: Tensor, heads: int,
                      rope_dim: int, fp4_block: int) -> Tensor | None:
        """`Indexer.queries` of decode rows in one call (`mhc_index_queries`, as `attn_project`): qr [b, s, q_lora]
        fp32 through wq_b (`table`: `weight_table`; act_b its activation block, 0 none) as heads of hd, RoPE on their
        tails by cos, sin [b, s, rope_dim / 2], the Hadamard rotation, then with fp4_block > 0 the FP4 rounding in
        blocks of it -> q [b, s, heads, hd]; None where it does not apply or a call declines."""
        b, s, d = qr.shape if qr.dim() == 3 else (0, 0, 0)
        m = b * s
        if not self.on or not m or m > MAX_ROWS or self.gemm_first(m) or table is None or qr.dtype != torch.float32 \
                or not qr.is_cpu:
            return None
        ((n_q, k_b),) = table_shapes(table)
        hd = n_q // heads if heads > 0 else 0
        if k_b != d or not hd or hd * heads != n_q or hd & (hd - 1) or cos.shape != (b, s, rope_dim // 2) \
                or sin.shape != cos.shape or not 0 < rope_dim <= hd or rope_dim % 2 or not cpu_fp32(cos, sin):
            return None
        qr, cos, sin = qr.contiguous(), cos.contiguous(), sin.contiguous()
        q = torch.empty(b, s, heads, hd)
        rc = load_library(self.library).mhc_index_queries(
            table.data_ptr(), act_b, qr.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), m, heads, hd,
            rope_dim, hd**-0.5, fp4_block, self.isa, torch.get_num_threads())
        return None if rc else q

    def attn_output(self, o: Tensor, table: Tensor | None, act_b: int, cos: Tensor, sin: Tensor, groups: int,
                    rope_dim: int) -> Tensor | None:
        """`Attention.output` of decode rows before its reduction across ranks, in one call (`mhc_attn_output`, as
        `attn_project`): o [b, s, heads, hd] fp32 rotated back by cos, sin [b, s, rope_dim / 2], wo_a's grouped product
        in `groups` groups, wo_b's (its activation block act_b: 0 none) -> [b, s, wo_b rows]; `table`: wo_a, wo_b
        (`weight_table`). None where it does not apply."""
        call = self._attn_output_call(o.shape, table, act_b, cos, sin, groups, rope_dim)
        if call is None or o.dtype != torch.float32 or not o.is_cpu:
            return None
        before_o, after_o, out, held = call
        o = o.contiguous()
        rc = load_library(self.library).mhc_attn_output(*before_o, o.data_ptr(), *after_o)
        del held  # what the call read: alive through it
        return None if rc else out

    def _attn_output_call(self, shape: tuple[int, ...], table: Tensor | None, act_b: int, cos: Tensor, sin: Tensor,
                          groups: int, rope_dim: int) -> tuple[list, list, Tensor, tuple] | None:
        """`mhc_attn_output`'s arguments before o and after it (o of `shape`; `attn_output`'s, checked), its result and
        the tensors whose addresses the arguments hold (contiguous copies among them), which the caller keeps until the
        call returns; None where they do not fit."""
        b, s, h, hd = shape if len(shape) == 4 else (0, 0, 0, 0)
        m = b * s
        if not self.on or not m or m > MAX_ROWS or self.gemm_first(m) or table is None or groups < 1 \
                or (h * hd) % groups:
            return None
        (n_a, k_a), (n_b, k_b) = table_shapes(table)
        if k_a * groups != h * hd or n_a % groups or k_b != n_a or cos.shape != (b, s, rope_dim // 2) \
                or sin.shape != cos.shape or not 0 < rope_dim <= hd or rope_dim % 2 or not cpu_fp32(cos, sin):
            return None
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(b, s, n_b)
        return ([table.data_ptr(), act_b], [cos.data_ptr(), sin.data_ptr(), out.data_ptr(), m, h, hd, rope_dim, groups,
                                            self.isa, torch.get_num_threads()], out, (table, cos, sin))

    def kv_fp8(self, codes: Tensor, scale: Tensor, rope: Tensor, block: int) -> Tensor | None:
        """mhcrun.ops.kvcache.decode of the fp8 format in fp32, bitwise, in one call (`mhc_kv_fp8_decode`): codes
        float8_e4m3fn [..., nope], scale fp32 [..., ceil(nope / block)], rope fp32 [..., rd], CPU tensors ->
        fp32 [..., nope + rd]; None where it does not apply."""
        ts = (codes, scale, rope)
        if not self.on or codes.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 \
                or rope.dtype != torch.float32 or any(not t.is_cpu for t in ts):
            return None
        lead, nope, rd = codes.shape[:-1], codes.shape[-1], rope.shape[-1]
        rows = math.prod(lead)
        if not rows or not nope or scale.shape != (*lead, -(-nope // block)) or rope.shape[:-1] != lead:
            return None
        codes, scale, rope = (t.contiguous() for t in ts)
        out = torch.empty(*lead, nope + rd)
        rc = load_library(self.library).mhc_kv_fp8_decode(codes.data_ptr(), scale.data_ptr(), rope.data_ptr(),
                                                          out.data_ptr(), rows, nope, block, rd,
                                                          2 if self.isa >= 2 else 0,
                                                          torch.get_num_threads() if rows >= 16 else 1)
        return None if rc else out

    def kv_fp4(self, packed: Tensor, scale: Tensor, block: int) -> Tensor | None:
        """mhcrun.ops.kvcache.decode of the fp4 format (indexer keys) in fp32, bitwise, in one call
        (`mhc_kv_fp4_decode`): packed uint8 [..., k / 2], scale fp32 [..., ceil(k / block)], CPU tensors -> fp32
        [..., k]; None where it does not apply."""
        if not self.on or packed.dtype != torch.uint8 or scale.dtype != torch.float32 \
                or not packed.is_cpu or not scale.is_cpu:
            return None
        lead, k = packed.shape[:-1], 2 * packed.shape[-1]
        rows = math.prod(lead)
        if not rows or not k or scale.shape != (*lead, -(-k // block)):
            return None
        packed, scale = packed.contiguous(), scale.contiguous()
        out = torch.empty(*lead, k)
        rc = load_library(self.library).mhc_kv_fp4_decode(packed.data_ptr(), scale.data_ptr(), out.data_ptr(), rows, k,
                                                          block, 2 if self.isa >= 2 else 0)
        return None if rc else out

    def index_topk(self, q: Tensor, w: Tensor, packed: Tensor, scale: Tensor, rows: Tensor, closed: Tensor, n: int,
                   topk: int, block: int) -> tuple[Tensor, Tensor] | None:
        """The indexer's scores and top-k over its fp4 key cache in one call (`mhc_index_topk`): q [b, s, h, d] fp32,
        w [b, s, h] fp32, the cache's parts packed uint8 [B, L, d / 2] and scale fp32 [B, L, ceil(d / block)] read at
        rows [b] (int64), entries j < n scored, j < closed [b, s] valid -> (entries int64, valid bool) [b, s,
        min(topk, n)] as `index.select_topk` of `index.index_scores` gives them (the tie rule; the scores within
        rounding: the dot products summed in another order), for decode's few queries (at most MAX_ROWS); None where
        it does not apply (a NaN score included: the caller then takes the reference). In a compiled graph, the op
        whose C++ makes this call (`mhcrun::index_topk_native`, torch_ops.cpp; its Python op `mhcrun::index_topk_cpu`
        takes the reference where the kernel declines)."""
        ts = (q, w, scale)
        if not self.on or q.dim() != 4 or any(t.dtype != torch.float32 or not t.is_cpu for t in ts) \
                or packed.dtype != torch.uint8 or not packed.is_cpu or rows.dtype != torch.int64 \
                or closed.dtype != torch.int64:
            return None
        b, s, h, d = q.shape
        if not 0 < b * s <= MAX_ROWS or packed.dim() != 3 or not 0 < n <= packed.shape[1] or topk < 1 \
                or w.shape != (b, s, h) or rows.shape != (b,) or closed.shape != (b, s) \
                or packed.shape[2] * 2 != d or scale.shape != (*packed.shape[:2], -(-d // block)):
            return None
        if torch.compiler.is_compiling():  # a graph calls the op whose C++ makes this call (torch_ops.cpp)
            return None if not self.ops else tuple(torch.ops.mhcrun.index_topk_native(
                q, w, packed, scale, rows, closed, n, topk, block, self.library, self.isa))
        q, w, packed, scale, rows, closed = (t.contiguous() for t in (q, w, packed, scale, rows, closed))
        kk = min(topk, n)
        entries, valid = torch.empty(b, s, kk, dtype=torch.int64), torch.empty(b, s, kk, dtype=torch.bool)
        rc = load_library(self.library).mhc_index_topk(q.data_ptr(), w.data_ptr(), packed.data_ptr(),
                                                       scale.data_ptr(), rows.data_ptr(), closed.data_ptr(),
                                                       entries.data_ptr(), valid.data_ptr(), b, s, h, d,
                                                       packed.shape[0], packed.shape[1], n, topk, block,
                                                       min(self.isa, 2), torch.get_num_threads())
        return None if rc else (entries, valid)

    def kv_fp4_encode(self, x: Tensor, block: int) -> dict[str, Tensor] | None:
        """mhcrun.ops.kvcache.encode of the fp4 format (indexer keys), bitwise, in one call (`mhc_kv_fp4_encode`): fp32
        CPU x [..., k] (k even) -> {"fp4": packed codes uint8 [..., k / 2], "scale": fp32 [..., ceil(k / block)]} as it
        gives them, for decode's few entries (at most MAX_ROWS * 16); None where it does not apply (non-finite x
        included)."""
        k = x.shape[-1] if x.dim() else 0
        if not self.on or x.dtype != torch.float32 or not x.is_cpu or not k or k % 2:
            return None
        lead = x.shape[:-1]
        rows = math.prod(lead)
        if not rows or rows > MAX_ROWS * 16:
            return None
        x = x.contiguous()
        packed, scale = torch.empty(*lead, k // 2, dtype=torch.uint8), torch.empty(*lead, -(-k // block))
        if load_library(self.library).mhc_kv_fp4_encode(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), rows, k,
                                                        block):
            return None
        return {"fp4": packed, "scale": scale}

    def open_group(self, kv_state: Tensor, score_state: Tensor, rows: Tensor, kv: Tensor, score: Tensor, ape: Tensor,
                   start: Tensor, ratio: int, lead: int) -> bool:
        """A compressor's decode step that closes no group in one call (`mhc_open_group`), bitwise: score + ape[p %
        ratio] (p: each token's position start [b] + [0, s)), then `compress.add_to_open_group` of kv and that score
        into rows `rows` [b] of the state buffers [B, len, c] at slots lead + start % ratio + [0, s). False where it
        does not apply (then nothing was written)."""
        if kv.dim() != 3 or score.shape != kv.shape or not cpu_fp32(kv, score) or not kv.is_contiguous() \
                or not score.is_contiguous() or not self.opens_group(kv_state, score_state, rows, ape, start, kv.shape,
                                                                     ratio):
            return False
        b, s, c = kv.shape
        rows, start = rows.contiguous(), start.contiguous()
        return load_library(self.library).mhc_open_group(
            kv_state.data_ptr(), score_state.data_ptr(), rows.data_ptr(), kv.data_ptr(), score.data_ptr(),
            ape.data_ptr(), start.data_ptr(), b, s, c, kv_state.shape[0], kv_state.shape[1], ratio, lead) == 0

    def opens_group(self, kv_state: Tensor, score_state: Tensor, rows: Tensor, ape: Tensor, start: Tensor,
                    shape: tuple[int, ...], ratio: int) -> bool:
        """Whether `open_group` takes the state buffers, rows, bias and positions for kv and score of `shape` [b, s, c]
        (the kernel on, fp32 contiguous CPU buffers of c channels, int64 rows and start of b)."""
        b, _, c = shape
        return (self.on and cpu_fp32(kv_state, score_state, ape) and kv_state.is_contiguous()
                and score_state.is_contiguous() and ape.is_contiguous() and rows.dtype == torch.int64
                and start.dtype == torch.int64 and kv_state.shape == score_state.shape and kv_state.shape[-1] == c
                and ape.shape == (ratio, c) and rows.numel() == b and start.numel() == b)

    def compress_open(self, x: Tensor, table: Tensor | None, act: tuple[int, int], kv_state: Tensor,
                      score_state: Tensor, rows: Tensor, ape: Tensor, start: Tensor, ratio: int, lead: int) -> bool:
        """`Compressor.forward` of decode tokens that close no group in one call (`mhc_compress_open`: the calls of its
        eager path, its wkv's and wgate's `linear` (act their activation blocks) and `open_group`, in its order, so the
        same values): x [b, s, d] fp32, `table` wkv and wgate (`weight_table`), the rest as `open_group`'s. False
        where it does not apply (then nothing was written)."""
        call = self._compress_open_call(x, table, act, kv_state, score_state, rows, ape, start, ratio, lead)
        if call is None:
            return False
        args, held = call
        rc = load_library(self.library).mhc_compress_open(*args)
        del held  # what the call read: alive through it
        return rc == 0

    def _compress_open_call(self, x: Tensor, table: Tensor | None, act: tuple[int, int], kv_state: Tensor,
                            score_state: Tensor, rows: Tensor, ape: Tensor, start: Tensor, ratio: int,
                            lead: int) -> tuple[list, tuple] | None:
        """`mhc_compress_open`'s arguments for `compress_open`'s (checked) and the tensors whose addresses they hold
        (contiguous copies among them), which the caller keeps until the call returns; None where they do not fit."""
        b, s, d = x.shape if x.dim() == 3 else (0, 0, 0)
        m = b * s
        if table is None or not m or m > MAX_ROWS or self.gemm_first(m) or not cpu_fp32(x):
            return None
        (c, k_kv), (c_gate, k_gate) = table_shapes(table)
        if k_kv != d or k_gate != d or c_gate != c \
                or not self.opens_group(kv_state, score_state, rows, ape, start, (b, s, c), ratio):
            return None
        x, rows, start = x.contiguous(), rows.contiguous(), start.contiguous()
        return ([table.data_ptr(), *act, x.data_ptr(), kv_state.data_ptr(), score_state.data_ptr(), rows.data_ptr(),
                 ape.data_ptr(), start.data_ptr(), b, s, kv_state.shape[0], kv_state.shape[1], ratio, lead, self.isa,
                 torch.get_num_threads()], (x, rows, start))

    def store_entries(self, normed: Tensor, at: Tensor, slot: Tensor, first: Tensor, cos: Tensor, sin: Tensor,
                      rope_dim: int, spin: bool, kind: str, block: int, parts: dict[str, Tensor]) -> bool:
        """A compressor's closed groups, normed [n, hd] fp32, finished and stored in one call (`mhc_store_entries`:
        `rope_tail` at their first positions `first` [n] (the rows of the tables cos, sin [positions, rope_dim / 2]),
        with `spin` `hadamard`, then `kv_fp8_encode` (kind "fp8": the kv cache's format, power-of-two scales, rope_dim
        rope channels) or `kv_fp4_encode` ("fp4": indexer keys), in blocks of `block`, into entry slot [n] of cache
        rows at [n] of `parts` (the cache's), as the compressor's eager calls make them, so the same values). False
        where it does not apply (then nothing was written)."""
        n, hd = normed.shape if normed.dim() == 2 else (0, 0)
        names = {"fp8": ("fp8", "scale", "rope"), "fp4": ("fp4", "scale")}.get(kind)
        if not self.on or not n or n > MAX_ROWS or names is None or set(parts) != set(names) or block < 1 \
                or not cpu_fp32(normed, cos, sin, parts["scale"]) \
                or cos.dim() != 2 or cos.shape[1] * 2 != rope_dim or sin.shape != cos.shape \
                or any(t.dtype != torch.int64 or t.shape != (n,) for t in (at, slot, first)) \
                or not all(p.is_cpu and p.is_contiguous() and p.dim() == 3 for p in parts.values()):
            return False
        width = hd - rope_dim if kind == "fp8" else hd
        n_rows, c_len = parts["scale"].shape[:2]
        want = {"fp8": (width, torch.float8_e4m3fn), "rope": (rope_dim, torch.float32), "fp4": (hd // 2, torch.uint8),
                "scale": (-(-width // block), torch.float32)}
        if any(p.shape != (n_rows, c_len, want[name][0]) or p.dtype != want[name][1] for name, p in parts.items()):
            return False
        normed, cos, sin, at, slot, first = (t.contiguous() for t in (normed, cos, sin, at, slot, first))
        rope = parts.get("rope")
        return load_library(self.library).mhc_store_entries(
            normed.data_ptr(), at.data_ptr(), slot.data_ptr(), first.data_ptr(), n, hd, cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], rope_dim, hd**-0.5 if spin else 0.0, int(kind == "fp4"), parts[names[0]].data_ptr(),
            parts["scale"].data_ptr(), None if rope is None else rope.data_ptr(), n_rows, c_len, block, self.isa) == 0

    def close_group(self, kv_state: Tensor, score_state: Tensor, rows: Tensor, kv: Tensor, score: Tensor,
                    ape: Tensor, start: Tensor, ratio: int, lead: int) -> tuple[Tensor, Tensor] | None:
        """A compressor's decode step in which some row's token closes its group, in one call (`mhc_close_group`):
        one token a row (kv, score [b, 1, c], score before the bias) at positions start [b] >= 1 into distinct state
        rows `rows` [b] of the buffers [B, lead + ratio, c]; -> (pooled [b, c / (2 if lead else 1)], closed [b] bool:
        the rows whose group closed, their pooled group; zeros elsewhere), the state as `compress.compress_chunk`
        leaves it (the pooling within rounding of its softmax and sum). None where it does not apply (no row closes
        included; then nothing was written)."""
        return self._step_call("mhc_close_group", kv_state, score_state, rows, kv, score, ape, start, ratio, lead)

    def compress_step(self, kv_state: Tensor, score_state: Tensor, rows: Tensor, kv: Tensor, raw: Tensor, ape: Tensor,
                      start: Tensor, ratio: int, overlap: bool) -> tuple[Tensor, Tensor] | None:
        """A compressor's step of the static path (`Compressor.forward`; one token a row, kv and raw [b, 1, c], raw
        before its bias ape, every row at a position start [b] >= 1) in one call (`mhc_compress_step`: `close_group`
        where some row's token closes its group, else `open_group`) -> (pooled [b, c / (2 if overlap else 1)], zeros
        where no group closed; closed [b] bool), the state rows as `compress.compress_step` leaves them (the pooling
        within rounding of it): only the groups that close are pooled. None where it does not apply (nothing
        written). In a compiled graph, the op whose C++ makes the same call (`mhcrun::compress_step_native`,
        torch_ops.cpp; its Python op `mhcrun::compress_step_cpu` takes the reference where the kernel declines)."""
        if not self.on or kv.dim() != 3 or kv.shape[1] != 1 or start.dim() != 1:
            return None
        if torch.compiler.is_compiling():  # a graph calls the op whose C++ makes this call (torch_ops.cpp)
            return None if not self.ops else tuple(torch.ops.mhcrun.compress_step_native(
                kv_state, score_state, rows, kv, raw, ape, start, ratio, overlap, self.library, self.isa))
        return self._step_call("mhc_compress_step", kv_state, score_state, rows, kv, raw, ape, start, ratio,
                               ratio if overlap else 0)

    def _step_call(self, name: str, kv_state: Tensor, score_state: Tensor, rows: Tensor, kv: Tensor, score: Tensor,
                   ape: Tensor, start: Tensor, ratio: int, lead: int) -> tuple[Tensor, Tensor] | None:
        """`close_group` or `compress_step` by the kernel's entry point `name` (their arguments and results), or None
        where the arguments do not fit or the kernel declines (nothing written)."""
        ts = (kv_state, score_state, kv, score, ape)
        if not self.on or any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in ts) \
                or rows.dtype != torch.int64 or start.dtype != torch.int64 or kv.dim() != 3 or kv.shape[1] != 1 \
                or score.shape != kv.shape or kv_state.shape != score_state.shape or kv_state.dim() != 3 \
                or kv_state.shape[-1] != kv.shape[-1] or ape.shape != (ratio, kv.shape[-1]) \
                or rows.shape != (kv.shape[0],) or start.shape != (kv.shape[0],):
            return None
        b, _, c = kv.shape
        rows, start = rows.contiguous(), start.contiguous()
        pooled, closed = torch.empty(b, c // 2 if lead else c), torch.empty(b, dtype=torch.bool)
        rc = getattr(load_library(self.library), name)(
            kv_state.data_ptr(), score_state.data_ptr(), rows.data_ptr(), kv.data_ptr(), score.data_ptr(),
            ape.data_ptr(), start.data_ptr(), pooled.data_ptr(), closed.data_ptr(), b, c, kv_state.shape[0],
            kv_state.shape[1], ratio, lead)
        return None if rc else (pooled, closed)

    def greedy(self, logits: Tensor) -> tuple[list[tuple[int, str]], Tensor] | None:
        """`mhcrun.generate.nonfinite_rows(logits)` and the argmax of each row (torch's: the first of equal largest
        values) in one call (`mhc_greedy`), for fp32 CPU logits [b, V] -> (the non-finite rows as nonfinite_rows gives
        them, ids [b] int64: a non-finite row's unspecified); None where it does not apply."""
        if not self.on or logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cpu \
                or not logits.shape[0] or not logits.shape[1]:
            return None
        logits = logits.contiguous()
        b, v = logits.shape
        ids, kind = torch.empty(b, dtype=torch.int64), torch.empty(b, dtype=torch.uint8)
        if load_library(self.library).mhc_greedy(logits.data_ptr(), b, v, ids.data_ptr(), kind.data_ptr(),
                                                 min(self.isa, 2)):
            return None
        return [(i, "NaN" if k == 1 else "Inf") for i, k in enumerate(kind.tolist()) if k], ids

    def window_mask(self, start: Tensor, s: int, window: int) -> Tensor | None:
        """mhcrun.ops.attention.window_mask(start, s, window) in one call (`mhc_window_mask`), for a CPU int64 start
        of decode's few rows and chunks; None where it does not apply."""
        if not self.on or start.dtype != torch.int64 or not start.is_cpu or start.dim() != 1 \
                or start.numel() * s > MAX_ROWS or s < 1 or window < 1:
            return None
        start = start.contiguous()
        out = torch.empty(start.numel(), s, window + s, dtype=torch.bool)
        load_library(self.library).mhc_window_mask(start.data_ptr(), out.data_ptr(), start.numel(), s, window)
        return out

    def kv_fp8_encode(self, x: Tensor, rope_dim: int, block: int) -> dict[str, Tensor] | None:
        """mhcrun.ops.kvcache.encode of the fp8 format with power-of-two scales, bitwise, in one call
        (`mhc_kv_fp8_encode`): fp32 CPU x [..., nope + rope_dim] -> {"fp8": codes, "scale", "rope"} as it gives them,
        for decode's few entries (at most MAX_ROWS * 16); None where it does not apply (non-finite x included)."""
        if not self.on or x.dtype != torch.float32 or not x.is_cpu or not 0 <= rope_dim < x.shape[-1]:
            return None
        lead, nope = x.shape[:-1], x.shape[-1] - rope_dim
        rows = math.prod(lead)
        if not rows or rows > MAX_ROWS * 16:
            return None
        x = x.contiguous()
        codes = torch.empty(*lead, nope, dtype=torch.uint8)
        scale, rope = torch.empty(*lead, -(-nope // block)), torch.empty(*lead, rope_dim)
        if load_library(self.library).mhc_kv_fp8_encode(x.data_ptr(), codes.data_ptr(), scale.data_ptr(),
                                                        rope.data_ptr(), rows, nope, block, rope_dim):
            return None
        return {"fp8": codes.view(torch.float8_e4m3fn), "scale": scale, "rope": rope}


KERNEL_OFF = CpuKernel(why="off: no run opened it")  # every GEMM takes torch's path


def open_cpu_kernel(env: Env) -> CpuKernel:
    """The kernel as `env` asks for it: built (once per source and compiler) and loaded, capped at the
    instruction set MHCRUN_CPU_KERNEL names (`CAPS`: amx / avx512bf16 / avx512 / avx2, capped by what this CPU has;
    0: off), else this CPU's default: its best, but GEMVs in avx512 rather than avx512bf16 where the CPU is neither
    AMD's nor has AMX (`mhc_qgemv_default_isa` says why); prefill chunks by AMX tiles where the CPU and the cap
    allow them, else by the BF16 dot products where the GEMVs take them. Off, saying why, where it cannot run."""
    if env.cpu_kernel == "0":
        return CpuKernel(why="off (MHCRUN_CPU_KERNEL=0)")
    try:
        path = str(native.build(SOURCE, env.kernel_cache, env.cxx))
        lib = load_library(path)
        best, default, amx = lib.mhc_qgemv_isa(), lib.mhc_qgemv_default_isa(), lib.mhc_qgemm_amx()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return CpuKernel(why=f"off: not built ({e})")
    if not best:
        return CpuKernel(why="off: this CPU lacks AVX2/AVX-512 with F16C and FMA")
    cap = CAPS.get(env.cpu_kernel, CAPS["amx"])
    isa = min(cap, best) if env.cpu_kernel in CAPS else default
    gemm = GEMMS["amx"] if amx and cap >= GEMMS["amx"] else GEMMS["avx512bf16"] if isa == ISAS["avx512bf16"] else 0
    return CpuKernel(path, isa, gemm=gemm, ops=load_torch_ops(env), reads_ahead=not env.threads_sleep)


def load_torch_ops(env: Env) -> str:
    """The kernel's GEMVs, post+pre step, attention, indexer top-k and compressor step as C++ kernels of torch's
    dispatcher (torch_ops.cpp: `mhcrun::qgemv_native`, `mhcrun::qgemv_expert_set_native`,
    `mhcrun::hc_post_pre_native`, `mhcrun::attend_native`, `mhcrun::index_topk_native`,
    `mhcrun::compress_step_native`), built for this torch (once per source, compiler and torch) and loaded into the
    process: the library's path, or "" where they cannot be built (compiled graphs then call the GEMVs' Python ops,
    and the torch reference for the rest)."""
    try:
        path = str(native.build(TORCH_OPS, env.kernel_cache, env.cxx, native.torch_flags()))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return ""
    if not hasattr(torch.ops.mhcrun, "qgemv_native"):  # once a process: another build would define them twice
        # opened with its symbols global first: the graphs' C++ wrappers call the ops' C shims by name
        # (`mhcrun.regions.shims`), resolved when each wrapper is loaded
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        torch.ops.load_library(path)
        for name, shape in NATIVE_OPS.items():
            torch.library.register_fake(f"mhcrun::{name}")(shape)
    return path


def post_pre_shape(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                   weight: Tensor, iters: int, eps: float, norm_eps: float, library: str,
                   isa: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What `mhcrun::hc_post_pre_cpu` (and its C++ kernel) gives, empty: the streams like residual [..., n, d], h like
    y [..., d], post [..., n] and comb [..., n, n] fp32 (fake kernel)."""
    f32 = torch.float32
    return (residual.new_empty(residual.shape), y.new_empty(y.shape), post.new_empty(post.shape, dtype=f32),
            comb.new_empty(comb.shape, dtype=f32))


def attend_shape(q: Tensor, kv: Tensor, mask: Tensor, sink: Tensor, scale: float, sel: Tensor | None,
                 sel_mask: Tensor | None, library: str, isa: int) -> Tensor:
    """What `mhcrun::attend_cpu` (and its C++ kernel) gives, empty: o like q [b, s, h, d] fp32 (fake kernel)."""
    return q.new_empty(q.shape, dtype=torch.float32)


def compress_step_shape(kv_state: Tensor, score_state: Tensor, rows: Tensor, kv: Tensor, raw: Tensor, ape: Tensor,
                        start: Tensor, ratio: int, overlap: bool, library: str, isa: int) -> tuple[Tensor, Tensor]:
    """What `mhcrun::compress_step_cpu` (and its C++ kernel) gives, empty: pooled [b, c / (2 if overlap else 1)] fp32
    and closed [b] bool for kv [b, 1, c] (fake kernel)."""
    b, c = kv.shape[0], kv.shape[-1]
    return kv.new_empty(b, c // 2 if overlap else c, dtype=torch.float32), kv.new_empty(b, dtype=torch.bool)


def index_topk_shape(q: Tensor, w: Tensor, packed: Tensor, scale: Tensor, rows: Tensor, closed: Tensor, n: int,
                     topk: int, block: int, library: str, isa: int) -> tuple[Tensor, Tensor]:
    """What `mhcrun::index_topk_cpu` (and its C++ kernel) gives, empty: entries int64 and valid bool [b, s,
    min(topk, n)] for q [b, s, h, d] (fake kernel)."""
    lead = (*q.shape[:2], min(topk, n))
    return q.new_empty(lead, dtype=torch.int64), q.new_empty(lead, dtype=torch.bool)


def qgemv_shape(x3: Tensor, data: Tensor, scale: Tensor | None, block: int, groups: int, library: str,
                isa: int) -> Tensor:
    """What `mhcrun::qgemv` (and its C++ kernel) gives, empty: [M, G, out / G] fp32 for x3 [M, G, in] (fake kernel)."""
    return x3.new_empty(x3.shape[0], groups, data.shape[0] // groups, dtype=torch.float32)


def expert_set_shape(x: Tensor, ptrs: Tensor, idx: Tensor, fmt: int, kind: int, block: int, out_features: int,
                     in_features: int, library: str, isa: int) -> Tensor:
    """What `mhcrun::qgemv_expert_set` (and its C++ kernel) gives, empty: [B, k, out] fp32 for idx [B, k]."""
    return x.new_empty(*idx.shape, out_features, dtype=torch.float32)


@functools.cache
def load_library(path: str) -> ctypes.CDLL:
    """The kernel's shared library at `path`, its entry points typed (loaded once per process)."""
    lib = ctypes.CDLL(path)
    lib.mhc_qgemv_isa.restype = ctypes.c_int
    lib.mhc_qgemv_default_isa.restype = ctypes.c_int
    lib.mhc_qgemm_bf16.restype = ctypes.c_int
    lib.mhc_qgemm_bf16.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int]
    lib.mhc_qgemm_amx.restype = ctypes.c_int
    lib.mhc_takes_bf16.restype = ctypes.c_int
    lib.mhc_takes_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.mhc_panels_take.restype = ctypes.c_int
    lib.mhc_panels_take.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.mhc_takes_int.restype = ctypes.c_int
    lib.mhc_takes_int.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.mhc_int_x.restype = ctypes.c_int
    lib.mhc_int_x.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int] + [
        ctypes.c_void_p] * 3
    lib.mhc_qgemv.restype = ctypes.c_int
    lib.mhc_qgemv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
    lib.mhc_qlinear.restype = ctypes.c_int
    lib.mhc_qlinear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
    lib.mhc_qgemv_experts.restype = ctypes.c_int
    lib.mhc_qgemv_experts.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_int] * 2
    lib.mhc_decode_rows.restype = ctypes.c_int
    lib.mhc_decode_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + \
        [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
    lib.mhc_act_quant_fp8.restype = ctypes.c_int
    lib.mhc_act_quant_fp8.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.mhc_hc_post.restype = ctypes.c_int
    lib.mhc_hc_post.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.mhc_attend.restype = ctypes.c_int
    lib.mhc_attend.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
    lib.mhc_open_group.restype = ctypes.c_int
    lib.mhc_open_group.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
    lib.mhc_moe_routed.restype = ctypes.c_int
    lib.mhc_moe_routed.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int] + \
        [ctypes.c_void_p] * 4 + \
        [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.mhc_rms_norm.restype = ctypes.c_int
    lib.mhc_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.mhc_rope_tail.restype = ctypes.c_int
    lib.mhc_rope_tail.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    lib.mhc_attn_project.restype = ctypes.c_int
    lib.mhc_attn_project.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + \
        [ctypes.c_float] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    lib.mhc_moe_step.restype = ctypes.c_int
    lib.mhc_moe_step.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_float] + \
        [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int64] * 2 + \
        [ctypes.c_int] * 2
    lib.mhc_compress_open.restype = ctypes.c_int
    lib.mhc_compress_open.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 6 + \
        [ctypes.c_int64] * 6 + [ctypes.c_int] * 2
    lib.mhc_hadamard.restype = ctypes.c_int
    lib.mhc_hadamard.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.mhc_index_queries.restype = ctypes.c_int
    lib.mhc_index_queries.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + \
        [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int64] + [ctypes.c_int] * 2
    lib.mhc_finish.restype = ctypes.c_int
    lib.mhc_finish.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_float] * 2 + [ctypes.c_void_p, ctypes.c_float] + \
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.mhc_store_entries.restype = ctypes.c_int
    lib.mhc_store_entries.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + \
        [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + \
        [ctypes.c_int]
    lib.mhc_attn_output.restype = ctypes.c_int
    lib.mhc_attn_output.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + \
        [ctypes.c_int] * 2
    lib.mhc_kv_fp8_decode.restype = ctypes.c_int
    lib.mhc_kv_fp8_decode.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int]
    lib.mhc_kv_fp8_encode.restype = ctypes.c_int
    lib.mhc_kv_fp8_encode.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    lib.mhc_fp4_simulate.restype = ctypes.c_int
    lib.mhc_fp4_simulate.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.mhc_kv_fp4_decode.restype = ctypes.c_int
    lib.mhc_kv_fp4_decode.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.mhc_index_topk.restype = ctypes.c_int
    lib.mhc_index_topk.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 9 + [ctypes.c_int] * 2
    lib.mhc_close_group.restype = ctypes.c_int
    lib.mhc_close_group.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 6
    lib.mhc_compress_step.restype = ctypes.c_int
    lib.mhc_compress_step.argtypes = lib.mhc_close_group.argtypes
    lib.mhc_attend_decode.restype = ctypes.c_int
    lib.mhc_attend_decode.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_int64] * 9 + [ctypes.c_float] + \
        [ctypes.c_int] * 2
    lib.mhc_attend_output.restype = ctypes.c_int
    lib.mhc_attend_output.argtypes = lib.mhc_attend_decode.argtypes[:13] + lib.mhc_attend_decode.argtypes[14:] + \
        lib.mhc_attn_output.argtypes[:2] + lib.mhc_attn_output.argtypes[3:]
    lib.mhc_open_attend_output.restype = ctypes.c_int
    lib.mhc_open_attend_output.argtypes = lib.mhc_compress_open.argtypes + lib.mhc_attend_output.argtypes
    lib.mhc_route.restype = ctypes.c_int
    lib.mhc_route.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_float] + \
        [ctypes.c_int] * 2
    lib.mhc_kv_fp4_encode.restype = ctypes.c_int
    lib.mhc_kv_fp4_encode.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.mhc_greedy.restype = ctypes.c_int
    lib.mhc_greedy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int]
    lib.mhc_window_mask.restype = ctypes.c_int
    lib.mhc_window_mask.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
    lib.mhc_hc_post_pre.restype = ctypes.c_int
    lib.mhc_hc_post_pre.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 12 + [ctypes.c_int64] * 4 + \
        [ctypes.c_float] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.mhc_ffn_half.restype = ctypes.c_int
    lib.mhc_ffn_half.argtypes = lib.mhc_hc_post_pre.argtypes + lib.mhc_moe_step.argtypes
    lib.mhc_hc_pre.restype = ctypes.c_int
    lib.mhc_hc_pre.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + \
        [ctypes.c_float] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.mhc_scope_new.restype = ctypes.c_void_p
    lib.mhc_scope_free.argtypes = [ctypes.c_void_p]
    lib.mhc_scope_read_ahead.restype = ctypes.c_int64
    lib.mhc_scope_read_ahead.argtypes = [ctypes.c_void_p]
    lib.mhc_run_step.restype = ctypes.c_int
    lib.mhc_run_step.argtypes = [ctypes.c_void_p, STEP, ctypes.c_int]
    return lib


STEP = ctypes.CFUNCTYPE(None)  # a step, as mhc_run_step calls it


class StepScope:
    """Decode steps run each in one parallel region of the kernel (qgemv.cpp, "a decode step in one parallel region"):
    the step on this thread, the kernel's loops shared with the region's other threads, the first of which reads the
    weights of each call's successor ahead (a GEMV's, a site's mHC mixes, the router's), in the gaps between the calls
    (what followed each call is kept from step to step: a scope reads the weights of the calls made through it, so it
    must not outlive them: one lives with a run's `Stepper`). `run(fn)` -> fn()'s result, or its exception raised
    again once the region has ended. Not made where idle OpenMP threads sleep (`CpuKernel.reads_ahead`:
    OMP_WAIT_POLICY=passive), since its workers spin."""

    def __init__(self, library: str, threads: int):
        self.lib, self.threads = load_library(library), threads
        self.handle = self.lib.mhc_scope_new()
        if not self.handle:
            raise MemoryError("mhc_scope_new")
        self.free = weakref.finalize(self, self.lib.mhc_scope_free, self.handle)  # once: when collected or at exit

    def run(self, fn: Callable[[], Any]) -> Any:
        out: list = []
        err: list[BaseException] = []

        def step() -> None:
            try:
                out.append(fn())
            except BaseException as e:  # raised again below: a callback's exception would be lost in ctypes
                err.append(e)

        self.lib.mhc_run_step(self.handle, STEP(step), self.threads)
        if err:
            raise err[0]
        return out[0]

    def read_ahead(self) -> int:
        """The bytes this scope's steps have read ahead, in all."""
        return self.lib.mhc_scope_read_ahead(self.handle)


# ---------------------------------------------------------------- routed experts read in place


@dataclass(frozen=True)
class ExpertSet:
    """One weight (w1, w2 or w3) of each of a layer's routed experts where it lies, for
    `mhcrun::qgemv_expert_set`: the addresses of each expert's bytes and scales, and the layout they share. It
    holds no reference to the weights: the layer that holds them keeps them alive."""

    ptrs: Tensor  # [E, 2] int64: each expert's data_ptr() and its scales' data_ptr()
    fmt: int  # FORMATS: fp8 or fp4
    kind: int  # the scales: 0 e8m0 bytes, 1 fp32
    block: int
    out_features: int
    in_features: int


def route_bytes(d: int, inter: int) -> int:
    """A routed call's transients a route (qgemv.cpp's `mhc_moe_routed`): x as integers (two int16 windows: 4d), w1's
    and w3's results (8 inter), h as integers (4 inter), w2's results and the k sums' inputs (8d)."""
    return 12 * (d + inter)


def routed_result(rc: int, y: Tensor, ids: Tensor, experts: int) -> Tensor | None:
    """A routed-expert call's y, None where the kernel declined (rc not 0), or the ValueError of an index outside the
    set (RC_EXPERT)."""
    if rc == RC_EXPERT:
        raise ValueError(f"routed expert indices {ids.tolist()} reach outside the {experts} experts")
    return None if rc else y


def weight_table(*weights: QWeight) -> Tensor | None:
    """The weights as the layer-step entry points read them (qgemv.cpp's WEIGHT_FIELDS a weight: format, the bytes' and
    the scales' addresses, scale kind, out and in features, block) -> int64 [len(weights), 7], or None unless the kernel
    takes every one (`QWeight.kernel`). The weights hold the bytes: they must outlive the table."""
    if not all(w.kernel for w in weights):
        return None
    return torch.tensor([[o.fmt, o.data, o.scale or 0, o.fp32_scale, o.out_features, o.in_features, w.block]
                         for w in weights for o in (w.operands,)], dtype=torch.int64)


def moe_table(routed: tuple[ExpertSet, ...], shared: tuple[ExpertSet, ...], d: int) -> Tensor | None:
    """The routed experts' sets w1, w3, w2 and the shared expert's as `mhc_moe_step` reads them -> int64 [2, 8]: per
    group, the addresses of the sets' [experts, 2] tables, format, scale kind, experts, inter, block; None unless each
    group's three sets share a layout and fit together (as `moe_routed` asks) on rows of d values. The sets hold the
    addresses: they must outlive the table."""
    rows = []
    for w1, w3, w2 in (routed, shared):
        sets = (w1, w3, w2)
        if len({(s.fmt, s.kind, s.block, s.ptrs.shape) for s in sets}) != 1 or w1.out_features != w3.out_features \
                or w2.in_features != w1.out_features or w1.in_features != d or w2.out_features != d \
                or not all(s.ptrs.dtype == torch.int64 and s.ptrs.is_contiguous() for s in sets):
            return None
        rows.append([*(s.ptrs.data_ptr() for s in sets), w1.fmt, w1.kind, w1.ptrs.shape[0], w1.out_features, w1.block])
    return torch.tensor(rows, dtype=torch.int64)


def table_shapes(table: Tensor) -> list[tuple[int, int]]:
    """Each weight's (out, in) features as a `weight_table` holds them."""
    return [(row[4], row[5]) for row in table.tolist()]


def cpu_fp32(*ts: Tensor) -> bool:
    """Whether every tensor is an fp32 CPU tensor."""
    for t in ts:
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return True


def check_routes(s: ExpertSet, idx: Tensor, width: int) -> None:
    """ValueError unless x of `width` inputs fits the set's experts; the C++ side checks idx against the set."""
    if width != s.in_features:
        raise ValueError(f"routed experts take {s.in_features} inputs a row, not {width}")


def expert_set(weights: list[QWeight]) -> ExpertSet | None:
    """The set of these experts' weights, in expert order, or None unless the kernel takes every one where it lies:
    fp8 / fp4 of one shape, dtype and block, contiguous scales of one dtype."""
    first = weights[0]
    if first.fmt == "float" or not all(_same_layout(w, first) for w in weights):
        return None
    ptrs = torch.tensor([[w.data.data_ptr(), w.scale.data_ptr()] for w in weights], dtype=torch.int64)
    return ExpertSet(ptrs, FORMATS[first.fmt], first.operands.fp32_scale, first.block, first.out_features,
                     first.in_features)


# torch_ops.cpp's ops (`mhcrun::<name>`), each with its fake kernel (the shapes it gives) and a C shim
# (`aoti_torch_cpu_<name>`) that compiled graphs' C++ wrappers call (`mhcrun.regions.shims`)
NATIVE_OPS = {"qgemv_native": qgemv_shape, "qgemv_expert_set_native": expert_set_shape,
              "hc_post_pre_native": post_pre_shape, "attend_native": attend_shape,
              "index_topk_native": index_topk_shape, "compress_step_native": compress_step_shape}


def _same_layout(w: QWeight, first: QWeight) -> bool:
    return (w.kernel and w.data.shape == first.data.shape and w.data.dtype == first.data.dtype
            and w.block == first.block and w.scale.dtype == first.scale.dtype and w.scale.is_contiguous())
