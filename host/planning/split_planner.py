"""Where to cut the model and which phone runs which chunk: an exact planner, nothing else.

A pipeline runs at the pace of its slowest stage, so the planner minimises the slowest stage's
time per micro-batch over every way of cutting L layers into contiguous chunks and every
assignment of those chunks to the phones (one chunk per phone), subject to each phone's memory
budget. Dynamic programming over (layers covered, set of phones used): L * 2^P states, P * L
moves each -- a few hundred thousand steps at 30 layers and 6 phones.

Pure: no I/O, no processes. host/planning/profile.py measures the PhoneModel numbers; host/cli/zl_host.py prints
and writes the plan."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

INF = float("inf")


class InfeasibleError(Exception):
    """No split fits the phones' memory. `missing_bytes`: the least memory that would have to be
    added (summed over the phones that lack it) for the best split to fit."""

    def __init__(self, message: str, missing_bytes: int, short: dict[str, int]):
        super().__init__(message)
        self.missing_bytes = missing_bytes
        self.short = short


@dataclass(frozen=True)
class PhoneModel:
    """One phone's costs, from its profile (times in seconds per micro-batch, sizes in bytes).

    A stage of n layers costs fixed_s + n * layer_s (+ first_extra_s on stage 0) of compute per
    micro-batch, plus (on every stage but the last) one hidden state sent at link_mbit. It holds
    runtime + readout + n * layer weights (+ the embedding on stage 0) + its activations:
    act_fixed_bytes + n * act_layer_bytes for the micro-batch in its phases, and n *
    held_layer_bytes for every further forward the schedule keeps waiting for its phase 2."""
    name: str
    layer_s: float
    fixed_s: float
    first_extra_s: float = 0.0
    link_mbit: float | None = None   # None: not measured / not limiting
    budget_bytes: int | None = None  # None: no limit known
    runtime_bytes: int = 0
    readout_bytes: int = 0
    embed_bytes: int = 0
    layer_bytes: int = 0
    act_fixed_bytes: int = 0
    act_layer_bytes: int = 0
    held_layer_bytes: int = 0

    def compute_s(self, n: int, first: bool) -> float:
        return self.fixed_s + n * self.layer_s + (self.first_extra_s if first else 0.0)

    def link_s(self, frame_bytes: int, last: bool) -> float:
        if last or not self.link_mbit or not frame_bytes:
            return 0.0
        return frame_bytes * 8 / (self.link_mbit * 1e6)

    def stage_s(self, n: int, first: bool, last: bool, frame_bytes: int = 0) -> float:
        return self.compute_s(n, first) + self.link_s(frame_bytes, last)

    def memory_bytes(self, n: int, first: bool, held: int = 1) -> int:
        return int(self.runtime_bytes + self.readout_bytes + (self.embed_bytes if first else 0)
                   + n * self.layer_bytes + self.act_fixed_bytes + n * self.act_layer_bytes
                   + max(held - 1, 0) * n * self.held_layer_bytes)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Stage:
    phone: str
    first: int  # inclusive layer range
    last: int
    time_s: float
    compute_s: float
    link_s: float
    memory_bytes: int
    budget_bytes: int | None

    @property
    def layers(self) -> int:
        return self.last - self.first + 1


@dataclass
class Plan:
    stages: list[Stage]
    bottleneck_s: float
    ideal_s: float  # the continuous optimum: all work spread in proportion to speed (a lower bound)
    extras: dict = field(default_factory=dict)

    @property
    def chunks(self) -> str:
        """The chunk spec zl-export --chunks takes, e.g. '0-6,7-13,14-21'."""
        return ",".join(f"{s.first}-{s.last}" for s in self.stages)

    @property
    def devices(self) -> list[str]:
        return [s.phone for s in self.stages]

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda k: self.stages[k].time_s)

    def to_json(self) -> dict:
        return {"chunks": self.chunks, "devices": self.devices, "bottleneck_s": self.bottleneck_s,
                "bottleneck_stage": self.bottleneck_stage, "ideal_s": self.ideal_s,
                "stages": [asdict(s) for s in self.stages], **self.extras}


# ---------------------------------------------------------------- the exact search
def solve(num_layers: int, num_phones: int, cost: Callable[[int, int, int, int], float],
          fits: Callable[[int, int, int, int], bool]) -> tuple[float, list[tuple[int, int, int]]] | None:
    """Minimise max over stages of cost(phone, i, j, k) (layers i..j-1 on `phone` as stage k) over
    every cut of range(num_layers) into num_phones non-empty contiguous chunks and every
    assignment of phones to them (a permutation), using only moves with fits(...) true.

    Returns (bottleneck, [(phone, i, j), ...] in stage order), or None if nothing fits. Among the
    splits with the optimal bottleneck it returns one with the least total cost."""
    L, P = num_layers, num_phones
    if P < 1 or L < P:
        return None
    full = (1 << P) - 1

    def run(score, combine, bound):
        best: dict[tuple[int, int], float] = {(0, 0): 0.0}
        parent: dict[tuple[int, int], tuple[int, int, int]] = {}
        # states in order of layers covered; each move covers >= 1 layer, so i only grows
        by_i: list[list[int]] = [[] for _ in range(L + 1)]
        by_i[0].append(0)
        for i in range(L):
            for used in by_i[i]:
                here = best[(i, used)]
                k = bin(used).count("1")
                left = P - k - 1  # phones still to place after this one: each needs a layer
                for p in range(P):
                    if used >> p & 1:
                        continue
                    nxt_used = used | 1 << p
                    hi = L - left
                    for j in range(i + 1, hi + 1):
                        if left == 0 and j != L:
                            continue
                        if not fits(p, i, j, k):
                            continue
                        c = cost(p, i, j, k)
                        if c > bound:
                            continue
                        v = combine(here, score(c, p, i, j, k))
                        key = (j, nxt_used)
                        if v < best.get(key, INF):
                            if key not in best:
                                by_i[j].append(nxt_used)
                            best[key] = v
                            parent[key] = (p, i, used)
        if (L, full) not in best:
            return None
        out, key = [], (L, full)
        while key != (0, 0):
            p, i, used = parent[key]
            out.append((p, i, key[0]))
            key = (i, used)
        return best[(L, full)], out[::-1]

    first = run(lambda c, *_: c, max, INF)
    if first is None:
        return None
    bottleneck = first[0]
    # second pass: the least total time among splits no slower than the optimum (a sum is exact
    # in a DP; a tie-break on (max, sum) would not be)
    second = run(lambda c, *_: c, lambda a, b: a + b, bottleneck * (1 + 1e-12) + 1e-15)
    return bottleneck, (second or first)[1]


def least_overshoot(num_layers: int, num_phones: int,
                    over: Callable[[int, int, int, int], int]) -> tuple[int, list[tuple[int, int, int]]] | None:
    """The split that would need the least memory added: minimise the sum over stages of
    over(phone, i, j, k) (bytes a stage lacks, 0 when it fits). Exact, same search."""
    L, P = num_layers, num_phones
    if P < 1 or L < P:
        return None
    best = {(0, 0): 0}
    parent = {}
    for i, used in _states(L, P):
        if (i, used) not in best:
            continue
        k = bin(used).count("1")
        left = P - k - 1
        for p in range(P):
            if used >> p & 1:
                continue
            for j in range(i + 1, L - left + 1):
                if left == 0 and j != L:
                    continue
                v = best[(i, used)] + over(p, i, j, k)
                key = (j, used | 1 << p)
                if v < best.get(key, INF):
                    best[key] = v
                    parent[key] = (p, i, used)
    key = (L, (1 << P) - 1)
    if key not in best:
        return None
    total, out = best[key], []
    while key != (0, 0):
        p, i, used = parent[key]
        out.append((p, i, key[0]))
        key = (i, used)
    return total, out[::-1]


def _states(L: int, P: int):
    """(layers covered, phones used) in an order where every move goes forward."""
    for i in range(L):
        for used in range(1 << P):
            if bin(used).count("1") <= i:
                yield i, used


# ---------------------------------------------------------------- phones -> plan
def held_forwards(schedule: str, stage: int, num_stages: int, window_size: int) -> int:
    """How many forwards' activations a stage holds at once under the schedule."""
    from zl_mobile.schedules import forwards_held

    return forwards_held(schedule, stage, num_stages, window_size)


def plan_split(num_layers: int, phones: list[PhoneModel], frame_bytes: int = 0, schedule: str = "zerolock",
               window_size: int = 4, held: Callable[[int, int], int] | None = None) -> Plan:
    """The best split of num_layers over all of `phones` (one contiguous chunk each).
    Raises InfeasibleError (with how much memory is missing) when no split fits, ValueError when
    there are more phones than layers."""
    P, L = len(phones), num_layers
    if P == 0:
        raise ValueError("no phones to plan for: profile at least one (zl-host profile --devices ...)")
    if L < P:
        raise ValueError(f"{P} phones for {L} layers: every phone needs at least one layer; use at most {L} phones")
    held = held or (lambda k, n: held_forwards(schedule, k, n, window_size))

    def cost(p, i, j, k):
        return phones[p].stage_s(j - i, i == 0, j == L, frame_bytes)

    def mem(p, i, j, k):
        return phones[p].memory_bytes(j - i, i == 0, held(k, P))

    def fits(p, i, j, k):
        b = phones[p].budget_bytes
        return b is None or mem(p, i, j, k) <= b

    found = solve(L, P, cost, fits)
    if found is None:
        short_of = least_overshoot(L, P, lambda p, i, j, k: 0 if fits(p, i, j, k)
                                   else mem(p, i, j, k) - phones[p].budget_bytes)
        missing, split = short_of
        short = {}
        for k, (p, i, j) in enumerate(split):
            b = phones[p].budget_bytes
            need = mem(p, i, j, k)
            if b is not None and need > b:
                short[phones[p].name] = need - b
        have = sum(ph.budget_bytes or 0 for ph in phones)
        detail = ", ".join(f"{n} {_mib(v)}" for n, v in short.items())
        raise InfeasibleError(
            f"these {P} phones cannot hold the {L}-layer model: the best split still lacks {_mib(missing)} "
            f"({detail}; the phones give {_mib(have)} in all); add a phone, free memory on these, or export "
            "with --base-weights int8 or int4 / a shorter --seq-len", missing, short)
    bottleneck, split = found
    stages = []
    for k, (p, i, j) in enumerate(split):
        ph = phones[p]
        stages.append(Stage(ph.name, i, j - 1, cost(p, i, j, k), ph.compute_s(j - i, i == 0),
                            ph.link_s(frame_bytes, j == L), mem(p, i, j, k), ph.budget_bytes))
    return Plan(stages, bottleneck, ideal_time(L, phones))


def ideal_time(num_layers: int, phones: list[PhoneModel]) -> float:
    """The slowest stage's time if layers could be cut anywhere: T with sum over phones of
    (T - fixed_s) / layer_s = num_layers (the embedding's and links' costs left out), a bound
    no split in whole layers beats. Every phone runs a stage, so T is never below the largest
    fixed cost (past it the faster phones hold every layer already)."""
    speed = sum(1 / p.layer_s for p in phones)
    return max((num_layers + sum(p.fixed_s / p.layer_s for p in phones)) / speed, max(p.fixed_s for p in phones))


def evaluate_split(chunks: list[tuple[int, int]], order: list[PhoneModel], frame_bytes: int = 0,
                   schedule: str = "zerolock", window_size: int = 4) -> Plan:
    """The prediction for a given split and assignment (e.g. the even split), same cost model."""
    L, P = chunks[-1][1] + 1, len(chunks)
    stages = []
    for k, ((a, b), ph) in enumerate(zip(chunks, order)):
        n = b - a + 1
        stages.append(Stage(ph.name, a, b, ph.stage_s(n, a == 0, b == L - 1, frame_bytes), ph.compute_s(n, a == 0),
                            ph.link_s(frame_bytes, b == L - 1),
                            ph.memory_bytes(n, a == 0, held_forwards(schedule, k, P, window_size)), ph.budget_bytes))
    return Plan(stages, max(s.time_s for s in stages), ideal_time(L, order))


def even_chunks(num_layers: int, n: int) -> list[tuple[int, int]]:
    """The even split (the first chunks one layer longer when it does not divide)."""
    q, r = divmod(num_layers, n)
    out, a = [], 0
    for k in range(n):
        b = a + q + (1 if k < r else 0)
        out.append((a, b - 1))
        a = b
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
