"""XNNPACK's weights cache on a QD8 int8 GEMM shared by two methods (issue 33; not a test).

A program with two methods, `phase1` and `phase2`, each one dynamically quantized Linear
(QD8-F32-QC8W) on the same frozen int8 weight, as a chunk's two phases share the readout. Each
XNNPACK delegate packs its static weights at load; the runtime's weights cache
(`XnnpackBackend` option `weight_cache_enabled`, set through executorch::runtime::set_option, which
the wheel's Python bindings do not expose: a 20-line C shim built here with g++ against the wheel's
headers) packs each named weight once for every delegate and method, and frees the unpacked source.
Fresh processes, cache off and on: the anonymous PSS that loading and running both methods adds,
against the int8 weight's size.

  python bench/xnnpack_weight_cache.py            # N K tokens: --shape 5632 2048 128
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM = r"""
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <cstring>
using namespace executorch::runtime;
extern "C" int zl_xnn_set_bool(const char* key, int v) {
  BackendOption o; std::strncpy(o.key, key, kMaxOptionKeyLength - 1); o.value = bool(v);
  return (int)set_option("XnnpackBackend", Span<BackendOption>(&o, 1));
}
extern "C" int zl_xnn_get_bool(const char* key) {
  BackendOption o; std::strncpy(o.key, key, kMaxOptionKeyLength - 1); o.value = false;
  Span<BackendOption> s(&o, 1);
  return get_option("XnnpackBackend", s) == Error::Ok ? int(std::get<bool>(o.value)) : -1;
}
"""


def build_shim(tmp: Path) -> Path:
    import executorch

    et = Path(list(executorch.__path__)[0])
    src, so = tmp / "shim.cpp", tmp / "libzlxnn.so"
    src.write_text(SHIM)
    # the wheel's flags, as kotlin_app/jni/build.sh uses them
    subprocess.run(["g++", "-std=c++17", "-O2", "-shared", "-fPIC", "-DC10_USING_CUSTOM_GENERATED_MACROS",
                    "-DET_EVENT_TRACER_ENABLED", "-DET_USE_THREADPOOL", "-isystem", f"{et}/include", "-isystem",
                    f"{et}/include/executorch/runtime/core/portable_type/c10", str(src), f"-L{et}/lib",
                    f"-Wl,--enable-new-dtags,-rpath,{et}/lib", "-lexecutorch", "-o", str(so)], check=True)
    return so


def export(pte: Path, n: int, k: int, m: int) -> int:
    import torch
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
    import torch.nn.functional as F
    from executorch.backends.xnnpack import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    qd = torch.ops.quantized_decomposed
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    sc = w.abs().amax(1) / 127

    class QLinear(torch.nn.Module):
        def __init__(self, times):
            super().__init__()
            self.times = times
            self.register_buffer("q", torch.round(w / sc[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("sc", sc.clone())
            self.register_buffer("zp", torch.zeros(n, dtype=torch.int64))

        def forward(self, x):  # the decomposed pattern XNNPACK lowers to one QD8-F32-QC8W GEMM
            sx, zx = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
            xd = qd.dequantize_per_token(qd.quantize_per_token(x, sx, zx, -128, 127, torch.int8),
                                         sx, zx, -128, 127, torch.int8, torch.float32)
            wd = qd.dequantize_per_channel(self.q, self.sc, self.zp, 0, -127, 127, torch.int8)
            return F.linear(xd, wd) * self.times

    x = torch.randn(m, k)
    eps = {f"phase{i}": torch.export.export(QLinear(i).eval(), (x,), strict=False) for i in (1, 2)}
    et = to_edge_transform_and_lower(eps, partitioner=[XnnpackPartitioner()]).to_executorch(ExecutorchBackendConfig())
    pte.write_bytes(et.buffer)
    return n * k


def anonymous_mib() -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from zl_mobile.telemetry import read_pss_by_backing

    return read_pss_by_backing()["anonymous"] / 2**20


def worker(pte: Path, shim: Path, mode: str, k: int, m: int) -> dict:
    import ctypes

    import torch

    from zl_common.et_runtime import runtime

    rt = runtime()  # loads libexecutorch.so, which the shim then shares
    lib = ctypes.CDLL(str(shim))
    if mode.startswith("on"):
        lib.zl_xnn_set_bool(b"weight_cache_enabled", 1)
    before = anonymous_mib()
    mod = rt._load_for_executorch(str(pte))
    x = torch.randn(m, k)
    out = [mod.run_method(f"phase{i}", (x,))[0] for i in ((1,) if mode.endswith("one") else (1, 2))]
    assert len(out) == 1 or torch.allclose(out[1], 2 * out[0]), "the two methods disagree"
    return {"cache": lib.zl_xnn_get_bool(b"weight_cache_enabled"), "added_mib": anonymous_mib() - before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=3, default=(5632, 2048, 128), metavar=("N", "K", "M"))
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    n, k, m = a.shape
    if a.worker:
        pte, shim, mode = a.worker
        print(json.dumps(worker(Path(pte), Path(shim), mode, k, m)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shim, pte = build_shim(tmp), tmp / "two_methods.pte"
        weight_mib = export(pte, n, k, m) / 2**20
        print(f"one int8 weight [{n}, {k}]: {weight_mib:.1f} MiB, used by both methods")
        res = {}
        what = {"off-one": "cache off, phase1 only", "off": "cache off, both methods", "on": "cache on, both methods"}
        for mode, text in what.items():
            out = subprocess.run([sys.executable, __file__, "--shape", str(n), str(k), str(m),
                                  "--worker", str(pte), str(shim), mode], capture_output=True, text=True, check=True)
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{text:26s} (option reads {res[mode]['cache']}): load + run adds {res[mode]['added_mib']:5.1f} MiB "
                  f"anonymous ({res[mode]['added_mib'] / weight_mib:.2f} x the weight)")
        second = (res["off"]["added_mib"] - res["off-one"]["added_mib"]) / weight_mib
        saved = (res["off"]["added_mib"] - res["on"]["added_mib"]) / weight_mib
        print(f"the second method's own packed copy: {second:.2f} x the weight; the cache saves {saved:.2f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
