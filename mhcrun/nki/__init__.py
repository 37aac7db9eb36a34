"""mhcrun on Trainium: NKI kernels and the torch ops that dispatch to them.

- ``mhcrun/nki/kernels.py``: NKI 0.3+ kernel source (``import nki`` ...); imported as a module only where the
  real ``nki`` package exists, executed on CPU by the simulator otherwise.
- ``mhcrun.nki.ops``: torch custom ops and the backend choice (torch reference, simulator, Neuron device).
- ``mhcrun.nki.sim``: mhcrun's CPU simulator of the NKI language subset the kernels use.

Nothing is imported here, so ``import mhcrun.nki.sim`` stays free of torch custom-op registration.
"""
