"""Where a train step's time goes, from a jax.profiler trace: matmuls, attention, other
fusions, copies and idle time per step (`benchmarks.throughput --profile`).

`trace(fn, steps, logdir)` runs `fn` (one step; its result is waited for) `steps` times
under `jax.profiler` and returns the trace's events and the wall time per step.
`split(events, steps, wall_s)` sums the device's op events by kind:

* the device's events: on a GPU/TPU the events of its `/device:` process (one thread per
  stream); on a CPU, whose ops run on host threads, the events that name an `hlo_op`;
* matmul: cuBLAS/cuBLASLt and CUTLASS GEMM kernels (`gemm`, `nvjet`, `xmma`, `cublas`,
  `cutlass`), XLA's dot ops and dot fusions, XLA:CPU's XNNPACK (`ynn_fusion`) ops;
* attention: fused attention kernels (cuDNN's `sdpa`/`fmha`/flash kernels, or an
  `hlo_op` named for attention);
* copies: memcpy events (GPU: `Memcpy DtoD` …, with a byte size) and XLA `copy` ops;
* other fusions: everything else the device runs (norms, activations, the loss, the
  optimizer update, converts);
* idle: the wall time per step minus the time at least one device op was running (the
  union of the op intervals, so overlapping streams or threads are not counted twice).

Times are per step, in seconds. The sum of the four kinds can exceed the busy time when
ops overlap (several GPU streams, XLA:CPU's thread pool); `busy` is the union.
"""

import collections
import glob
import gzip
import json
import os
import re
import time

import jax

KINDS = ("matmul", "attention", "other fusions", "copies")
# XLA:CPU hands its dots (with what fuses into them) to XNNPACK as `ynn_fusion` ops.
_MATMUL = re.compile(r"gemm|nvjet|xmma|cublas|cutlass|matmul|ynn_fusion|(^|[^a-z])dot", re.I)
_ATTENTION = re.compile(r"sdpa|fmha|flash|attention|cudnn", re.I)
_COPY = re.compile(r"memcpy|^copy", re.I)
BIG_COPY_BYTES = 1 << 20


def trace(fn, steps: int, logdir: str) -> tuple:
  """(events, wall seconds per step) of `steps` calls of `fn` under jax.profiler."""
  jax.block_until_ready(fn())  # compiled and warm before the trace starts
  jax.profiler.start_trace(logdir, create_perfetto_trace=True)
  start = time.perf_counter()
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  wall = (time.perf_counter() - start) / steps
  jax.profiler.stop_trace()
  files = sorted(
    glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime
  )
  if not files:
    raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {logdir}")
  with gzip.open(files[-1]) as f:
    events = json.load(f)
  return (events["traceEvents"] if isinstance(events, dict) else events), wall


def device_ops(events: list) -> list:
  """The complete ('X') events of ops the device ran (see the module docstring), leaves
  only: an event that encloses others on its thread (XLA:CPU's `while` and `call` thunks
  around their bodies) is left out, so no time is counted twice."""
  names = {
    e["pid"]: e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  devices = {pid for pid, name in names.items() if "/device:" in name}
  ops = [e for e in events if e.get("ph") == "X" and "dur" in e]
  if devices:
    ops = [e for e in ops if e.get("pid") in devices]
  else:
    ops = [e for e in ops if "hlo_op" in e.get("args", {})]
  return _leaves(ops)


def _leaves(ops: list) -> list:
  by_thread = collections.defaultdict(list)
  for e in ops:
    by_thread[(e.get("pid"), e.get("tid"))].append(e)
  leaves = []
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e["ts"], -e["dur"]))
    open_ = []  # enclosing events still open, outermost first
    parents = set()
    for e in thread:
      while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
        open_.pop()
      if open_ and e["ts"] + e["dur"] <= open_[-1]["ts"] + open_[-1]["dur"]:
        parents.add(id(open_[-1]))
      open_.append(e)
    leaves += [e for e in thread if id(e) not in parents]
  return leaves


def kind_of(event: dict) -> str:
  """matmul, attention, copies or other fusions, from the kernel's and the HLO op's names."""
  name, op = event.get("name", ""), str(event.get("args", {}).get("hlo_op", ""))
  if _COPY.search(name) or _COPY.search(op):
    return "copies"
  if _ATTENTION.search(name) or _ATTENTION.search(op):
    return "attention"
  if _MATMUL.search(name) or _MATMUL.search(op):
    return "matmul"
  return "other fusions"


def _copy_bytes(event: dict) -> int:
  """The byte size a GPU memcpy event records (0 when it says none)."""
  args = event.get("args", {})
  for key in ("bytes", "num_bytes", "size"):
    if str(args.get(key, "")).isdigit():
      return int(args[key])
  # xprof writes e.g. "kind_src:device kind_dst:device size:1048576 dest:0 async:1".
  found = re.search(r"(?:num_bytes|size|bytes)[\"':= ]+(\d+)", str(args.get("memcpy_details", "")))
  return int(found.group(1)) if found else 0


def _union(intervals: list) -> float:
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def split(events: list, steps: int, wall_s: float) -> dict:
  """Seconds per step by kind, plus 'busy', 'idle', 'wall', 'copies_count',
  'big_copies_count' (≥ 1 MiB) and 'top' ([(op name, seconds per step)], the 8
  costliest)."""
  ops = device_ops(events)
  by_kind = collections.Counter()
  by_op = collections.Counter()
  copies = big = 0
  for e in ops:
    kind = kind_of(e)
    by_kind[kind] += e["dur"] * 1e-6
    by_op[str(e.get("args", {}).get("hlo_op") or e["name"])[:80]] += e["dur"] * 1e-6
    if kind == "copies":
      copies += 1
      big += _copy_bytes(e) >= BIG_COPY_BYTES
  busy = _union([(e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in ops]) / steps
  out = {kind: by_kind[kind] / steps for kind in KINDS}
  out.update(
    busy=busy,
    wall=wall_s,
    idle=max(0.0, wall_s - busy),
    copies_count=copies / steps,
    big_copies_count=big / steps,
    top=[(name, s / steps) for name, s in by_op.most_common(8)],
  )
  return out


def format_split(label: str, s: dict) -> list:
  """The lines `throughput --profile` prints for one traced model."""
  wall = s["wall"] or float("nan")

  def part(kind):
    return f"{kind} {s[kind] * 1e3:.2f} ms ({s[kind] / wall:.0%})"

  lines = [
    f"profile {label}: step {wall * 1e3:.2f} ms = "
    + " | ".join(part(k) for k in KINDS)
    + f" | idle {s['idle'] * 1e3:.2f} ms ({s['idle'] / wall:.0%})",
    f"profile {label}: {s['copies_count']:.0f} copies per step, "
    f"{s['big_copies_count']:.0f} of them ≥ 1 MiB; device busy {s['busy'] * 1e3:.2f} ms",
  ]
  lines += [f"profile {label}:   {sec * 1e3:8.3f} ms  {name}" for name, sec in s["top"]]
  return lines
