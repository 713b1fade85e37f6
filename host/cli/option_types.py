"""Parsers of option values (argparse `type=`): each refuses a bad value with a one-line reason,
which argparse prints as `argument --x: <reason>`. Shared by the commands built from
host/run/config.py's definitions."""
from __future__ import annotations

import argparse


def positive(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def non_negative(text: str) -> float:
    v = float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def fraction(text: str) -> float:
    v = float(text)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def _per_stage(text: str, example: str, ok, refusal: str) -> float | list:
    """'x' -> x; 'x0,x1,...' -> one per stage; each value must pass `ok`, else `refusal` (with {v})."""
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or one per stage ({example}), got {text}") from None
    bad = [v for v in vals if not ok(v)]
    if bad:
        raise argparse.ArgumentTypeError(refusal.format(v=f"{bad[0]:g}"))
    return vals[0] if len(vals) == 1 else vals


def alphas(text: str) -> float | list:
    """'0.5' -> 0.5; '0.5,0.75,1' -> [0.5, 0.75, 1.0]; each in [0, 1]."""
    return _per_stage(text, "0.5,0.75,1", lambda v: 0 <= v <= 1,
                      "{v} is outside [0, 1]: the local loss is alpha*CE + (1-alpha)*KL")


def lrs(text: str) -> float | list:
    """'2e-3' -> 0.002; '0,0,3e-3' -> one per stage; each in [0, 100], as the phones' STAGE_ASSIGN rule
    (0: a forward-only stage); some stage must train."""
    vals = _per_stage(text, "0,0,3e-3", lambda v: 0 <= v <= 100,
                      "{v} is not a learning rate: give values from 0 (a forward-only stage) to 100")
    if not any(vals if isinstance(vals, list) else [vals]):
        raise argparse.ArgumentTypeError(f"{text}: every stage would be forward-only; give some stage an LR above 0")
    return vals
