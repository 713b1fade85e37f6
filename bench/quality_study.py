"""Issue 32's quality study, resumable: ZeroLock against LoRA backprop on SmolLM2-135M, at several
training budgets, on a classification and a generative task, each method at its own swept LR.

Every (task, method, LR, seed, budget, epochs, LoRA targets, split) result is one JSON file under
--cells (default bench/results/quality_cells/); a rerun skips the cells that exist, so a killed run
resumes where it stopped. The methods, model, LoRA, optimizer, window rule and evaluation are
bench/quality.py's (train_and_eval), the same for every method.

The plan, in order (each step runs what is missing):
  1. per task: zero-shot on test; LR sweep at --sweep-budget, seed 0, on the validation split
     (choice: lowest validation answer NLL)
  2. per task: --seeds at the chosen LR, test split, at --sweep-budget (with an accuracy curve)
  3. per task: the other --budgets at the same LR, all seeds
Tasks run one after the other in the order of --tasks (steps 1-2 of every task before step 3).
With --base-weights int8 / int4 (issue 33: the frozen base as zl-export stores it), --epochs
above 1 or --chunks other than 0-9,10-19,20-29 (ZeroLock's split; BP has none) there is no sweep:
each method trains at the LR the fp32 base's one-epoch sweep on the default split chose, seeds at
every budget.
Issue 49's tail readouts (zl-tail2-lens, zl-tail10-lens, zl-tailall: "tail:D") have no sweep either:
they train at the LR the default's (zl-last1-lens) one-epoch sweep chose, seeds x budgets, on
--split (validation for the depth curve, test after). `report` also writes the depth table.
`--methods zl-pipeline` (alone) trains ZeroLock's default through the real pipeline instead: the
ExecuTorch programs exported with the fast path's lenses and LoRA init, `zl-host run` on three
emulated phones, at the fast twin's chosen LR, --seeds x --budgets.

  nice -n 19 python bench/quality_study.py run --log /tmp/q32/study.log &   # resumable; start one
  nice -n 19 python bench/quality_study.py run --log /tmp/q32/study.log &   # worker per core: cells are locked
  nice -n 19 python bench/quality_study.py run --tasks wordnet-reverse --methods zl-tailall --budgets 1024 \
      --seeds 0 --split validation &   # issue 49's depth curve, one tail:D at the default's LR
  python bench/quality_study.py report      # bench/results/quality_study.json, the plot, the markdown
  python bench/quality_study.py depth --lrs 3e-4,1e-3,3e-3,1e-2 --notes F --doc   # issue 49's tail:D table
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import quality as Q  # noqa: E402
from bench.quality_tasks import TASKS, load_task  # noqa: E402
from exporter.config import BASE_WEIGHTS  # noqa: E402
from exporter.errors import ChunkSpecError  # noqa: E402
from zl_mobile.reference.metrics import exact_match  # noqa: E402

CELLS = ROOT / "bench" / "results" / "quality_cells"
OUT = ROOT / "bench" / "results" / "quality_study.json"
PLOT = ROOT / "bench" / "results" / "quality_study.png"
METRIC = {"wordnet": "choice_accuracy", "wordnet-reverse": "exact_match"}
PIPELINE, PIPELINE_TWIN = "zl-pipeline", "zl-last1-lens"  # the real pipeline runs the default's settings


def trained_split(method, chunks) -> str:
    """The split a method's cell is trained on: ZeroLock's methods train `chunks`, BP and zero-shot have none."""
    return chunks if method.startswith("zl") else Q.DEFAULT_SPLIT


def cell_name(task, method, lr, seed, budget, epochs, targets, split, base_weights="fp32", chunks=Q.DEFAULT_SPLIT) -> str:
    bw = "" if base_weights == "fp32" else f"_{base_weights}"  # fp32 cells keep the names they were run under
    chunks = trained_split(method, chunks)  # another split is named by its layer counts (5-5-20)
    c = "" if chunks == Q.DEFAULT_SPLIT else "_c" + "-".join(
        str(int(r.split("-")[1]) - int(r.split("-")[0]) + 1) for r in chunks.split(","))
    return f"{task}/{method}_{targets}{bw}{c}_n{budget}_e{epochs}_lr{lr:g}_s{seed}_{split}.json"


def metric(r, task) -> float:
    return r["extra"]["exact_match"] if task == "wordnet-reverse" else Q.final(r["eval"])["choice_accuracy"]


class Study:
    def __init__(self, a):
        self.a, self.cells = a, Path(a.cells)
        self.base = self.tok = None
        self.data, self.lenses = {}, {}
        self.log_file = open(a.log, "a") if a.log else sys.stdout

    def log(self, msg):
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=self.log_file, flush=True)

    def cached(self, name):
        f = self.cells / name
        return json.loads(f.read_text()) if f.exists() else None

    def model(self):
        if self.base is None:
            import torch

            torch.set_num_threads(self.a.threads)
            self.base, self.tok = Q.load_base(Path(self.a.cache))
            if self.a.base_weights != "fp32":  # zl-export's modules: the same decode as the programs'
                from exporter.base_weights import quantize_base, stored_formats

                quantize_base(self.base, self.a.base_weights)
                self.log(f"base weights {self.a.base_weights}: {stored_formats(self.base)}")
        return self.base, self.tok

    def task_data(self, task):
        if task not in self.data:
            base, tok = self.model()
            budget = max(self.a.budgets)
            self.data[task] = load_task(task, tok, budget, self.a.val, self.a.test, self.a.seq_len, self.a.data_seed)
        return self.data[task]

    def settings(self, epochs, targets):
        base, tok = self.model()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return SimpleNamespace(micro_batch=self.a.micro_batch, seq_len=self.a.seq_len, window=self.a.window,
                               curve_every=self.a.curve_every, pad_id=pad, epochs=epochs, targets=targets)

    def task_lenses(self, task, budget, extra=()):
        """The frozen lens zl-export would fit, on this budget's training text; fitted once, kept on disk.
        `extra`: boundaries a tail:D readout stops at (Q.tail_lens_boundaries), fitted the same way."""
        import torch

        extra = tuple(sorted(extra))
        key = (task, budget, extra)
        if key not in self.lenses:
            ends = "" if self.a.chunks == Q.DEFAULT_SPLIT else "_ends" + "-".join(str(last) for _, last in Q.CHUNKS[:-1])
            ends += "" if not extra else "_at" + "-".join(map(str, extra))
            f = Path(self.a.cache) / "lenses" / f"{task}_n{budget}_seq{self.a.seq_len}_d{self.a.data_seed}{ends}.pt"
            if f.exists():
                self.lenses[key] = torch.load(f)
            else:
                (data, _), s = self.task_data(task), self.settings(1, "qv")
                mbs = Q.batches(data["train"][:budget], range(budget), s.micro_batch, s.seq_len, s.pad_id)
                # on the fp32 base, also for a quantized one: zl-export fits the lens before it quantizes
                fp32 = self.base if self.a.base_weights == "fp32" else Q.load_base(Path(self.a.cache))[0]
                self.lenses[key] = Q.fit_lenses(fp32, mbs, log=self.log, extra=extra)
                f.parent.mkdir(parents=True, exist_ok=True)
                torch.save(self.lenses[key], f)
        return self.lenses[key]

    def claim(self, name) -> bool:
        """Whether this worker may run the cell: a lock file holding our pid (one of a dead worker is taken over)."""
        lock = (self.cells / name).with_suffix(".lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                return True
            except FileExistsError:
                try:
                    os.kill(int(lock.read_text() or 0), 0)
                    return False  # another live worker runs it
                except (ProcessLookupError, ValueError, FileNotFoundError):
                    lock.unlink(missing_ok=True)  # its worker died: take the cell over
        return False

    def run_cell(self, task, method, lr, seed, budget, split, epochs=None, targets=None, wait=True):
        """The cell's result: from disk, or run here; another worker's running cell is waited for
        (wait=False: None, so the caller moves on to a cell it can run)."""
        epochs = epochs or self.a.epochs
        targets = targets or self.a.targets
        name = cell_name(task, method, lr, seed, budget, epochs, targets, split, self.a.base_weights, self.a.chunks)
        while True:
            r = self.cached(name)
            if r is not None:
                return r
            if self.claim(name):
                break
            if not wait:
                return None
            time.sleep(20)
        try:
            return self._run_cell(name, task, method, lr, seed, budget, split, epochs, targets)
        finally:
            (self.cells / name).with_suffix(".lock").unlink(missing_ok=True)

    def _run_cell(self, name, task, method, lr, seed, budget, split, epochs, targets):
        (data, label_ids), s = self.task_data(task), self.settings(epochs, targets)
        d = dict(data, train=data["train"][:budget], train_rows=data["train_rows"][:budget])
        d[split] = data[split]
        lenses = (self.task_lenses(task, budget, Q.tail_lens_boundaries(method))
                  if method.endswith("-lens") or method == PIPELINE else None)
        curve_mbs = None
        if split == "test" and self.a.curve_every:
            curve_mbs = Q.batches(data["validation"], range(min(self.a.curve_val, len(data["validation"]))),
                                  s.micro_batch, s.seq_len, s.pad_id)
        rows = data[f"{split}_rows"]
        # the generative task's score: greedy generation through the trained model, before its LoRA is unloaded
        extra = ((lambda pm: exact_match(Q.causal_lm(pm), self.tok, rows, s.seq_len))
                 if task == "wordnet-reverse" else None)
        n_mb = [0]

        def log(msg):  # every 32nd micro-batch: enough to see progress and speed
            n_mb[0] += 1
            if n_mb[0] % 32 == 0:
                self.log(msg.strip())

        self.log(f"start {name}")
        t0, c0 = time.time(), time.process_time()  # CPU time: what a cell costs, whatever the machine's load
        if method == PIPELINE:
            s.pipeline_export = str(self.pipeline_export(task, budget, seed, d["train"]))
            s.cache = str(Path(self.a.cache) / "pipeline_runs" / f"{task}_n{budget}")
            r = Q.pipeline_train_and_eval(self.base, d, lr, seed, s, label_ids, lenses, log=self.log,
                                          alpha=Q.ALPHAS[PIPELINE_TWIN], extra_eval=extra)
        else:
            r = Q.train_and_eval(self.base, d, method, lr, seed, s, label_ids, split, curve_mbs=curve_mbs,
                                 lenses=lenses, log=log, extra_eval=extra)
        r.update(task=task, budget=budget, epochs=epochs, targets=targets, base_weights=self.a.base_weights,
                 chunks=trained_split(method, self.a.chunks),
                 wall_seconds=time.time() - t0, cpu_seconds=time.process_time() - c0,
                 load_average=" ".join(f"{x:.1f}" for x in os.getloadavg()))
        f = self.cells / name
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(r, indent=1))
        tmp.rename(f)  # a cell on disk is a finished cell
        self.log(f"done {name}: {METRIC[task]} {metric(r, task):.3f}, answer NLL "
                 f"{Q.final(r['eval'])['answer_nll']:.3f} ({r['wall_seconds']:.0f} s, load {r['load_average']})")
        return r

    def pipeline_export(self, task, budget, seed, train) -> Path:
        """SmolLM2's ZeroLock programs as zl-export writes them, holding this budget's lenses (the
        fast twin's, fitted on the same text) and LoRA initialised from `seed` as the fast path's;
        readout rows enough for the budget's fullest micro-batch. Exported once, kept in --cache."""
        from exporter.config import ExportConfig
        from exporter.export import export_model

        s = self.settings(1, "qv")
        mbs = Q.batches(train, range(len(train)), s.micro_batch, s.seq_len, s.pad_id)
        rows = max(int((b["labels"] != -100).sum()) for b in mbs)
        rows = -(-rows // 8) * 8
        out = Path(self.a.cache) / "pipeline_exports" / f"{task}_n{budget}_seq{s.seq_len}_mb{s.micro_batch}_s{seed}_r{rows}"
        if not (out / "manifest.json").exists():
            cfg = ExportConfig(seq_len=s.seq_len, micro_batch=s.micro_batch, loss_positions=rows, seed=seed,
                               readout="lens", alpha=Q.ALPHAS[PIPELINE_TWIN][0])
            self.log(f"exporting {out.name} (readout rows {rows})")
            export_model("smollm2", ",".join(f"{first}-{last}" for first, last in Q.CHUNKS), out, cfg,
                         lenses=self.task_lenses(task, budget), progress=self.log)
        return out

    def chosen_lr(self, task, method, run=True, swept_at_one_epoch=False):
        """The sweep's choice (lowest validation answer NLL) at --sweep-budget, seed 0; None if unfinished
        (swept_at_one_epoch: the one-epoch sweep's, whatever --epochs says)."""
        scores = {}
        if run:  # first every cell no other worker holds, then wait for theirs
            for lr in self.a.lrs:
                self.run_cell(task, method, lr, 0, self.a.sweep_budget, "validation", wait=False)
        for lr in self.a.lrs:
            r = (self.run_cell(task, method, lr, 0, self.a.sweep_budget, "validation") if run else
                 self.cached(cell_name(task, method, lr, 0, self.a.sweep_budget, 1 if swept_at_one_epoch else self.a.epochs,
                                       self.a.targets, "validation")))
            if r is None:
                return None
            scores[lr] = Q.final(r["eval"])["answer_nll"]
        return min(scores, key=scores.get)

    def swept_lr(self, task, method):
        """The fp32 one-epoch sweep's choice, which must have finished (runs without a sweep of their own);
        a tail:D method's is the default's (issue 49: the depth curve at the default's swept LR)."""
        method = PIPELINE_TWIN if Q.tail_depth(method) is not None else method
        lr = self.chosen_lr(task, method, run=False, swept_at_one_epoch=True)
        if lr is None:
            sys.exit(f"bench/quality_study.py: the fp32 one-epoch sweep of {method} on {task} is unfinished; "
                     f"run the study with --methods {method} (no --base-weights, --epochs) first")
        return lr

    def run(self):
        a = self.a
        if a.methods == [PIPELINE]:
            return self.run_pipeline()
        if not sweeps(a):
            return self.run_at_swept_rates()
        for task in a.tasks:
            self.run_cell(task, "zero-shot", 0.0, 0, 0, "test", epochs=1, wait=False)
            # the sweeps of all methods first, LR by LR, so that two workers (or a run cut short)
            # cover every method's most likely rates early; --lrs in the order to run them
            for lr in a.lrs:
                for m in a.methods:
                    self.run_cell(task, m, lr, 0, a.sweep_budget, "validation", wait=False)
            for m in a.methods:
                lr = self.chosen_lr(task, m)
                self.log(f"{task} {m}: chosen LR {lr:g}")
                for seed in a.seeds:
                    self.run_cell(task, m, lr, seed, a.sweep_budget, "test", wait=False)
        for task in a.tasks:
            for budget in [b for b in a.budgets if b != a.sweep_budget]:
                for seed in a.seeds:
                    for m in a.methods:
                        self.run_cell(task, m, self.chosen_lr(task, m), seed, budget, "test", wait=False)
        self.log("plan finished")

    def run_pipeline(self):
        """ZeroLock's default through the real pipeline (zl-host run, three emulated phones, the
        ExecuTorch programs) at the LR its fast twin's sweep chose: --seeds x --budgets per task."""
        for task in self.a.tasks:
            lr = self.swept_lr(task, PIPELINE_TWIN)
            for budget in self.a.budgets:
                for seed in self.a.seeds:
                    self.run_cell(task, PIPELINE, lr, seed, budget, "test", wait=False)
        self.log("plan finished (real pipeline)")

    def run_at_swept_rates(self):
        """A quantized base, more than one epoch, another split or a tail readout, at the LRs the fp32
        base's one-epoch sweep on the default split chose (it must have finished): seeds x budgets on
        --split, no sweep of their own."""
        a = self.a
        lrs = {}
        for task in a.tasks:
            for m in a.methods:
                lrs[task, m] = self.swept_lr(task, m)
        for budget in sorted(a.budgets, key=lambda b: b != a.sweep_budget):  # the sweep's budget first
            for seed in a.seeds:
                for task in a.tasks:
                    for m in a.methods:
                        self.run_cell(task, m, lrs[task, m], seed, budget, a.split, wait=False)
        self.log(f"plan finished ({a.base_weights} base, {a.epochs} epoch(s), chunks {a.chunks}, {a.split} split)")


def sweeps(a) -> bool:
    """Whether this run sweeps LRs: the fp32 base, one epoch, the default split, no tail readout."""
    return (a.base_weights == "fp32" and a.epochs == 1 and PIPELINE not in a.methods and a.chunks == Q.DEFAULT_SPLIT
            and not any(Q.tail_depth(m) is not None for m in a.methods))


# ---------------------------------------------------------------- report

def load_cells(cells: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(cells.glob("*/*.json"))]


def summarise(runs, planned_lrs=()) -> dict:
    """{task: {"sweep": {method: {lr: (val NLL, val metric)}}, "test": {(method, budget): stats}}}."""
    out = {}
    for r in runs:
        t = out.setdefault(r["task"], {"sweep": {}, "test": {}})
        bw = r.get("base_weights", "fp32")
        split = r.get("chunks", Q.DEFAULT_SPLIT)
        key = (f"{r['method']}|{r.get('targets', 'qv')}|e{r.get('epochs', 1)}" + ("" if bw == "fp32" else f"|{bw} base")
               + ("" if split == Q.DEFAULT_SPLIT else f"|chunks {split}"))
        if r["split"] == "validation":
            t["sweep"].setdefault(key, {})[r["lr"]] = {"answer_nll": Q.final(r["eval"])["answer_nll"],
                                                       "metric": metric(r, r["task"]), "budget": r["budget"]}
        else:
            t["test"].setdefault(f"{key}|n{r['budget']}", []).append(r)
    for task, t in out.items():
        for key, sw in t["sweep"].items():
            lrs = sorted(sw)
            best = min(lrs, key=lambda x: sw[x]["answer_nll"])
            sw["chosen"] = best
            sw["at_edge"] = len(lrs) > 1 and best in (lrs[0], lrs[-1])
            sw["missing"] = sorted(set(planned_lrs) - set(lrs))  # a sweep still running: its choice may move
        stats = {}
        for key, rs in t["test"].items():
            v = np.array([metric(r, task) for r in rs])
            nll = np.array([Q.final(r["eval"])["answer_nll"] for r in rs])
            stats[key] = {"seeds": sorted(r["seed"] for r in rs), "lr": rs[0]["lr"], "budget": rs[0]["budget"],
                          "mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else None,
                          "nll": float(nll.mean()), "per_seed": {r["seed"]: metric(r, task) for r in rs},
                          "seconds": float(np.mean([r["train_seconds"] for r in rs]))}
        t["test"] = stats
    return out


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(summary), figsize=(5.5 * len(summary), 7.5), squeeze=False)
    for ax, (task, t) in zip(axes[1], sorted(summary.items())):  # the sweeps: validation metric against LR
        for i, (key, sw) in enumerate(sorted(t["sweep"].items())):
            lrs = sorted(x for x in sw if not isinstance(x, str))
            ax.plot(lrs, [sw[x]["metric"] for x in lrs], marker="o", color=f"C{i}", label=key.replace("|", " "))
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (seed 0, sweep budget)")
        ax.set_ylabel(f"validation {METRIC[task].replace('_', ' ')}")
        ax.set_title(f"{task}: LR sweep")
        if t["sweep"]:  # a task with no sweep cell yet has nothing to label
            ax.legend(fontsize=7)
    for ax, (task, t) in zip(axes[0], sorted(summary.items())):
        methods = sorted({k.rsplit("|", 1)[0] for k in t["test"] if not k.startswith("zero-shot")})
        for i, m in enumerate(methods):
            pts = sorted((s["budget"], s["mean"], s["std"] or 0) for k, s in t["test"].items() if k.rsplit("|", 1)[0] == m)
            if pts:
                x, y, e = zip(*pts)
                ax.errorbar(x, y, yerr=e, marker="o", capsize=3, color=f"C{i}", label=m.replace("|", " "))
        zs = [s for k, s in t["test"].items() if k.startswith("zero-shot")]
        if zs:
            ax.axhline(zs[0]["mean"], color="grey", ls="--", label="zero-shot")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training samples")
        ax.set_ylabel(f"test {METRIC[task].replace('_', ' ')}")
        ax.set_title(f"SmolLM2-135M, {task}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(summary, settings) -> str:
    lines = []
    for task, t in sorted(summary.items()):
        met = METRIC[task].replace("_", " ")
        lines += [f"**{task}** ({met} on the test split; LR by validation answer NLL):", "",
                  "| method (LoRA targets, epochs) | budget | LR | seeds | test " + met + " | answer NLL |",
                  "|---|---|---|---|---|---|"]
        for key, s in sorted(t["test"].items(), key=lambda kv: (kv[1]["budget"], kv[0])):
            m, budget = key.rsplit("|", 1)
            sd = f" ± {s['std']:.3f}" if s["std"] is not None else ""
            lines.append(f"| {m.replace('|', ', ')} | {s['budget']} | {s['lr']:g} | {','.join(map(str, s['seeds']))} | "
                         f"{s['mean']:.3f}{sd} | {s['nll']:.3f} |")
        lines.append("")
        for key, sw in sorted(t["sweep"].items()):
            lrs = sorted(x for x in sw if not isinstance(x, str))
            lines.append(f"- Sweep {key.replace('|', ', ')} (budget {sw[lrs[0]]['budget']}, seed 0, validation): "
                         + ", ".join(f"{x:g}: NLL {sw[x]['answer_nll']:.3f} / {sw[x]['metric']:.3f}" for x in lrs)
                         + f" -> {sw['chosen']:g}"
                         + (f" so far (partial sweep: {', '.join(f'{x:g}' for x in sw['missing'])} not run yet)"
                            if sw["missing"] else " (AT THE EDGE of the sweep)" if sw["at_edge"] else " (inside the sweep)"))
        lines.append("")
    return "\n".join(lines)


SUBHEADING = "### Issue 32 study: budgets, a wide LR sweep, two tasks (bench/quality_study.py)"


def header(runs, a) -> str:
    from bench.common import machine

    m = machine()
    loads = sorted({r["load_average"].split()[0] for r in runs if r.get("load_average")}, key=float)
    return (f"{len(runs)} cell{'s' if len(runs) != 1 else ''} finished (bench/results/quality_cells/, "
            f"one JSON per (task, method, LR, seed, budget, "
            f"epochs, LoRA targets, split)); {m['cores']}-core machines shared with the other sessions "
            f"(this report written on {m['cpu']}; 1-min load "
            f"average at the cells' ends {loads[0] if loads else '?'}-{loads[-1] if loads else '?'}), each worker one "
            f"torch thread at nice 19. Settings for every method: SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32), chunks "
            f"0-9 / 10-19 / 20-29 (a row naming chunks: ZeroLock on that split, at the default split's LRs), "
            f"LoRA r=8, lora_alpha=16 on {a.targets} ({', '.join(Q.LORA_TARGETS[a.targets])}), "
            f"zl_mobile AdamW, micro-batch {a.micro_batch}, window {a.window} (token-level mean), seq len {a.seq_len}, "
            f"{a.epochs} epoch(s), data seed {a.data_seed}; validation {a.val} rows, test {a.test} rows; LR swept over "
            f"{', '.join(f'{x:g}' for x in sorted(a.lrs))} at budget {a.sweep_budget}, seed 0, chosen by validation answer "
            f"NLL; then seeds {','.join(map(str, a.seeds))} at budgets {', '.join(map(str, a.budgets))}. "
            f"Plot: `bench/results/quality_study.png` (test metric vs training samples; validation metric vs LR).")


def write_doc(text: str, doc: Path = Q.DOC, subheading: str = SUBHEADING) -> None:
    """Replace (or add, at the end of the Quality section) only this study's sub-section."""
    lines = doc.read_text().splitlines(keepends=True)
    body = subheading + "\n\n" + text.rstrip("\n") + "\n\n"
    try:
        start = next(i for i, ln in enumerate(lines) if ln.rstrip() == subheading)
    except StopIteration:
        q = next((i for i, ln in enumerate(lines) if ln.rstrip() == Q.HEADING), None)
        if q is None:
            sys.exit(f"bench/quality_study.py: no '{Q.HEADING}' in {doc}; add the Quality section first")
        start = next((j for j in range(q + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        lines[start:start] = [body]
        doc.write_text("".join(lines))
        return
    end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith(("## ", "### "))), len(lines))
    lines[start:end] = [body]
    doc.write_text("".join(lines))


DEPTH_HEADING = "### Issue 49: the tail readout's depth (tail:D, bench/quality_study.py depth)"
DEPTH_COMMAND = ("nice -n 19 python bench/quality_study.py run --tasks wordnet-reverse --methods M --budgets 1024 "
                 "--seeds 0 --split validation --lrs 3e-4,1e-3,3e-3,1e-2")


def depth_of(method):
    """The tail:D label of a ZeroLock method with the default's alphas: 0 for the default (the lens)."""
    if method == PIPELINE_TWIN:
        return "0 (lens)"
    d = Q.tail_depth(method)
    return None if d is None else str(d)


def depth_table(runs, lrs=(), planned=()) -> str:
    """Issue 49's depth curve: every tail:D cell, with the default (tail:0) and BP at their swept LRs on
    the same task, budget, split and seed; exact match / choice accuracy, answer NLL, time. `planned`:
    (task, method, budget, split, seed) cells to list as not finished while they are missing."""
    sweep = summarise(runs, lrs)
    tails = [r for r in runs if Q.tail_depth(r["method"]) is not None]
    where = {(r["task"], r["budget"], r["split"], r["seed"]) for r in tails} | {(t, b, sp, s) for t, _, b, sp, s in planned}

    def plain(r):
        return (r.get("epochs", 1) == 1 and r.get("targets", "qv") == "qv" and r.get("base_weights", "fp32") == "fp32"
                and r.get("chunks", Q.DEFAULT_SPLIT) == Q.DEFAULT_SPLIT)

    rows = list(tails)
    have = {(r["task"], r["method"], r["budget"], r["split"], r["seed"]) for r in tails}
    rows += [{"task": t, "method": m, "budget": b, "split": sp, "seed": s, "missing": True}
             for t, m, b, sp, s in planned if (t, m, b, sp, s) not in have]
    for r in runs:
        if r["method"] in ("bp", PIPELINE_TWIN) and plain(r) and (r["task"], r["budget"], r["split"], r["seed"]) in where:
            chosen = sweep.get(r["task"], {}).get("sweep", {}).get(f"{r['method']}|qv|e1", {}).get("chosen")
            if r["lr"] == chosen:
                rows.append(r)
    order = {"bp": -1}
    rows.sort(key=lambda r: (r["task"], r["budget"], r["split"], r["seed"], order.get(r["method"], 0),
                             (lambda d: 99 if d == "all" else d)(Q.tail_depth(r["method"]) or 0)))
    lines = ["| task | budget | split | seed | method | tail:D | LR | " + "exact match / choice acc. | answer NLL | "
             "train s | wall s (CPU s) | load at end |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['task']} | {r['budget']} | {r['split']} | {r['seed']} | {r['method']} | "
                         f"{depth_of(r['method'])} | - | not finished | - | - | - | - |")
            continue
        lines.append(f"| {r['task']} | {r['budget']} | {r['split']} | {r['seed']} | {r['method']} | "
                     f"{depth_of(r['method']) or '- (backprop)'} | {r['lr']:g} | {metric(r, r['task']):.3f} | "
                     f"{Q.final(r['eval'])['answer_nll']:.3f} | {r['train_seconds']:.0f} | "
                     f"{r.get('wall_seconds', r['train_seconds']):.0f}"
                     + (f" ({r['cpu_seconds']:.0f})" if r.get("cpu_seconds") is not None else "")
                     + f" | {r.get('load_average', '?').split()[0]} |")
    return "\n".join(lines)


def depth(a):
    runs = load_cells(Path(a.cells))
    planned = [(t, m, b, a.split, s) for t in a.tasks for m in a.methods if Q.tail_depth(m) is not None
               for b in a.budgets for s in a.seeds]
    text = ("Each tail:D cell beside BP and the default (tail:0) at their swept LRs, same task, budget, split and "
            "seed (exact match for the generative task; wall seconds on shared 2-core machines, CPU seconds where "
            "the cell recorded them):\n\n" + depth_table(runs, a.lrs, planned))
    if a.notes:
        text += "\n\n" + Path(a.notes).read_text()
    print(text)
    if a.doc:
        write_doc(text, subheading=DEPTH_HEADING)


def report(a):
    runs = load_cells(Path(a.cells))
    summary = summarise(runs, a.lrs)
    if summary:
        plot(summary, PLOT)
    OUT.write_text(json.dumps({"settings": {k: v for k, v in vars(a).items() if k not in ("cmd",)},
                               "summary": summary}, indent=1, default=str))
    text = header(runs, a) + "\n\n" + markdown(summary, a)
    if a.notes:
        text += "\n" + Path(a.notes).read_text()
    print(text)
    if a.doc:
        write_doc(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=("run", "report", "depth"))
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--methods", default="bp,zl-last1-lens")
    p.add_argument("--lrs", default="3e-3,1e-2,1e-3,3e-2,3e-4",
                   help="the LR sweep, per method and task, in the order to run (most likely first)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budgets", default="256,1024,2048", help="training examples")
    p.add_argument("--sweep-budget", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--targets", default="qv", choices=sorted(Q.LORA_TARGETS), help="LoRA on q/v or every linear layer")
    p.add_argument("--base-weights", default="fp32", choices=BASE_WEIGHTS,
                   help="the frozen base as zl-export --base-weights stores it (int8 / int4: at the fp32 sweep's LRs)")
    p.add_argument("--chunks", default=Q.DEFAULT_SPLIT,
                   help=f"ZeroLock's split of the {Q.LAYERS} layers (another split: at the default's swept LRs)")
    p.add_argument("--split", default="test", choices=("test", "validation"),
                   help="the split runs without a sweep evaluate on (issue 49's depth curve: validation)")
    p.add_argument("--val", type=int, default=128)
    p.add_argument("--test", type=int, default=400)
    p.add_argument("--curve-every", type=int, default=256)
    p.add_argument("--curve-val", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (run one worker per core)")
    p.add_argument("--cells", default=str(CELLS))
    p.add_argument("--cache", default=os.environ.get("ZL_SMOLLM2_CACHE", "/tmp/zl_smollm2_fp32"))
    p.add_argument("--log", default=None, help="progress lines to this file (default stdout)")
    p.add_argument("--doc", action="store_true", help="report: write the sub-section into docs/BENCHMARKS.md")
    p.add_argument("--notes", default=None, help="report: a markdown file of findings appended to the sub-section")
    a = p.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    bad = [t for t in a.tasks if t not in TASKS]
    if bad:
        p.error(f"unknown task(s) {', '.join(bad)}; use {', '.join(TASKS)}")
    a.methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in a.methods if m not in Q.METHODS or m == "zero-shot"]
    if bad:
        p.error(f"unknown or unsupported method(s) {', '.join(bad)}; use e.g. bp, zl-last1-lens, zl0.5-lens")
    if PIPELINE in a.methods and (a.methods != [PIPELINE] or a.base_weights != "fp32" or a.targets != "qv"
                                  or a.epochs != 1):
        p.error(f"--methods {PIPELINE} runs alone, on the fp32 base, q/v LoRA, one epoch (what the programs "
                f"hold), at {PIPELINE_TWIN}'s chosen LR: give it in a run of its own")
    try:
        Q.set_chunks(a.chunks)
    except ChunkSpecError as e:
        p.error(f"--chunks: {e}")
    a.chunks = ",".join(f"{first}-{last}" for first, last in Q.CHUNKS)
    if a.chunks != Q.DEFAULT_SPLIT and (len(Q.CHUNKS) != 3 or a.targets == "lastwide" or PIPELINE in a.methods):
        p.error("--chunks: three chunks, q/v or every-linear LoRA, the fast path (per-chunk alphas and lastwide's "
                "layers are written for three chunks; the pipeline's programs for the default split)")
    a.lrs = [float(x) for x in a.lrs.split(",")]
    a.seeds = [int(x) for x in a.seeds.split(",")]
    a.budgets = [int(x) for x in a.budgets.split(",")]
    if a.split != "test" and sweeps(a):
        p.error("--split validation is for runs without a sweep (a tail readout, another split, ...): "
                "the sweep's cells are the validation split's already")
    if sweeps(a) and a.sweep_budget not in a.budgets:
        p.error(f"--sweep-budget {a.sweep_budget} is not one of --budgets {a.budgets}")
    if a.cmd == "report":
        report(a)
        return 0
    if a.cmd == "depth":
        depth(a)
        return 0
    Study(a).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
