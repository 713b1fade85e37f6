"""A chunk's two-phase training program, run by ExecuTorch's runtime.

phase1(lora, batch) -> (h_k, saved)          the forward; h_k is what goes downstream
phase2(lora, saved, batch) -> StepResult      local loss + LoRA gradients; no forward recompute
run(method, values) -> outputs by name        a method with inputs picked by name (BP schedules)
Inputs are matched to the method signatures by the names recorded in the manifest.
zl_mobile/eager_program.py runs the same chunk in eager PyTorch behind the same interface;
zl_mobile/backends.py chooses between them."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

import torch


class ProgramError(Exception):
    """The program could not be loaded or was called with inputs that do not fit it."""


@dataclass
class StepResult:
    loss: float
    task_loss: float
    consis_loss: float
    grads: dict[str, torch.Tensor]  # peft name -> gradient


class NamedMethods(abc.ABC):
    """What both backends share: the methods' named inputs and outputs, from the manifest entry."""

    def __init__(self, chunk: dict):
        self.chunk = chunk
        self.index = chunk["index"]
        self.methods = chunk["methods"]
        self.lora_names = [t["name"] for t in chunk["lora"]]
        self.lora_shapes = {t["name"]: tuple(t["shape"]) for t in chunk["lora"]}

    def input_spec(self, method: str) -> list[dict]:
        return self.methods[method]["inputs"]

    def _args(self, method: str, values: dict) -> tuple:
        args = []
        for spec in self.methods[method]["inputs"]:
            t = values.get(spec["name"])
            if t is None:
                raise ProgramError(f"{method} of chunk {self.index} needs input {spec['name']!r}, which was not given")
            if list(t.shape) != spec["shape"]:
                raise ProgramError(f"{method} input {spec['name']!r} has shape {list(t.shape)}, the program was "
                                   f"exported for {spec['shape']}: pad the micro-batch or re-export")
            args.append(t.contiguous())
        return tuple(args)

    @abc.abstractmethod
    def run(self, method: str, values: dict) -> dict:
        """Call a method with inputs picked by name; returns its outputs by name."""

    def phase1(self, lora: dict, batch: dict):
        saved = self.run("phase1", {**batch, **lora})
        return saved["h_out"], saved

    def phase2(self, lora: dict, saved: dict, batch: dict) -> StepResult:
        res = self.run("phase2", {**batch, **saved, **lora})
        grads = {n[5:]: g for n, g in res.items() if n.startswith("grad:")}
        return StepResult(float(res["loss"]), float(res["task_loss"]), float(res["consis_loss"]), grads)


class ChunkProgram(NamedMethods):
    """The chunk's .pte (methods phase1, phase2) with its frozen weights (.ptd), in ExecuTorch.

    in_place=True leaves phase 1's outputs (h_k and the saved activations) where phase 1 wrote
    them, in its memory-planned arena, instead of copying them out; phase 2, whose inputs are
    not planned (exporter/lower.py: memory_plans), then reads them there, so a micro-batch's
    saved activations exist once. They are valid until the next phase 1 call: for a schedule
    that runs each phase 2 before the next phase 1 (ZeroLock), not for BP schedules that hold
    several forwards. A phase 2 on overwritten activations is refused, never run
    (zl_mobile.schedules.forwards_held says which stages may use it)."""

    def __init__(self, export_dir: Path, chunk: dict, in_place: bool = False, etdump: bool = False):
        from .et_runtime import runtime

        super().__init__(chunk)
        self.in_place = in_place
        self._phase1_calls = 0
        pte = Path(export_dir) / chunk["program"]
        ptd = Path(export_dir) / chunk["weights"]
        try:
            self._module = runtime()._load_for_executorch(str(pte), data_path=str(ptd), enable_etdump=etdump)
        except Exception as e:  # the runtime raises RuntimeError with an error code only
            raise ProgramError(f"ExecuTorch could not load {pte.name} with {ptd.name} ({e}): "
                               "re-push the program and weights (their sha256 must match the manifest)") from None

    def run(self, method: str, values: dict) -> dict:
        if method == "phase2" and values.get(_CALL, self._phase1_calls) != self._phase1_calls:
            raise ProgramError(f"phase 2 of chunk {self.index} was given the saved activations of phase 1 call "
                               f"{values[_CALL]}, which call {self._phase1_calls} has overwritten in place: run each "
                               "phase 2 before the next phase 1, or load the program with in_place=False")
        in_arena = self.in_place and method == "phase1"
        if in_arena:
            self._phase1_calls += 1
        outs = self._module.run_method(method, self._args(method, values), clone_outputs=not in_arena)
        named = dict(zip((o["name"] for o in self.methods[method]["outputs"]), outs))
        return named | ({_CALL: self._phase1_calls} if in_arena else {})

    def write_etdump(self, path: Path) -> None:
        """The operator profile of the calls so far (load with etdump=True)."""
        self._module.write_etdump_result_to_file(str(path))


_CALL = "_phase1_call"  # which phase 1 call wrote a set of in-place outputs
