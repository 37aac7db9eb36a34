"""Load a model for running: resolve the path, check the checkpoint from its headers, plan its memory, then
map the weights and build the model."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mhcrun.checkpoint import (
    CheckpointPlan,
    LoadedCheckpoint,
    checkpoint_weights_hash,
    load_checkpoint,
    plan_checkpoint,
)
from mhcrun.config import ModelConfig, check_layers
from mhcrun.errors import InputError
from mhcrun.heap import heap_pages, pages, set_heap_policy, thp_mode
from mhcrun.hugepages import place, why_not
from mhcrun.memory import MemoryPlan, plan_memory, weight_bytes
from mhcrun.model import Transformer, build_model
from mhcrun.nki.ops import HcBackend
from mhcrun.ops.qgemv import KERNEL_OFF, open_cpu_kernel
from mhcrun.ops.qlinear import ScaledMM
from mhcrun.ops.scan import open_scan
from mhcrun.parallel import SINGLE, Shard
from mhcrun.settings import DEVICES, Env, check_choice
from mhcrun.tokenizer import Tokenizer
from mhcrun.vml import settle_vector_math

DEFAULT_MODEL = Path(__file__).parent / "data" / "tiny"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Runner:
    """A checked checkpoint and its tokenizer; `load` maps the weights and builds `model`."""

    path: Path
    plan: CheckpointPlan
    tokenizer: Tokenizer | None
    dtype: str
    quant_sim: bool
    device: str = "cpu"
    layers: int | None = None  # run the first N layers (then the head); None = all
    dequantize: bool = False  # fp32 copies of FP8/FP4 weights instead of keeping them quantised
    tp: Shard = SINGLE  # under --tp: this rank, which maps and runs its share only
    env: Env = field(default_factory=Env)  # the environment, as the command read it
    warned_chat_tokens: bool = False  # said once: its tokenizer lacks the chat format's tokens
    mtp: bool = False  # load and build the first MTP layer too (speculative decoding, `mhcrun.speculate`)
    weight_pages: str = ""  # the pages the loaded weights are on: "2 MB pages" or "4 KB pages (why)" (`hugepages`)
    heap_pages: str = ""  # and those the process's heap is on (`heap`)
    ckpt: LoadedCheckpoint | None = None
    model: Transformer | None = None

    @property
    def config(self) -> ModelConfig:
        return self.plan.config

    @property
    def n_layers(self) -> int:
        return self.layers or self.config.n_layers

    @functools.cached_property
    def scan(self) -> ctypes.CDLL | None:
        """scan.cpp's library for checking the weights (`mhcrun.ops.scan`), opened on first use; None: torch's."""
        return open_scan(self.env)

    @functools.cached_property
    def identity(self) -> dict:
        """What a golden file records to name the model it was made with (hashed once, on first use)."""
        name = "tiny" if self.path.resolve() == DEFAULT_MODEL.resolve() else self.path.name
        shards = [Path(name) for name in self.plan.shards]
        return {"name": name, "config_hash": self.config.fingerprint(),
                "weights_hash": checkpoint_weights_hash(self.plan.root, shards)}

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InputError(f"{self.path}: no tokenizer.json, so text prompts cannot be encoded "
                             f"(use --prompt-ids)")
        return self.tokenizer

    def memory_plan(self, batch: int, context: int, prompt_len: int | None = None,
                    available: int | None = None, prefill_chunk: int | None = None) -> MemoryPlan:
        return plan_memory(self.plan, self.n_layers, batch, context, prompt_len, DTYPES[self.dtype],
                           self.dequantize, available, prefill_chunk, self.quant_sim, self.mtp)

    def load(self, progress: Callable[[int, int], None] | None = None) -> Transformer:
        """Map the shards (or dequantise them) and build the model."""
        settle_vector_math()  # before any of torch's threads share a first call into MKL's vector math (`vml`)
        if self.device == "cpu":  # loading frees big transients between the tensors it keeps: return them
            set_heap_policy(mmap_above=1 << 20)
        # every decode step streams every weight: on a CPU, on 2 MB pages where the kernel has them (`hugepages`)
        # (under --tp the ranks share the machine: each copies its share, and the check counts all of them)
        why = why_not(self.tp.world * weight_bytes(self.plan, DTYPES[self.dtype], self.dequantize),
                      self.env.huge_pages) if self.device == "cpu" else "not a CPU run"
        self.weight_pages = pages(why)
        self.heap_pages = heap_pages(self.env.huge_pages, self.env.glibc_tunables, thp_mode()) \
            if self.device == "cpu" else "not a CPU run"
        self.ckpt = load_checkpoint(self.path, self.layers, progress, self.dequantize, self.tp, self.mtp, self.scan,
                                    place if why is None else None)
        c = self.ckpt
        self.model = build_model(c.config, c.tensors, c.quantized, DTYPES[self.dtype], self.layers, self.device,
                                 self.tp, self.mtp)
        self.model.opts.quant_sim = self.quant_sim
        self.model.opts.scaled_mm = ScaledMM() if self.env.scaled_mm else None
        # the fused GEMV kernel (and the mHC steps of decode rows), on a CPU: built (first run only) and loaded now,
        # not inside prefill
        cpu = open_cpu_kernel(self.env) if self.device == "cpu" else KERNEL_OFF
        self.model.opts.hc = HcBackend(self.env.hc_torch, self.env.nki_sim, cpu=cpu)  # also opts.cpu, the GEMVs'
        if self.tp.world > 1:  # every rank holds its share before any rank says or runs anything
            torch.distributed.barrier()
        if self.device == "cpu":  # decode reuses the same buffers every step: keep them
            set_heap_policy(mmap_above=32 << 20, keep_free=256 << 20)
        return self.model


def resolve_model_path(model: str | None) -> Path:
    """None or 'tiny' -> the bundled tiny model; otherwise a checkpoint directory that must exist."""
    if model is None or model == "tiny":
        return DEFAULT_MODEL
    p = Path(model)
    if not p.exists():
        raise InputError(f"model {model!r} not found: no such directory (give a checkpoint directory, "
                         f"or leave --model out for the bundled tiny model)")
    if not p.is_dir():
        raise InputError(f"model {model!r} is not a directory (a checkpoint directory holds config.json, "
                         f"the index and the shards)")
    return p


def check_device(device: str) -> None:
    """A device that cannot be used here is a one-line error, before anything loads."""
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available on this machine")
    if device == "neuron":
        try:
            import torch_neuronx  # noqa: F401  (registers the neuron device; only on this path)
        except ImportError:
            raise InputError("--device neuron needs torch-neuronx from AWS's Neuron pip repository "
                             "(PyPI has placeholder packages only)") from None


def open_runner(model: str | None, dtype: str = "fp32", quant_sim: bool = True, device: str = "cpu",
                layers: int | None = None, dequantize: bool = False, tp: Shard = SINGLE,
                env: Env | None = None, mtp: bool = False) -> Runner:
    """Check everything that can be checked before loading: options, config, index, shard headers (with `mtp`,
    the MTP layer's too)."""
    check_choice("--dtype", dtype, tuple(DTYPES))
    check_choice("--device", device, DEVICES)
    check_device(device)
    path = resolve_model_path(model)
    if layers is not None:
        from mhcrun.config import load_config

        check_layers(layers, load_config(path), path)
    plan = plan_checkpoint(path, layers, tp, mtp)
    tok_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_file) if tok_file.exists() else None
    return Runner(path, plan, tokenizer, dtype, quant_sim, device, layers, dequantize, tp, env or Env(), mtp=mtp)


def load_runner(model: str | None, dtype: str = "fp32", quant_sim: bool = True, device: str = "cpu",
                layers: int | None = None, dequantize: bool = False,
                progress: Callable[[int, int], None] | None = None, tp: Shard = SINGLE, mtp: bool = False,
                env: Env | None = None) -> Runner:
    runner = open_runner(model, dtype, quant_sim, device, layers, dequantize, tp, env, mtp)
    runner.load(progress)
    return runner
