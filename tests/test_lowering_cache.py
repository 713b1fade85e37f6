"""The XNNPACK partition cache (exporter/lowering_cache.py): its key tells partitions apart by
everything but names, and an export through it still matches eager PyTorch (the XNNPACK export
tests, tests/test_export_errors.py, run with it)."""
import torch

from exporter.lowering_cache import PreprocessCache, cached_xnnpack_preprocess, partition_key


class Scaled(torch.nn.Module):
    def __init__(self, name: str, weight: torch.Tensor, scale: float = 2.0):
        super().__init__()
        self.register_parameter(name, torch.nn.Parameter(weight, requires_grad=False))
        self.name, self.scale = name, scale

    def forward(self, x):
        return torch.nn.functional.linear(x, getattr(self, self.name)) * self.scale


def _key(module, shape=(2, 4)):
    ep = torch.export.export(module, (torch.randn(*shape),), strict=False)
    return partition_key(ep, [])


def test_key_ignores_names_but_not_constants_shapes_or_ops():
    w = torch.randn(3, 4)
    same = _key(Scaled("first_layer_weight", w.clone()))
    assert _key(Scaled("another_layer_weight", w.clone())) == same  # only the names differ
    assert _key(Scaled("first_layer_weight", w + 1e-3)) != same       # another frozen constant
    assert _key(Scaled("first_layer_weight", w.clone()), shape=(5, 4)) != same  # another shape
    assert _key(Scaled("first_layer_weight", w.clone(), scale=3.0)) != same     # another scalar


def test_an_export_reuses_lowered_partitions(small_model_dir, tmp_path):
    """Three one-layer chunks of the small model give XNNPACK the same partitions three times:
    the second and third chunks reuse the first's, and the programs still match eager PyTorch."""
    from exporter import export
    from exporter.verify import failures, verify_all

    from .conftest import small_export_config

    cfg = small_export_config(backend="xnnpack")
    hits, misses = export._PREPROCESSED.hits, export._PREPROCESSED.misses
    _, artifacts = export.export_model(str(small_model_dir), "0-0,1-1,2-2", tmp_path / "out", cfg, jobs=1)  # in this process
    hits, misses = export._PREPROCESSED.hits - hits, export._PREPROCESSED.misses - misses
    assert hits > 1.5 * misses  # chunks 1 and 2 are chunk 0's partitions again (measured: 48 hits, 24 misses)

    class sizes:
        vocab_size, hidden_size = artifacts[0].chunk.vocab_size, artifacts[0].chunk.norm.weight.shape[0]

    for row in verify_all(tmp_path / "out", artifacts, cfg, sizes, report=lambda s: None):
        assert failures(row) == [] and "h_out" in row


def test_cache_scope_restores_xnnpack_preprocess():
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    before = XnnpackBackend.__dict__["preprocess"]
    with cached_xnnpack_preprocess(PreprocessCache()):
        assert XnnpackBackend.__dict__["preprocess"] is not before
    assert XnnpackBackend.__dict__["preprocess"] is before


def test_redundant_decompositions_are_skipped_and_needed_ones_run():
    """A functional core-ATen program comes back as it is; one with a mutating op, or with an
    op the table decomposes, is decomposed as usual."""
    from exporter.redundant_decompositions import skip_redundant_decompositions

    class Functional(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.mm.default(x, x) * 2

    class Mutating(torch.nn.Module):
        def forward(self, x):
            y = x.clone()
            y.add_(1)
            return y

    x = torch.randn(3, 3)
    functional = torch.export.export(Functional(), (x,), strict=False).run_decompositions({})
    mutating = torch.export.export(Mutating(), (x,), strict=False)
    stats = {}
    with skip_redundant_decompositions(stats):
        assert functional.run_decompositions({}) is functional
        table = {torch.ops.aten.mm.default: lambda a, b: (a.unsqueeze(-1) * b.unsqueeze(0)).sum(1)}
        decomposed = functional.run_decompositions(table)
        assert decomposed is not functional
        assert "aten.mm" not in str(decomposed.graph)
        assert mutating.run_decompositions({}) is not mutating
    assert stats == {"skipped": 1, "run": 2}
    assert torch.export.ExportedProgram.run_decompositions.__name__ == "run_decompositions"
    assert functional.run_decompositions({}) is not functional  # outside the block: as torch does it


def test_sorting_only_out_of_order_partitions_gives_the_same_program(small_model_dir, monkeypatch):
    """exporter/partition_sort.py sorts the graph only where a fused partition left it out of order,
    and each method once per pass, and exporter/partition_dependencies.py lets the partitioners walk
    the graph instead of holding every node's transitive dependencies: the chunk's programs run the
    same instructions on the same values with the same memory plans as when torch's sort runs after
    every partition on ExecuTorch's dependency sets (the delegates' payloads differ at most in the
    debug handles XNNPACK records, which number nodes by position). On an int4 base: its GEMMs and
    decode ops are one delegate each, so the graph was sorted hundreds of times."""
    import contextlib
    import functools

    from executorch.exir._serialize._program import deserialize_pte_binary

    from exporter import lower, partition_sort
    from exporter.base_weights import quantize_base
    from exporter.chunk_model import ChunkModel, add_lora, example_inputs, input_names
    from exporter.model_source import load_model_dir
    from exporter.two_phase import split_at_marker

    from .conftest import small_export_config

    cfg = small_export_config(backend="xnnpack", base_weights="int4")
    model = load_model_dir(small_model_dir)
    quantize_base(model, cfg.base_weights, cfg.decode_block_weights)
    chunk = ChunkModel(add_lora(model, cfg), 0, 1, cfg).eval()
    inputs = example_inputs(chunk, cfg, model.config.vocab_size, model.config.hidden_size)
    sorts = []
    in_place = partition_sort.sort_in_place
    monkeypatch.setattr(partition_sort, "sort_in_place", lambda graph: (sorts.append(1), in_place(graph))[1])

    def lowered():
        sorts.clear()
        split = split_at_marker(lower.joint_program(chunk, inputs), input_names(True))
        buffer = lower.lower_two_phase(split, "xnnpack", "chunk_0", quantized_base=True, cache=PreprocessCache()).buffer
        return deserialize_pte_binary(buffer).program, len(sorts)

    program, few = lowered()
    monkeypatch.setattr(lower, "sort_partitions_once",
                        functools.partial(partition_sort.sort_partitions_once, sort=lambda gm: in_place(gm.graph)))
    monkeypatch.setattr(lower, "walked_dependencies", contextlib.nullcontext)
    every, _ = lowered()
    partitions = sum(len(plan.delegates) for plan in every.execution_plan)
    assert partitions > 300 and few < partitions / 5, (few, partitions)
    for ours, theirs in zip(program.execution_plan, every.execution_plan, strict=True):
        assert ours.chains[0].instructions == theirs.chains[0].instructions, ours.name
        assert ours.values == theirs.values and ours.non_const_buffer_sizes == theirs.non_const_buffer_sizes
    payloads = [(bytes(a.data), bytes(b.data)) for a, b in zip(program.backend_delegate_data, every.backend_delegate_data,
                                                                strict=True)]
    assert all(len(a) == len(b) for a, b in payloads)
    assert sum(a != b for a, b in payloads) <= len(payloads) // 20
