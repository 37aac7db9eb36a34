"""Load a model for running: resolve the path, read and check the checkpoint, build the model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mhcrun.checkpoint import LoadedCheckpoint, load_checkpoint
from mhcrun.errors import InputError
from mhcrun.model import Transformer, build_model
from mhcrun.tokenizer import Tokenizer

DEFAULT_MODEL = Path(__file__).parent / "data" / "tiny"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRAPH_MODES = ("eager", "regions")
STAGE_PLANS = ("whole", "split")
DEVICES = ("cpu", "cuda", "neuron")


@dataclass
class Runner:
    path: Path
    ckpt: LoadedCheckpoint
    model: Transformer
    tokenizer: Tokenizer | None
    dtype: str
    quant_sim: bool

    @property
    def identity(self) -> dict:
        """What a golden file records to name the model it was made with."""
        name = "tiny" if self.path.resolve() == DEFAULT_MODEL.resolve() else self.path.name
        return {"name": name, "config_hash": self.ckpt.config.fingerprint(), "weights_hash": self.ckpt.weights_hash}

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InputError(f"{self.path}: no tokenizer.json, so text prompts cannot be encoded "
                             f"(use --prompt-ids)")
        return self.tokenizer


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


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InputError(f"unknown {what} {value!r} (choose from: {', '.join(choices)})")
    return value


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


def load_runner(model: str | None, dtype: str = "fp32", quant_sim: bool = True, device: str = "cpu") -> Runner:
    check_choice("--dtype", dtype, tuple(DTYPES))
    check_choice("--device", device, DEVICES)
    check_device(device)
    path = resolve_model_path(model)
    ckpt = load_checkpoint(path)
    net = build_model(ckpt.config, ckpt.tensors, ckpt.quantized, DTYPES[dtype], device=device)
    net.opts.quant_sim = quant_sim
    tok_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_file) if tok_file.exists() else None
    return Runner(path, ckpt, net, tokenizer, dtype, quant_sim)
