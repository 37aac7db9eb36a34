"""C shims of mhcrun's ops for the graphs' C++ wrappers.

A graph that inductor compiles with a C++ wrapper calls a custom op through torch's dispatcher: a stack of IValues
built and unboxed a call, and the dispatcher's and IValue's headers and code compiled into every wrapper. Given the
op's C shim (inductor's `aot_inductor.custom_ops_to_c_shims`), the wrapper calls that C function instead, with tensor
handles. torch_ops.cpp defines `aoti_torch_cpu_<op>` for each of its ops (`mhcrun.ops.qgemv.NATIVE_OPS`); its library
is opened with its symbols global (`load_torch_ops`), so a wrapper finds them when it is loaded; the declaration
inductor writes into the wrapper follows from the op's schema, by inductor's calling convention (`C_TYPES`).
"""

from __future__ import annotations

import torch

from mhcrun.ops.qgemv import NATIVE_OPS

# how inductor passes an argument of each schema type to a C shim (its outputs: a tensor handle written through a
# pointer, one a return)
C_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t",
           "float": "double", "bool": "int32_t", "str": "const char*"}


def declaration(name: str, schema: torch.FunctionSchema) -> str:
    """The C declaration of op `name`'s shim, from its schema."""
    if any(str(r.type) != "Tensor" for r in schema.returns):
        raise TypeError(f"mhcrun::{name}: a C shim returns tensors only")
    args = [f"{C_TYPES[str(a.type)]} {a.name}" for a in schema.arguments]
    outs = [f"AtenTensorHandle* out{i}" for i in range(len(schema.returns))]
    return f"AOTITorchError aoti_torch_cpu_{name}({', '.join(args + outs)})"


class ShimTable(dict):
    """op -> [its shim's declaration], as inductor reads it. Its compile cache keys pickle inductor's settings, and an
    op does not pickle: this table pickles (and hashes into a key) as its declarations, which say all it holds."""

    def __reduce__(self):
        return str, ("\n".join(sorted(d for decls in self.values() for d in decls)),)

    def __deepcopy__(self, memo: dict) -> ShimTable:  # read only: inductor copies its settings into each key
        return self


def c_shims() -> ShimTable:
    """inductor's `custom_ops_to_c_shims` for torch_ops.cpp's ops (loaded: `load_torch_ops`)."""
    ops = {name: getattr(torch.ops.mhcrun, name).default for name in NATIVE_OPS}
    return ShimTable({op: [declaration(name, op._schema)] for name, op in ops.items()})
