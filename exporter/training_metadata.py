"""The metadata methods ExecuTorch's TrainingModule needs to run a training program.

On Android, a program whose frozen weights live in a separate .ptd file is loaded with
`org.pytorch.executorch.training.TrainingModule.load(pte, ptd)` (the plain `Module` takes no data
file), and a method runs through `executeForwardBackward(method, inputs)`. Before running method
m, the runtime calls three constant methods of the program:
  __et_training_gradients_index_m   index of the first gradient output (outputs before it are
                                    returned to the caller)
  __et_training_parameters_index_m  index of the first parameter output (= the output count: our
                                    programs return no parameters)
  __et_training_fqn_m               the gradients' names, in output order (`namedGradients(m)`)
The names are the manifest's LoRA names (the ones peft gives the full model)."""
from __future__ import annotations

GRADIENTS_INDEX = "__et_training_gradients_index_"
PARAMETERS_INDEX = "__et_training_parameters_index_"
FQN = "__et_training_fqn_"
GRAD_PREFIX = "grad:"


def training_constant_methods(methods: dict) -> dict:
    """{constant method name: value} for every method described as in manifest.json
    ({"phase1": {"outputs": [{"name": ...}, ...]}, ...}). LoRA gradients must be the last
    outputs of a method (TrainingModule reads them as one contiguous run)."""
    out = {}
    for m, desc in methods.items():
        names = [o["name"] for o in desc["outputs"]]
        grads = [i for i, n in enumerate(names) if n.startswith(GRAD_PREFIX)]
        start = grads[0] if grads else len(names)
        if grads != list(range(start, len(names))):
            raise ValueError(f"method {m}: LoRA gradient outputs must come last, got {names}")
        out[GRADIENTS_INDEX + m] = start
        out[PARAMETERS_INDEX + m] = len(names)
        out[FQN + m] = [n[len(GRAD_PREFIX):] for n in names[start:]]
    return out
