"""Library messages that read like errors but are not, removed where they arise, each by its
logger or warning category and module (stderr itself is left alone: everything else on it stays).

- torchao, imported by transformers, peft and ExecuTorch, tries to load its CUDA kernels
  (`_C_mxfp8...so`, `_C_cutlass_90a...so`) on import and logs "Failed to load ..." on a CPU build:
  that record of the `torchao` logger is dropped.
- torchao registers two Enum classes with torch's pytree, which logs "register_constant() on Enum
  subclasses is deprecated" on `torch.utils._pytree`: that record is dropped.
- transformers' FutureWarnings (deprecations addressed to library authors), from transformers'
  own modules only, and torch pytree's LeafSpec one; and the progress bars ("Loading weights",
  "Writing model shards", "Converting and de-quantizing GGUF tensors") in the host's CLIs.
- ExecuTorch's runtime logs at Info level ("[cpuinfo_utils.cpp:87] Failed to open midr file", the
  CPU count check) through its platform layer, whose minimum level is fixed when it is built:
  runtime_log_errors_only() gives the platform layer (the runtime's hook for logging, see
  runtime/platform/platform.h) a log sink that writes only Error and Fatal messages, so real
  errors still show.
"""
from __future__ import annotations

import ctypes
import logging
import os
import warnings

_installed = False


class _Drop(logging.Filter):
    def __init__(self, test):
        super().__init__()
        self._test = test

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self._test(record.getMessage())
        except Exception:  # noqa: BLE001  (a record that cannot be formatted is not ours to drop)
            return True


def quiet_libraries(transformers: bool = True) -> None:
    """Install the filters above (idempotent); call before the heavy imports. transformers=False
    leaves its progress bars as they are, so as not to import it (a phone's process)."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger("torchao").addFilter(_Drop(lambda m: m.startswith("Failed to load") and ".so" in m))
    logging.getLogger("torch.utils._pytree").addFilter(
        _Drop(lambda m: "register_constant()" in m and "Enum subclass" in m))
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")
    # torch's pytree, when torch.export's programs are deep-copied (attributed to copyreg)
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    if transformers:
        # transformers' GGUF loader draws its own tqdm bar ("Converting and de-quantizing GGUF
        # tensors"), which only tqdm's own switch turns off; read when tqdm is imported
        os.environ.setdefault("TQDM_DISABLE", "1")
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:  # nothing of it to quiet
            return
        hf_logging.disable_progress_bar()


# ExecuTorch's platform layer (runtime/platform/platform.h): et_pal_log_level_t is a char.
_LEVEL_ERROR, _LEVEL_FATAL = ord("E"), ord("F")
_EmitLog = ctypes.CFUNCTYPE(None, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
                            ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)


class _PalImpl(ctypes.Structure):  # executorch::runtime::PalImpl, in declaration order
    _fields_ = [("init", ctypes.c_void_p), ("abort", ctypes.c_void_p), ("current_ticks", ctypes.c_void_p),
                ("ticks_to_ns_multiplier", ctypes.c_void_p), ("emit_log_message", _EmitLog),
                ("allocate", ctypes.c_void_p), ("free", ctypes.c_void_p), ("source_filename", ctypes.c_char_p)]


def _emit(timestamp, level, filename, function, line, message, length):
    if level not in (_LEVEL_ERROR, _LEVEL_FATAL):
        return
    name = os.path.basename((filename or b"?").decode(errors="replace"))
    text = (message or b"")[:length].decode(errors="replace")
    try:
        os.write(2, f"[executorch {chr(level)} {name}:{line}] {text}\n".encode())
    except OSError:
        pass


_sink = _EmitLog(_emit)  # kept alive for the process: the runtime holds the pointer
_runtime_quieted = False


def runtime_log_errors_only(libexecutorch_dir: str | None = None) -> bool:
    """Make ExecuTorch's runtime log Error and Fatal messages only (see the module docstring).
    Call after the runtime binding is imported (it installs its own sink at import). The sink is
    set in the platform table `get_pal_impl()` returns, the one `register_pal()` fills: calling
    register_pal() a second time would itself log an Error ("register_pal() called multiple
    times"). Returns False, changing nothing, where the runtime library or its hook is not found."""
    global _runtime_quieted
    if _runtime_quieted:
        return True
    try:
        if libexecutorch_dir is None:
            import executorch

            libexecutorch_dir = os.path.join(list(executorch.__path__)[0], "lib")  # a namespace package
        lib = ctypes.CDLL(os.path.join(libexecutorch_dir, "libexecutorch.so"))
        get_pal_impl = getattr(lib, "_ZN10executorch7runtime12get_pal_implEv")
    except (OSError, AttributeError, ImportError):
        return False
    get_pal_impl.argtypes = []
    get_pal_impl.restype = ctypes.POINTER(_PalImpl)
    table = get_pal_impl()
    if not table:
        return False
    table.contents.emit_log_message = _sink
    _runtime_quieted = True
    return True
