"""Split the joint forward+backward graph at the pipeline marker into two programs.

phase1: ancestors of the marker (the chunk's forward). Outputs h_k first, then the
        activations phase 2 needs ("saved_i").
phase2: readout, local loss and the LoRA backward. Inputs: LoRA tensors, h_k if used,
        saved activations, and the user inputs only phase 2 reads (loss positions, h_in).
        Outputs: the leading user outputs named by `loss_outputs` (ZeroLock: loss, task_loss,
        consis_loss; a BP stage: loss or nothing), then one gradient per trainable tensor.
        The remaining user outputs (h_k) are dropped: phase 1 already returns h_k.

Nodes computed from weights alone (weight transposes, RoPE/mask tables) are recomputed in
phase 2 rather than shipped; everything that depends on the micro-batch is computed once, in
phase 1. LoRA tensors are plain inputs of both methods, so the runtime owns the adapter and
its optimizer state (each method would otherwise hold its own constant copy)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export.exported_program import ExportedProgram, ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

from .marker import is_marker

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclass
class Phase:
    program: ExportedProgram
    inputs: list[str]   # user-input names in call order
    outputs: list[str]  # output names in order


@dataclass
class SplitResult:
    phase1: Phase
    phase2: Phase
    lora_targets: list[str]  # chunk-local trainable parameter names (LoRA, BP probe), in input order
    saved_bytes: int = 0
    info: dict = field(default_factory=dict)


def ancestors(roots) -> set:
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _tensor_bytes(node) -> int:
    v = node.meta["val"]
    return v.numel() * v.element_size()


ZEROLOCK_LOSS_OUTPUTS = ("loss", "task_loss", "consis_loss")


def split_at_marker(ep: ExportedProgram, user_input_names: list[str],
                    loss_outputs: Sequence[str] = ZEROLOCK_LOSS_OUTPUTS) -> SplitResult:
    """Split the joint graph `ep` (from _export_forward_backward) at its one pipeline marker.
    `user_input_names` names the traced module's inputs; `loss_outputs` names the leading user
    outputs phase 2 returns (the traced module's outputs start with them)."""
    gm, sig = ep.graph_module, ep.graph_signature
    g = gm.graph
    nodes = list(g.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    spec_of = {s.arg.name: s for s in sig.input_specs}
    out_nodes = list(g.output_node().args[0])
    ospecs = sig.output_specs

    grad_idx = [i for i, s in enumerate(ospecs) if s.kind == OutputKind.GRADIENT_TO_PARAMETER]
    lora_targets = [ospecs[i].target for i in grad_idx]
    lora_set = set(lora_targets)
    user_idx = [i for i, s in enumerate(ospecs) if s.kind in (OutputKind.LOSS_OUTPUT, OutputKind.USER_OUTPUT)]
    if len(loss_outputs) > len(user_idx):
        raise ValueError(f"the traced module has {len(user_idx)} user outputs, fewer than {list(loss_outputs)}")
    loss_outs = [out_nodes[i] for i in user_idx[:len(loss_outputs)]]

    placeholders = [n for n in nodes if n.op == "placeholder"]
    user_ph = [n for n in placeholders if spec_of[n.name].kind == InputKind.USER_INPUT]
    lora_ph = {spec_of[n.name].target: n for n in placeholders
               if spec_of[n.name].kind == InputKind.PARAMETER and spec_of[n.name].target in lora_set}
    frozen_ph = [n for n in placeholders if n not in user_ph and n not in lora_ph.values()]
    ph_name = {n: name for n, name in zip(user_ph, user_input_names)}

    markers = [n for n in nodes if is_marker(n)]
    if len(markers) != 1:
        raise RuntimeError(f"expected one pipeline marker in the traced graph, found {len(markers)}")
    marker = markers[0]

    data_dependent = {n for n in nodes if ancestors([n]) & set(user_ph)}
    p1 = ancestors([marker])

    # Phase-2 closure: walk back from the loss/grad outputs; a data-dependent phase-1 node is
    # an input of phase 2 (shipped), a weight-only node is recomputed there.
    p2_outs = loss_outs + [out_nodes[i] for i in grad_idx]
    p2, boundary, stack = set(), set(), list(p2_outs)
    while stack:
        n = stack.pop()
        if n in p2 or n in boundary:
            continue
        if n.op == "placeholder" or (n in p1 and n in data_dependent):
            boundary.add(n)
            continue
        p2.add(n)
        stack.extend(n.all_input_nodes)

    saved = sorted((n for n in boundary if n.op != "placeholder"), key=order.get)
    h_node = marker
    shipped = [n for n in saved if n is not h_node]

    def state_inputs(keep):
        used = [n for n in frozen_ph if n in keep]
        return sorted(used, key=lambda n: (_STATE_KINDS.index(spec_of[n.name].kind), order[n]))

    # ---- phase 1: inputs = frozen state, LoRA, then the user inputs it reads
    p1_lora = [t for t in lora_targets if lora_ph[t] in p1]
    p1_user = [n for n in user_ph if n in p1]
    g1_in = state_inputs(p1) + [lora_ph[t] for t in p1_lora] + p1_user
    names1 = p1_lora + [ph_name[n] for n in p1_user]
    g1_out = [h_node] + shipped
    out_names1 = ["h_out"] + [f"saved_{i}" for i in range(len(shipped))]
    ep1 = _program(ep, g, g1_in, g1_out, p1, n_user_in=len(names1))

    # ---- phase 2: inputs = frozen state, LoRA, h_out?, saved_i, user inputs it reads
    p2_state = [n for n in boundary if n.op == "placeholder" and n in frozen_ph]
    p2_lora = [t for t in lora_targets if lora_ph[t] in boundary]
    p2_user = [n for n in user_ph if n in boundary]
    p2_acts = ([h_node] if h_node in boundary else []) + shipped
    act_names = {h_node: "h_out", **{n: f"saved_{i}" for i, n in enumerate(shipped)}}
    g2_in = state_inputs(set(p2_state)) + [lora_ph[t] for t in p2_lora] + p2_acts + p2_user
    names2 = p2_lora + [act_names[n] for n in p2_acts] + [ph_name[n] for n in p2_user]
    ep2 = _program(ep, g, g2_in, p2_outs, p2, n_user_in=len(names2), contiguous_inputs=True)
    out_names2 = list(loss_outputs) + [f"grad:{t}" for t in lora_targets]

    return SplitResult(
        phase1=Phase(ep1, names1, out_names1),
        phase2=Phase(ep2, names2, out_names2),
        lora_targets=lora_targets,
        saved_bytes=sum(_tensor_bytes(n) for n in shipped),
        info=dict(n_saved=len(shipped), h_needed_in_phase2=h_node in boundary),
    )


def strip_markers(gm) -> None:
    """The marker computes nothing: drop it before lowering (it has no ExecuTorch kernel)."""
    for n in list(gm.graph.nodes):
        if is_marker(n):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _program(ep, g, in_nodes, out_nodes, keep, n_user_in, contiguous_inputs=False) -> ExportedProgram:
    """Copy the kept nodes of g into a standalone ExportedProgram with the given inputs/outputs.
    Inputs after the state ones are user inputs (LoRA included); outputs are user outputs."""
    spec_of = {s.arg.name: s for s in ep.graph_signature.input_specs}
    new = fx.Graph()
    env = {}
    n_state = len(in_nodes) - n_user_in
    for i, n in enumerate(in_nodes):
        p = new.placeholder(n.name if n.op == "placeholder" else f"act_{n.name}")
        p.meta = dict(n.meta)
        if contiguous_inputs and i >= n_state:  # activations arrive as dense tensors
            p.meta["val"] = n.meta["val"].clone(memory_format=torch.contiguous_format)
        env[n] = p
    for n in g.nodes:
        if n in keep and n.op == "call_function" and n not in env:
            env[n] = new.node_copy(n, lambda a: env[a])
    new.output(tuple(env[o] for o in out_nodes))
    gm = fx.GraphModule(torch.nn.Module(), new)
    strip_markers(gm)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_specs = []
    for i, p in enumerate(placeholders):
        if i < n_state:
            s = spec_of[in_nodes[i].name]
            in_specs.append(InputSpec(s.kind, TensorArgument(p.name), s.target, s.persistent))
        else:
            in_specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(p.name), None))
    outs = gm.graph.output_node().args[0]
    out_specs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), None) for o in outs]
    state_targets = {s.target for s in in_specs if s.kind != InputKind.USER_INPUT}
    state_dict = {k: v for k, v in ep.state_dict.items() if k in state_targets}
    constants = {k: v for k, v in ep.constants.items() if k in state_targets}
    in_spec = pytree.tree_flatten((tuple(range(n_user_in)), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(len(outs))))[1]
    call_graph = [ModuleCallEntry("", ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec))]
    return ExportedProgram(root=gm, graph=gm.graph, graph_signature=ExportGraphSignature(in_specs, out_specs),
                           state_dict=state_dict, range_constraints={}, module_call_graph=call_graph,
                           example_inputs=None, constants=constants, verifiers=ep.verifiers)
