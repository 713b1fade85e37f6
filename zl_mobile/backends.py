"""Which runtime a phone runs its chunk on: chosen once (zl-phone --backend), used everywhere else.

executorch (default): the exported .pte/.ptd in ExecuTorch's runtime, as on a phone.
eager:                the same chunk in eager PyTorch, on CPU threads or a CUDA device
                      (--torch-device), from the export's chunk_k_weights.safetensors
                      (zl-export --eager-weights). It never imports ExecuTorch, so it runs where
                      ExecuTorch cannot be installed (e.g. a GPU server with another torch).
Both give programs with the same interface (zl_common.program.NamedMethods), so the stage
runtime, the protocol and every schedule are the same."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zl_common.manifest import ChunkEntry

BACKENDS = ("executorch", "eager")
EAGER_CAPABILITY = "eager-torch"  # in HELLO capabilities: the host pushes the eager weights, not the .pte/.ptd


class BackendError(ValueError):
    """A backend that cannot run here; the message is one line and names the fix."""


@dataclass(frozen=True)
class Backend:
    name: str = "executorch"
    torch_device: str = "cpu"  # eager only

    @classmethod
    def from_args(cls, name: str = "executorch", torch_device: str | None = None) -> "Backend":
        """Check the options (and, for eager, the torch device); BackendError (one line) if wrong.
        Imports no ExecuTorch: check_runtime() does, once the caller is ready for its start-up noise."""
        if name not in BACKENDS:
            raise BackendError(f"--backend {name!r} is not one of {', '.join(BACKENDS)}")
        if name == "executorch":
            if torch_device is not None:
                raise BackendError("--torch-device applies to --backend eager only: add --backend eager, "
                                   "or leave --torch-device out")
            return cls(name)
        from .eager_program import check_torch_device

        try:
            dev = check_torch_device(torch_device or "cpu")
        except ValueError as e:
            raise BackendError(str(e)) from None
        return cls(name, str(dev))

    def check_runtime(self) -> None:
        """ExecuTorch's runtime can be loaded (the eager backend needs nothing more than torch)."""
        if self.name != "executorch":
            return
        try:
            from zl_common.et_runtime import runtime
            runtime()
        except (ImportError, OSError) as e:
            raise BackendError(f"ExecuTorch cannot be imported here ({type(e).__name__}: {e}): install "
                               "executorch==1.5.1 with torch 2.13.0 (pyproject.toml), or run the chunk in eager "
                               "PyTorch with --backend eager (export with zl-export --eager-weights)") from None

    @property
    def label(self) -> str:
        """executorch, eager-cpu, eager-cuda, eager-cuda:1: shown in HELLO and the mDNS TXT record."""
        return self.name if self.name == "executorch" else f"eager-{self.torch_device}"

    @property
    def capabilities(self) -> list[str]:
        runtime = ["executorch"] if self.name == "executorch" else [EAGER_CAPABILITY, f"torch-{self.torch_device}"]
        return runtime + ["lora", "replay", "two-phase"]

    def chunk_files(self, chunk: ChunkEntry) -> tuple[str, ...]:
        """The fields of the chunk's entry (ChunkEntry.for_mode's) naming files this device must hold."""
        if self.name == "executorch":
            return ("program", "weights", "lora_init")
        if chunk.eager_weights is None:
            from zl_common.program import ProgramError

            from .eager_program import EAGER_FIX

            raise ProgramError(f"the export has no eager-backend weights for chunk {chunk.index}: {EAGER_FIX}")
        return ("eager_weights", "lora_init")

    def set_threads(self, n: int) -> None:
        import torch

        torch.set_num_threads(n)
        if self.name == "executorch":
            from zl_common.et_runtime import runtime
            try:
                rt = runtime()
            except ImportError:
                return
            rt._unsafe_reset_threadpool(n)

    def load(self, export_dir: Path, chunk: dict, in_place: bool = False):
        """The chunk's program from its entry as ChunkEntry.for_mode gives it (`.json`);
        `in_place`: see ChunkProgram (the eager backend has no arena to keep outputs in)."""
        if self.name == "executorch":
            from zl_common.program import ChunkProgram
            return ChunkProgram(export_dir, chunk, in_place=in_place)
        from .eager_program import EagerChunkProgram
        return EagerChunkProgram(export_dir, chunk, self.torch_device)
