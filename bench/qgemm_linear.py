"""One Linear through XNNPACK: fp32 (weight repacked per call, as the exports do) against the dynamically
quantized GEMMs, QD8-F32-QC8W (int8 per-channel weights) and QD8-F32-QB4W (4-bit, group 32), lowered
by ExecuTorch's XnnpackPartitioner from the decomposed q/dq pattern. Prints the ops left after lowering
(all in one delegate), the difference to eager, and the median time (not a test).

  python bench/qgemm_linear.py 5632 2048 128 qc8w     # N K tokens fp32|qc8w|qb4w
"""
import sys
import time

import torch
import torch.ao.quantization.fx._decomposed  # registers quantized_decomposed ops
import torch.nn as nn
import torch.nn.functional as F
from executorch.backends.xnnpack import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.runtime import Runtime

qd = torch.ops.quantized_decomposed
torch.manual_seed(0)
N, K, M = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mode = sys.argv[4]  # fp32 | qc8w | qb4w
class L(nn.Module):
    def __init__(s):
        super().__init__()
        w = torch.randn(N, K) * 0.02
        if mode == "fp32":
            s.register_buffer("w", w)
        elif mode == "qc8w":
            sc = w.abs().amax(1) / 127
            s.register_buffer("q", torch.round(w / sc[:, None]).clamp(-127, 127).to(torch.int8))
            s.register_buffer("sc", sc)
            s.register_buffer("zp", torch.zeros(N, dtype=torch.int64))
        else:
            G = 32
            wg = w.reshape(N, K // G, G)
            sc = wg.abs().amax(2) / 7
            s.register_buffer("q", torch.round(wg / sc[..., None]).clamp(-8, 7).to(torch.int8).reshape(N, K))
            s.register_buffer("sc", sc)
            s.register_buffer("zp", torch.zeros_like(sc, dtype=torch.int64))
    def forward(s, x):
        if mode == "fp32":
            return F.linear(x, s.w)
        sx, zx = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
        xq = qd.quantize_per_token(x, sx, zx, -128, 127, torch.int8)
        xd = qd.dequantize_per_token(xq, sx, zx, -128, 127, torch.int8, torch.float32)
        if mode == "qc8w":
            wd = qd.dequantize_per_channel(s.q, s.sc, s.zp, 0, -127, 127, torch.int8)
        else:
            wd = qd.dequantize_per_channel_group(s.q, s.sc, s.zp, -8, 7, torch.int8, 32, torch.float32)
        return F.linear(xd, wd)
m = L().eval()
x = torch.randn(M, K)
ref = m(x)
ep = torch.export.export(m, (x,), strict=False)
part = XnnpackPartitioner(force_non_static_weights_for_f32_linear=(mode == "fp32"))
edge = to_edge_transform_and_lower(ep, partitioner=[part])
g = edge.exported_program().graph_module
print(mode, "ops after lowering:", sorted({str(n.target) for n in g.graph.nodes if n.op == "call_function"}))
pte = edge.to_executorch(ExecutorchBackendConfig())
buf = pte.buffer
print("pte bytes", len(buf))
prog = Runtime.get().load_program(buf)
meth = prog.load_method("forward")
out = meth.execute([x])[0]
print("max|out-eager|", (out - ref).abs().max().item(), "ref scale", ref.abs().max().item())
for _ in range(3):
    meth.execute([x])
ts = []
for _ in range(15):
    t = time.perf_counter()
    meth.execute([x])
    ts.append(time.perf_counter() - t)
ts.sort()
print(f"{mode} N={N} K={K} M={M} median {ts[len(ts)//2]*1e3:.2f} ms")
