"""What a compiled step does per step, read from XLA's optimised HLO text.

`compiled.as_text()` of a step compiled for any backend (CPU devices, an H100 or a TPU
slice compiled on a CPU: `odetransformer.memory --compile_for`) is parsed once:

* collectives by kind (all-gather, reduce-scatter, all-reduce, all-to-all,
  collective-permute): their count and bytes, once as written in the program (static)
  and once weighted by the trip counts of the while loops around them (the solver's
  scan: what a step really moves). Each counts the bytes of its full (unsharded) buffer:
  an all-gather's result, a reduce-scatter's operand, the others' result. A collective
  XLA:TPU spreads over a chain of fusions (`chain_id`) counts once.
* on TPU, the compiler's own cost model: every kernel it emits carries
  `estimated_cycles` in its backend config; their sum, weighted by trip counts, is the
  compiler's estimate of a step's cycles on one chip (custom kernels such as Pallas's
  Mosaic calls carry none and are counted apart, `uncosted_kernels`). XLA's
  `cost_analysis()` counts a loop body once, so it cannot give a step's time.

A loop's trip count is XLA's `known_trip_count`, else the bound of its condition `i < N`;
a loop with neither counts once and is reported (`unknown_trip_counts`).
"""

import collections
import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "s32": 4,
  "u32": 4,
  "s64": 8,
  "u64": 8,
  "f16": 2,
  "bf16": 2,
  "f32": 4,
  "f64": 8,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "c64": 8,
  "c128": 16,
  "token": 0,
}
# An array in an HLO shape: (dtype, dims), e.g. f32[4,8]{1,0} -> ("f32", "4,8").
ARRAY_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# `%name = <shape> <op>(<operands>), attrs` (the shape may be a tuple).
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_CHAIN = re.compile(r'chain_id="(\d+)"')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def array_bytes(shape_text: str, skip_scratch: bool = False) -> float:
  """Bytes of every array in an HLO shape (a tuple's elements summed); `skip_scratch`
  leaves out u8/s8 arrays (a custom call's workspace)."""
  total = 0.0
  for dtype, dims in ARRAY_SHAPE.findall(shape_text):
    if dtype not in DTYPE_BYTES or (skip_scratch and dtype in ("u8", "s8")):
      continue
    total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _collective_kind(op: str):
  """'all-gather' for all-gather / all-gather-start; None for -done and other ops."""
  for kind in COLLECTIVES:
    if op == kind or op == kind + "-start":
      return kind
  return None


def _collective_bytes(kind, op, shape, rest, shapes) -> float:
  """The full buffers of one (possibly combined) collective."""
  if op.endswith("-start") and kind != "all-reduce":
    # ((operands...), (results...)[, u32[] contexts]): a reduce-scatter's operands, the
    # others' results. (An all-reduce-start's shape is its results alone.)
    parts = [(t, d) for t, d in ARRAY_SHAPE.findall(shape) if d or t not in ("u32", "s32")]
    half = len(parts) // 2
    chosen = parts[:half] if kind == "reduce-scatter" else parts[half:]
    return array_bytes(" ".join(f"{t}[{d}]" for t, d in chosen))
  if kind == "reduce-scatter":  # the full buffers are its operands
    operands = rest.split(")", 1)[0].split(",")
    full = sum(
      array_bytes(o) if "[" in o else array_bytes(shapes.get(o.strip().lstrip("%"), ""))
      for o in operands
    )
    return full or array_bytes(shape)
  return array_bytes(shape)


def parse_step(hlo_text: str) -> dict:
  """A compiled step's collectives and (TPU) estimated cycles, static and weighted.

  Returns {'static': {kind: bytes}, 'weighted': {kind: bytes}, 'counts': {kind: n per
  step}, 'cycles': estimated cycles per step (0 where the backend gives none),
  'uncosted_kernels': custom calls per step without an estimate, 'unknown_trip_counts': n}.
  """
  comps = {}  # name -> {'own': Counter, 'calls': [(callee, multiplier)]}
  entry, current, shapes = None, None, {}
  unknown = 0
  fused = set()  # computations inside a kernel: their fusion op carries the cycles
  chains = set()  # chain ids of asynchronous collectives already counted
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m:
      current = m.group(1)
      comps[current] = {"own": collections.Counter(), "calls": [], "consts": {}}
      shapes = {}
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    shapes[name] = shape
    own = comps[current]["own"]
    kind = _collective_kind(op)
    chain = _CHAIN.search(rest)
    if kind is not None and chain:
      # XLA:TPU spreads one asynchronous collective over a chain of fusions (each
      # carries a copy of the op, overlapping its transfer with their compute): one
      # collective per chain.
      if chain.group(1) in chains:
        kind = None
      chains.add(chain.group(1))
    if kind is not None:
      own[kind] += _collective_bytes(kind, op, shape, rest, shapes)
      own["n " + kind] += 1
    cycles = _CYCLES.search(rest)
    if cycles:
      own["cycles"] += int(cycles.group(1))
    elif op == "custom-call" and 'custom_call_target="tpu_custom_call"' in rest:
      own["uncosted"] += 1
    if op == "constant" and shape.split("{")[0] in ("s32[]", "u32[]"):
      comps[current]["consts"][name] = int(re.match(r"(-?\d+)", rest).group(1))
    elif op == "compare" and "direction=LT" in rest and line.lstrip().startswith("ROOT"):
      bound = rest.split(")", 1)[0].split(",")[-1].strip().lstrip("%")
      comps[current]["bound"] = bound
    trips = 1
    if op == "while":
      t = _TRIPS.search(rest)
      cond = re.search(r"\bcondition=%?([\w.\-]+)", rest)
      trips = int(t.group(1)) if t else ("cond", cond.group(1) if cond else "")
    for attr in ("body", "condition", "calls", "to_apply"):
      for callee in re.findall(rf"\b{attr}=%?([\w.\-]+)", rest):
        comps[current]["calls"].append((callee, trips if attr == "body" else 1))
        if op == "fusion":
          fused.add(callee)
    branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
    if branches:
      for callee in branches.group(1).split(","):
        comps[current]["calls"].append((callee.strip().lstrip("%"), 1))

  def trip_count(mult) -> int:
    """A loop without XLA's known_trip_count (TPU's windowed einsums): the bound of its
    condition `i < N` (a counter from 0 in steps of 1, as XLA writes them), else 1."""
    nonlocal unknown
    if isinstance(mult, int):
      return mult
    cond = comps.get(mult[1], {})
    bound = cond.get("consts", {}).get(cond.get("bound"))
    if bound is None:
      unknown += 1
      return 1
    return bound

  for comp in comps.values():
    comp["calls"] = [(callee, trip_count(mult)) for callee, mult in comp["calls"]]

  def total(name, weighted, seen=()):
    if name not in comps or name in seen:
      return collections.Counter()
    out = collections.Counter(comps[name]["own"])
    if name in fused:
      out.pop("cycles", None)
      out.pop("uncosted", None)
    for callee, mult in comps[name]["calls"]:
      for k, v in total(callee, weighted, seen + (name,)).items():
        out[k] += v * (mult if weighted else 1)
    return out

  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  static, weighted = total(entry, False), total(entry, True)
  return {
    "static": {k: static.get(k, 0) for k in COLLECTIVES},
    "weighted": {k: weighted.get(k, 0) for k in COLLECTIVES},
    "counts": {k: int(weighted.get("n " + k, 0)) for k in COLLECTIVES},
    "cycles": int(weighted.get("cycles", 0)),
    "uncosted_kernels": int(weighted.get("uncosted", 0)),
    "unknown_trip_counts": unknown,
  }
