"""The pipeline marker: an identity operator that marks the phase boundary in the traced graph.

It wraps h_k right after the chunk's layers. It survives torch.export and the joint
forward/backward trace as a named node, so the splitter can cut the graph exactly there;
it is removed before lowering (it computes nothing)."""
from __future__ import annotations

import torch

MARKER_NAME = "zerolock::pipeline_marker"


@torch.library.custom_op(MARKER_NAME, mutates_args=())
def pipeline_marker(h: torch.Tensor) -> torch.Tensor:
    return h.clone()


@pipeline_marker.register_fake
def _(h):
    return torch.empty_like(h)


def _backward(ctx, grad):
    return grad


pipeline_marker.register_autograd(_backward)


def is_marker(node) -> bool:
    return node.op == "call_function" and "pipeline_marker" in str(node.target)
