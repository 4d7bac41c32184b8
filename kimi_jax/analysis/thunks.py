"""What a compiled GPU program launches: XLA's thunk sequence, read from a compile dump, counted per execution.

XLA's GPU executable is a sequence of thunks (``thunk_sequence_after_thunk_passes.txt`` in an ``xla_dump_to``
directory; ``compile_dumped`` makes one for a lowered program). A thunk is a kernel launch, a copy, a
collective, or structure around them: a ``kWhile`` (body repeated), a ``kConditional``, a ``kCommandBuffer`` (a
CUDA graph: its thunks are recorded once and replayed by one host call), an ``kAsyncStart``/``kAsyncDone`` pair
(work on another stream). ``count`` walks that tree once per execution of the program:

* ``gpu_ops``: every kernel, copy and collective the GPU runs, with each loop body multiplied by its trip count
  (the layer scans' ``known_trip_count`` from the optimized HLO);
* ``in_graphs``: how many of them run inside command buffers; ``host_launches``: how many separate submissions
  the host makes (one per thunk outside a graph, one per graph): the fixed per-launch cost scales with these;
* ``host_syncs``: device-to-host reads that block the host: a ``kWhile`` outside a graph without a known trip
  count copies its predicate to the host and waits, every iteration (XLA's ``WhileThunk::ExecuteOnStream``,
  xla/backends/gpu/runtime/while_thunk.cc); a ``kConditional`` outside a graph reads its branch index the same way;
* ``copy_bytes``: bytes the program's device-to-device copies move (each ``kCopy``, also those XLA emits for a
  dynamic slice, e.g. one layer's weights out of a stacked layer scan);
* ``unknown_loops``: loops whose trip count the compiler does not know (counted as one iteration: the figures
  are per iteration of them);
* ``by_scope``: ``gpu_ops`` split by the ``jax.named_scope`` path of the HLO instruction behind each thunk
  (``verify/attention/attend``: the scopes named in ``scope_names``).

These are facts about the compiled program (what it launches), not timings.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile

from kimi_jax.analysis.hlo import SHAPE, shape_bytes

_LINE = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s+\[[^\]]*\]\s*(.*?)\s*$")
_SECTION = re.compile(r"^\s*(condition|body|branch\s*\d*|branches)\s*:\s*$")
STRUCTURE = {"kWhile", "kConditional", "kCommandBuffer", "kAsyncStart", "kAsyncDone", "kSequential",
             "kDynamicSliceFusion"}   # wrappers: the work is in their children (or is a wait)


@dataclasses.dataclass
class Thunk:
    id: int
    kind: str
    text: str                           # kernel name and launch shape, or the thunk's own note
    indent: int
    section: str = ""                   # "condition" | "body" | "" inside its parent
    annotation: str = ""                # the HLO instruction it came from (thunk_metadata)
    children: list = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return self.text.split(" ", 1)[0] if self.text else self.kind


def parse(text: str) -> list[Thunk]:
    """The thunk tree of a ``thunk_sequence*.txt`` dump (top-level thunks, children nested)."""
    roots: list[Thunk] = []
    stack: list[Thunk] = []
    section = ""
    for line in text.splitlines():
        if m := _SECTION.match(line):
            section = m.group(1).split()[0]
            continue
        m = _LINE.match(line)
        if not m:
            continue
        t = Thunk(int(m.group(2)), m.group(3), m.group(4), len(m.group(1)))
        while stack and stack[-1].indent >= t.indent:
            stack.pop()
        if stack:
            parent = stack[-1]
            t.section = section if parent.kind in ("kWhile", "kConditional") else ""
            parent.children.append(t)
        else:
            roots.append(t)
        stack.append(t)
    return roots


def annotations(metadata: str) -> dict[int, str]:
    """thunk id -> profile annotation (the HLO instruction name) from ``thunk_metadata.txt``."""
    out = {}
    for block in metadata.split("thunk_metadata {")[1:]:
        a = re.search(r'profile_annotation:\s*"([^"]*)"', block)
        i = re.search(r"thunk_id:\s*(\d+)", block)
        if a and i:
            out[int(i.group(1))] = a.group(1)
    return out


def trip_counts(hlo: str) -> dict[str, int]:
    """HLO while instruction name -> known trip count (from its backend_config)."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*? while\([^\n]*", hlo):
        n = re.search(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', m.group(0))
        if n:
            out[m.group(1)] = int(n.group(1))
    return out


def scopes(hlo: str, names) -> dict[str, str]:
    """HLO instruction name -> the path of ``names`` in its op_name metadata, outermost first
    ("verify/attention/attend"; "" when none)."""
    out = {}
    for m in re.finditer(r'%?([\w.\-]+) = [^\n]*?metadata=\{op_name="([^"]*)"', hlo):
        out[m.group(1)] = "/".join(p for p in m.group(2).split("/") if p in names)
    return out


def result_bytes(hlo: str) -> dict[str, float]:
    """HLO instruction name -> bytes of its result (an async start's: the value it produces, not the operands
    it holds)."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(", hlo, re.MULTILINE):
        shape, op = m.group(2), m.group(3)
        if op.endswith("-start") and shape.startswith("(("):
            depth = 0
            for i, ch in enumerate(shape):             # skip the operand tuple; the next shape is the value
                depth += (ch == "(") - (ch == ")")
                if depth == 1 and ch == ")":
                    shape = SHAPE.search(shape, i).group(0)
                    break
        out[m.group(1)] = shape_bytes(shape)
    return out


def count(roots: list[Thunk], trips: dict[str, int] | None = None, scope_of: dict[str, str] | None = None,
          sizes: dict[str, float] | None = None) -> dict:
    """Per execution of the program: gpu_ops, in_graphs, host_launches, host_syncs, graphs, copy_bytes,
    unknown_loops, by_scope (see the module docstring)."""
    trips, scope_of, sizes = trips or {}, scope_of or {}, sizes or {}
    out = dict(gpu_ops=0, in_graphs=0, host_launches=0, host_syncs=0, graphs=0, copy_bytes=0.0, unknown_loops=0,
               by_scope={})

    def walk(ts, times, in_graph):
        for t in ts:
            if t.kind == "kCommandBuffer":
                out["graphs"] += times
                out["host_launches"] += 0 if in_graph else times
                walk(t.children, times, True)
            elif t.kind == "kWhile":
                n = trips.get(t.annotation)
                if n is None:
                    out["unknown_loops"] += 1
                    out["host_syncs"] += 0 if in_graph else times
                walk([c for c in t.children if c.section == "body"], times * (n or 1), in_graph)
                if n is None:   # the condition runs every iteration when the trip count is unknown
                    walk([c for c in t.children if c.section == "condition"], times, in_graph)
            elif t.kind == "kConditional":
                out["host_syncs"] += 0 if in_graph else times
                walk(t.children, times, in_graph)   # every branch counted: an upper bound of one execution
            elif t.kind in STRUCTURE:
                for c in t.children:                # a wrapped copy is the wrapper's HLO instruction
                    c.annotation = c.annotation or t.annotation
                walk(t.children, times, in_graph)
            else:
                if t.kind == "kCopy":
                    out["copy_bytes"] += times * sizes.get(t.annotation, 0.0)
                out["gpu_ops"] += times
                out["in_graphs"] += times if in_graph else 0
                out["host_launches"] += 0 if in_graph else times
                scope = scope_of.get(t.annotation, "")
                out["by_scope"][scope] = out["by_scope"].get(scope, 0) + times
                walk(t.children, times, in_graph)
    walk(roots, 1, False)
    out["by_scope"] = dict(sorted(out["by_scope"].items(), key=lambda kv: -kv[1]))
    return out


def read_dump(path: str, scope_names=()) -> dict:
    """``count`` of the (single) module dumped under ``path``."""
    def one(*patterns):
        for pattern in patterns:
            if found := sorted(glob.glob(os.path.join(path, pattern))):
                with open(found[-1]) as f:
                    return f.read()
        raise FileNotFoundError(f"no {patterns[0]} under {path} (was the program compiled with xla_dump_to?)")
    hlo = one("*gpu_after_optimizations.txt")
    # XLA writes the sequence after its thunk passes (command buffers formed) only where those changed it
    roots = parse(one("*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt"))
    ann = annotations(one("*thunk_metadata.txt"))

    def annotate(ts):
        for t in ts:
            t.annotation = ann.get(t.id, "")
            annotate(t.children)
    annotate(roots)
    return count(roots, trip_counts(hlo), scopes(hlo, set(scope_names)), result_bytes(hlo))


def compile_dumped(lowered, options: dict | None = None, scope_names=(), keep: str | None = None):
    """Compile ``lowered`` (for a GPU target) with an XLA dump and read its launches: (compiled, count dict).
    ``keep``: a directory to leave the dump in (default: a temporary one, removed)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = keep or tmp
        compiled = lowered.compile({**(options or {}), "xla_dump_to": where})
        return compiled, read_dump(where, scope_names)
