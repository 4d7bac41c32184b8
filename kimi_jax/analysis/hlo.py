"""Collectives of a compiled XLA program, read from its optimized HLO text (the sharding sweep's counter)."""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}
SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\))?.*\{\s*$")


def shape_bytes(text: str) -> float:
    total = 0.0
    for dt, dims in SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DT_BYTES.get(dt, 4)
    return total


def hlo_collectives(hlo: str) -> dict:
    """Collectives of an optimized HLO module, weighted by how often each runs.

    Each computation's multiplicity is the sum over its callers of (caller multiplicity x trip count when
    it is a while body with a ``known_trip_count``); the layer scans are while loops, so a collective in the
    MoE scan body counts ``num_moe_layers`` times. Bytes are result bytes, at the source dtype for all-reduces
    that the CPU backend promoted from bf16 to f32. Returns {"per_kind": {kind: {"count", "bytes"}},
    "sites": [(kind, computation, multiplicity, bytes)]}. Async pairs (``-start``/``-done``) count once.
    """
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        s = line.strip()
        if cur is None:
            if s.endswith("{") and not s.startswith("HloModule"):
                m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", s)
                if m:
                    cur = m.group(2)
                    comps[cur] = []
                    if m.group(1):
                        entry = cur
            continue
        if s == "}":
            cur = None
            continue
        comps[cur].append(s)
    calls: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}   # callee -> [(caller, factor)]
    for c, lines in comps.items():
        for s in lines:
            trip = 1
            if " while(" in s:
                m = re.search(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)', s)
                trip = int(m.group(1)) if m else 1
            for key, braced, single in re.findall(r"\b(body|condition|to_apply|calls|branch_computations|"
                                                  r"true_computation|false_computation|called_computations)="
                                                  r"(?:\{([^}]*)\}|%?([\w.\-]+))", s):
                for name in re.split(r",\s*", braced or single):
                    name = name.strip().lstrip("%")
                    if name in calls:
                        calls[name].append((c, trip if key == "body" else 1))
    mult: dict[str, int] = {}

    def multiplicity(c, depth=0):
        if c in mult:
            return mult[c]
        if c == entry or depth > 50:
            mult[c] = 1
            return 1
        m = sum(multiplicity(caller, depth + 1) * f for caller, f in calls.get(c, []))
        mult[c] = m
        return m

    per_kind = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    sites = []
    for c, lines in comps.items():
        for s in lines:
            m = re.match(r"^(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(", s)
            if not m:
                continue
            kind = m.group(2)
            nbytes = shape_bytes(m.group(1))
            if m.group(3):   # async start: result is a tuple (operands, outputs); count the output half
                nbytes /= 2
            if kind == "all-reduce" and "_promoted" in s and m.group(1).startswith("f32"):
                nbytes /= 2  # the CPU backend promotes bf16 all-reduces to f32 (to_apply=..._promoted); GPU keeps bf16
            k = multiplicity(c)
            per_kind[kind]["count"] += k
            per_kind[kind]["bytes"] += k * nbytes
            sites.append((kind, c, k, nbytes))
    return {"per_kind": per_kind, "sites": sites}
