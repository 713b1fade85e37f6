"""Writes tests/vectors/window_gradient/window_gradient.json (docs/PROTOCOL.md 5.4.2) from the Python
implementation: the stage's own gathering and check (zl_mobile.stage.Stage._batch over
zl_mobile.readout.readout_positions) and its accumulation (zl_mobile.accumulate.WindowGradients).

    . .venv/bin/activate && python tests/vectors/window_gradient/make_vectors.py

tests/test_window_gradient_vectors.py checks the file is current and passes it through the Python
code; kotlin_app's WindowGradientVectorsTest runs the same cases on the Kotlin core.
float32 values are written as the exact Python float of each float32."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zl_mobile.accumulate import WindowGradients  # noqa: E402
from zl_mobile.protocol import Message, MsgType  # noqa: E402
from zl_mobile.stage import Stage  # noqa: E402

OUT = Path(__file__).with_name("window_gradient.json")
B, S = 2, 6
SHAPES = {"q.lora_A": 5, "q.lora_B": 19}  # 19: more than one vector register of float32


def floats(t) -> list[float]:
    return [float(x) for x in np.asarray(t, dtype=np.float32).reshape(-1)]


def labels_with(n: int, seed: int) -> np.ndarray:
    """[B, S] labels with exactly n valid positions, spread over both rows."""
    rng = np.random.default_rng(seed)
    labels = np.full(B * S, -100, dtype=np.int64)
    labels[np.sort(rng.choice(B * S, size=n, replace=False))] = rng.integers(0, 50, size=n)
    return labels.reshape(B, S)


def stage_batch(labels: np.ndarray, capacity: int, mb: int) -> dict:
    """What the stage feeds its program (or the ValueError it fails the micro-batch with)."""
    fake = SimpleNamespace(readout_rows=capacity, first_input="h", alpha=torch.tensor([0.5]))
    msg = Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": 0},
                  {"h": np.zeros(labels.shape + (2,), np.float32), "labels": labels,
                   "attention_mask": np.ones(labels.shape, np.int64), "position_ids": np.zeros(labels.shape, np.int64)})
    return Stage._batch(fake, msg)


def readout_case(name: str, labels, capacity: int, mb: int = 3) -> dict:
    labels = np.asarray(labels, dtype=np.int64)
    case = {"name": name, "micro_batch": mb, "labels": labels.tolist(), "capacity": capacity}
    try:
        b = stage_batch(labels, capacity, mb)
    except ValueError as e:
        case["error"] = str(e)
        return case
    case.update(index=b["loss_index"].tolist(), target=b["loss_target"].tolist(), weight=floats(b["loss_weight"]),
                valid=int(b["loss_weight"].sum()))
    return case


def window_case(name: str, counts: list[int], seed: int, capacity: int = B * S) -> dict:
    g = torch.Generator().manual_seed(seed)
    acc = WindowGradients({n: torch.zeros(k) for n, k in SHAPES.items()})
    mbs = []
    for i, n in enumerate(counts):
        labels = labels_with(n, seed * 100 + i)
        grads = {k: torch.randn(size, generator=g) * (100.0 if n == 0 else 1.0) for k, size in SHAPES.items()}
        weight = stage_batch(labels, capacity, i)["loss_weight"]
        acc.add(0, grads, float(weight.sum()))  # as Stage._accumulate
        mbs.append({"labels": labels.tolist(), "n_valid": int(weight.sum()), "grads": {k: floats(v) for k, v in grads.items()}})
    mean = acc.mean(0)
    return {"name": name, "capacity": capacity, "micro_batches": mbs,
            "expected": {k: floats(v) for k, v in mean.items()}}


def build() -> dict:
    full = [[7, 8, 9, 10], [11, 12, 13, 14]]
    return {
        "description": "PROTOCOL.md 5.4.2: valid positions (labels != -100) gathered row-major into the program's "
                       "readout rows (index b*S+i, target, weight 1; unused slots 0, 0, 0); more valid positions than "
                       "the rows fail the micro-batch (error, the stage's message). A window's gradient: "
                       "sum_i n_valid_i * g_i / max(sum_i n_valid_i, 1), g_i the gradient of micro-batch i's mean loss.",
        "readout": [
            readout_case("all_valid_exact_capacity", full, 8),
            readout_case("padding_left_as_zero_slots", [[-100, 5, -100, 0], [9, -100, -100, 2]], 6),
            readout_case("label_zero_is_valid", [[0, -100, -100, -100], [-100, -100, -100, 0]], 2),
            readout_case("none_valid", [[-100] * 4, [-100] * 4], 3),
            readout_case("none_valid_no_rows", [[-100] * 4, [-100] * 4], 0),
            readout_case("overflow_by_one", [[1, 2, -100, 3], [-100, 4, 5, -100]], 4, mb=7),
            readout_case("overflow_all_valid", full, 2, mb=12),
        ],
        "windows": [
            window_case("one_and_seven", [1, 7], seed=1),
            window_case("padding_micro_batch_adds_nothing", [3, 0, 5, 2], seed=2),
            window_case("no_valid_position_steps_on_zero", [0, 0], seed=3),
            window_case("single_micro_batch", [4], seed=4),
            window_case("eight_uneven", [1, 2, 3, 4, 5, 6, 7, 8], seed=5),
        ],
    }


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
