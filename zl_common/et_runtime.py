"""ExecuTorch's runtime binding, without the compiler side of its Python package.

`executorch.extension.pybindings.portable_lib` only re-exports the C extension `_C`, but it first
imports `executorch.exir` (for a warning class), and with it torch.export, sympy, networkx and
torchao: about 1,800 modules and 130 MiB of PSS in every phone process, none of which running a
program needs. The extension alone is what a device loads (docs/BENCHMARKS.md, Stage memory)."""
from __future__ import annotations


def runtime():
    """The `_C` extension module: _load_for_executorch, _unsafe_reset_threadpool, ..."""
    import torch  # noqa: F401  (the extension links against libtorch: load it first)
    from executorch.extension.pybindings import _C

    from .quiet import runtime_log_errors_only

    runtime_log_errors_only()  # its Info messages ("Failed to open midr file", ...) are not errors
    return _C
