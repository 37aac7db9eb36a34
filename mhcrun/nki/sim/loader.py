"""Load kernel source written for the real ``nki`` package so that it runs on the simulator, unchanged.

The source's ``import nki`` / ``import nki.language as nl`` / ``import nki.isa as nisa`` lines bind to the
simulator because the simulator's modules sit in ``sys.modules`` under those names while the source executes;
whatever was there before (a real ``nki``, or nothing) is put back afterwards, so a real installation is
never shadowed outside this load. The returned module keeps its references to the simulator.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import os
import sys
import threading
import types
from pathlib import Path

from . import isa as _isa
from . import language as _language
from . import nki as _nki
from .lint import check_source
from .numerics import check_numerics

_ALIASES = {"nki": _nki, "nki.language": _language, "nki.isa": _isa}
_lock = threading.RLock()
_counter = itertools.count()


def _resolve(path_or_module_name) -> tuple[str, str, str | None]:
    """(module name, source file, package) for a file path or an importable module name."""
    p = Path(os.fspath(path_or_module_name)) if not isinstance(path_or_module_name, str) else None
    s = os.fspath(path_or_module_name)
    if p is not None or s.endswith(".py") or os.sep in s or Path(s).is_file():
        path = Path(s).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"kernel source {s} does not exist")
        return f"_nki_sim_kernels.{path.stem}_{next(_counter)}", str(path), None
    spec = importlib.util.find_spec(s)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ModuleNotFoundError(f"no kernel source module named {s!r}")
    return s, spec.origin, s.rpartition(".")[0] or None


def load_kernel_module(path_or_module_name, numerics: str = "exact", check: bool = True) -> types.ModuleType:
    """Execute a kernel source file (a path, or a dotted module name) with ``nki`` bound to the simulator.

    The source is first checked against the Python subset the NKI compiler accepts (``lint``; ``check=False``
    skips it, for reading constants only). ``numerics``: "exact" (fp32 engine math) or "device" (Scalar-engine
    activations carry the target's bounded relative error; see ``numerics``). Returns a fresh module object (it
    is not registered in ``sys.modules``); its ``@nki.jit`` kernels run on the simulator when called with torch
    tensors or numpy arrays.
    """
    check_numerics(numerics)
    name, origin, package = _resolve(path_or_module_name)
    source = Path(origin).read_text()
    if check:
        check_source(source, origin)
    code = compile(source, origin, "exec")
    module = types.ModuleType(name)
    module.__file__ = origin
    module.__package__ = package
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=origin)
    module.__loader__ = None
    with _lock:
        saved = {k: sys.modules.get(k, _MISSING) for k in (*_ALIASES, name)}
        try:
            sys.modules.update(_ALIASES)
            sys.modules[name] = module
            exec(code, module.__dict__)
        finally:
            for k, v in saved.items():
                if v is _MISSING:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
    for key, value in list(module.__dict__.items()):
        if isinstance(value, _nki.JitKernel):
            module.__dict__[key] = value.with_options(numerics=numerics)
    return module


_MISSING = object()
