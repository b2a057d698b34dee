"""Where a compiled step's bytes go: a reader of XLA's optimized HLO and GPU thunk sequence.

`benchmarks.gpu_compile` compiles the train step for an H100 on a CPU machine and hands
this module the optimized HLO text (`compiled.as_text()`) and the dumped thunk sequence
(`*thunk_sequence.txt` and `*thunk_metadata.txt`, from `--xla_dump_to`). It returns, per
step:

* kernels launched, fusions, device copies (count and bytes), cuBLAS and cuDNN calls, from
  the thunk sequence (what the GPU runs, in launch order), each loop's thunks times its
  trip count;
* bytes accessed per kernel, from the HLO: every top-level instruction that runs on the
  device (a fusion, a cuBLAS/cuDNN custom call, a copy, …) reads its operands and writes
  its result once, loop bodies times their known trip count. Counted as the kernel
  touches them: a fused parameter read only through a dynamic-slice, slice or gather
  (after per-element ops such as a convert) counts the rows it reads; a
  dynamic-update-slice or scatter into a buffer updated in place counts the rows it
  writes (and not the buffer); a custom call's scratch workspace (u8/s8) is not counted.
  XLA's own HloCostAnalysis counts a loop body once, gives custom calls no bytes and
  charges a gather its whole operand;
* a category per kernel, from the Python functions its ops were traced in (the HLO's
  stack frames): the project's own function names (`norm`, `ffn`, `attention`,
  `token_cross_entropy`, …) and optax's module for the optimizer;
* a conditional at its costliest branch (the bytes of a step that takes it);
* FLOPs of the matmuls (dots and cuBLAS calls: 2·M·N·K) and of cuDNN's attention
  (forward 4·B·N·T·S·H, backward twice that; the causal half not discounted).
"""

import collections
import dataclasses
import json
import math
import re

from odetransformer.tools import hlo_stats

# Shapes are read as odetransformer.tools.hlo_stats reads them (the product's reader of
# collectives, which the pre-flight prints).
DTYPE_BYTES, ARRAY_SHAPE, array_bytes = (
  hlo_stats.DTYPE_BYTES,
  hlo_stats.ARRAY_SHAPE,
  hlo_stats.array_bytes,
)
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INST = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
# Opcodes that launch nothing (control flow, views, tuples).
_NO_KERNEL = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "while",
  "conditional",
  "call",
  "after-all",
  "partition-id",
  "replica-id",
  "opt-barrier",
  "add-dependency",
  "copy-done",
  "all-reduce-done",
  "all-gather-done",
  "collective-permute-done",
  "async-done",
  "async-update",
}
# Function names (innermost first) -> category; the first name of a kernel's stack that
# appears here names it.
FUNCTION_CATEGORIES = {
  "token_cross_entropy": "loss",
  "_nll": "loss",
  "_nll_fwd": "loss",
  "_nll_bwd": "loss",
  "_logsumexp": "loss",
  "_token_nll": "loss",
  "_nll_autodiff": "loss",
  "logits": "head",
  "norm": "norms",
  "_norm": "norms",
  "_norm_fwd": "norms",
  "_norm_bwd": "norms",
  "_norm_stats": "norms",
  "block_norm": "norms",
  "gelu": "mlp",
  "_gelu_fwd": "mlp",
  "_gelu_bwd": "mlp",
  "_gelu_parts": "mlp",
  "ffn": "mlp",
  "attention": "attention",
  "qkv_projections": "attention",
  "output_projection": "attention",
  "dot_product_attention": "attention",
  "_splash_attention": "attention",
  "_dense_attention": "attention",
  "_cudnn_packed_attention": "attention",
  "packed_segments": "attention",
  "rk_step": "residuals",
  "field": "residuals",
  "sequential_block": "residuals",
  "parallel_block": "residuals",
  "generate_weights": "hypernet",
  "step_weights": "hypernet",
  "codes": "hypernet",
  "embed_tokens": "embedding",
  "fixed_step_solve": "scan",
  "body": "scan",
  "global_norm": "optimizer",
}
CATEGORIES = (
  "matmul",
  "cudnn",
  "loss",
  "head",
  "norms",
  "mlp",
  "attention",
  "residuals",
  "hypernet",
  "embedding",
  "scan",
  "copies",
  "optimizer",
  "other",
)


def _split_shape(rest: str):
  """'<shape> <opcode>(…' -> (shape text, remainder starting at the opcode)."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[: i + 1], rest[i + 1 :].lstrip()
  shape, _, tail = rest.partition(" ")
  return shape, tail


def _balanced(text: str, start: int, open_ch="(", close_ch=")") -> int:
  """Index just past the bracket that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] == open_ch
    depth -= text[i] == close_ch
    if depth == 0:
      return i + 1
  return len(text)


@dataclasses.dataclass
class Inst:
  name: str
  shape: str
  opcode: str
  operands: list
  attrs: str
  root: bool = False
  args: str = ""  # the text between the opcode's parentheses

  def attr(self, key: str):
    m = re.search(rf"\b{key}=%([\w.\-]+)", self.attrs)
    return m.group(1) if m else None

  def json_attr(self, key: str) -> dict:
    i = self.attrs.find(key + "={")
    if i < 0:
      return {}
    start = i + len(key) + 1
    try:
      return json.loads(self.attrs[start : _balanced(self.attrs, start, "{", "}")])
    except ValueError:
      return {}

  @property
  def stack_frame(self):
    m = re.search(r"stack_frame_id=(\d+)", self.attrs)
    return int(m.group(1)) if m else None

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attrs)
    return m.group(1) if m else ""

  @property
  def target(self) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
    return m.group(1) if m else ""


@dataclasses.dataclass
class Module:
  computations: dict  # name -> list[Inst]
  entry: str
  functions: dict  # stack frame id -> [function names, innermost first]
  files: dict  # stack frame id -> innermost file name


def _parse_tables(lines):
  """The HLO text's FileNames / FunctionNames / FileLocations / StackFrames tables."""
  tables, current = collections.defaultdict(dict), None
  for line in lines:
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = line
      continue
    if not line.strip() or line.startswith("%") or line.startswith("ENTRY"):
      current = None if not line.strip() else current
      if line.startswith("%") or line.startswith("ENTRY"):
        break
      continue
    if current:
      key, _, value = line.strip().partition(" ")
      tables[current][int(key)] = value
  names = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
  files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
  locations = {}
  for k, v in tables["FileLocations"].items():
    fn = re.search(r"function_name_id=(\d+)", v)
    fl = re.search(r"file_name_id=(\d+)", v)
    locations[k] = (
      names.get(int(fn.group(1)), "?") if fn else "?",
      files.get(int(fl.group(1)), "?") if fl else "?",
    )
  frames = {}
  for k, v in tables["StackFrames"].items():
    loc = re.search(r"file_location_id=(\d+)", v)
    parent = re.search(r"parent_frame_id=(\d+)", v)
    frames[k] = (int(loc.group(1)) if loc else 0, int(parent.group(1)) if parent else 0)
  functions, innermost_file = {}, {}
  for k in frames:
    chain, f, seen = [], k, set()
    while f in frames and f not in seen:
      seen.add(f)
      loc, parent = frames[f]
      name, file = locations.get(loc, ("?", "?"))
      chain.append(name)
      innermost_file.setdefault(k, file)
      f = parent
    functions[k] = chain
  return functions, innermost_file


def parse_module(text: str) -> Module:
  """The computations of an optimized HLO module's text, and its stack-frame tables."""
  lines = text.splitlines()
  functions, files = _parse_tables(lines)
  computations, entry, current = {}, None, None
  for line in lines:
    head = _COMP_HEAD.match(line)
    if head:
      current = head.group(2)
      computations[current] = []
      if head.group(1):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    m = _INST.match(line)
    if not m:
      continue
    shape, tail = _split_shape(m.group(3))
    paren = tail.find("(")
    opcode = tail[:paren].strip()
    close = _balanced(tail, paren)
    operands = re.findall(r"%([\w.\-]+)", tail[paren:close])
    computations[current].append(
      Inst(m.group(2), shape, opcode, operands, tail[close:], bool(m.group(1)), tail[paren:close])
    )
  return Module(computations, entry, functions, files)


# --------------------------------------------------------------------------------------
# Bytes of one kernel
# --------------------------------------------------------------------------------------
# One operand in, the same elements out: a parameter read only through these and then a
# slice or gather is read only where the slice is.
_PER_ELEMENT = ("bitcast", "reshape", "convert", "copy", "negate")


_ELEMENTWISE = {
  "add",
  "subtract",
  "multiply",
  "divide",
  "maximum",
  "minimum",
  "select",
  "compare",
  "exponential",
  "log",
  "tanh",
  "negate",
  "abs",
  "sqrt",
  "rsqrt",
  "power",
  "and",
  "or",
  "not",
  "clamp",
  "exponential-minus-one",
  "log-plus-one",
  "sign",
  "floor",
  "ceil",
  "round-nearest-even",
}


def _elements(shape_text: str) -> int:
  m = ARRAY_SHAPE.search(shape_text)
  return math.prod(int(d) for d in m.group(2).split(",") if d) if m else 0


def _param_read(comp: list, index: int, full: float) -> float:
  """Bytes a fused computation reads of its parameter `index` (size `full`): the
  fraction of its elements that reach the fusion's outputs, through per-element ops
  and slices (a slice, dynamic-slice or gather reads only the rows it picks)."""
  param = next((i for i in comp if i.opcode == "parameter" and i.args == f"({index})"), None)
  if param is None:
    return full
  by_name = {i.name: i for i in comp}
  users = collections.defaultdict(list)
  for inst in comp:
    for pos, op in enumerate(inst.operands):
      users[op].append((inst, pos))
  memo = {}

  def fraction(name: str) -> float:
    """Largest fraction of value `name`'s elements that any use of it reads."""
    if name in memo:
      return memo[name]
    memo[name] = 1.0  # a cycle cannot happen in HLO; this only guards the recursion
    inst, worst = by_name[name], 0.0
    if inst.root or not users[name]:
      worst = 1.0
    for user, pos in users[name]:
      if user.opcode in ("dynamic-update-slice", "scatter") and pos == 0:
        f = 0.0  # updated in place: the buffer is not read (the output counts the rows)
      elif user.opcode in ("dynamic-slice", "slice", "gather") and pos == 0:
        size = _elements(inst.shape)
        f = (_elements(user.shape) / size if size else 1.0) * fraction(user.name)
      elif (user.opcode in _PER_ELEMENT or user.opcode in _ELEMENTWISE) and _elements(
        user.shape
      ) == _elements(inst.shape):
        f = fraction(user.name)
      else:
        f = 1.0
      worst = max(worst, f)
      if worst >= 1.0:
        break
    memo[name] = min(worst, 1.0)
    return memo[name]

  total = fraction(param.name) * full
  # A scatter-add reads the rows it updates.
  for user, pos in users[param.name]:
    if user.opcode == "scatter" and pos == 0 and user.operands[2] in by_name:
      total += array_bytes(by_name[user.operands[2]].shape)
  return min(total, full)


def _written(comp: list, inst: Inst) -> float:
  """Bytes a fused computation's root `inst` writes."""
  by_name = {i.name: i for i in comp}
  if inst.opcode == "tuple":
    return sum(_written(comp, by_name[o]) for o in inst.operands if o in by_name)
  if inst.opcode == "bitcast" and inst.operands and inst.operands[0] in by_name:
    return _written(comp, by_name[inst.operands[0]])
  if inst.opcode == "dynamic-update-slice":
    upd = by_name.get(inst.operands[1])
    return array_bytes(upd.shape) if upd else array_bytes(inst.shape)
  if inst.opcode == "scatter":
    upd = by_name.get(inst.operands[2])
    return array_bytes(upd.shape) if upd else array_bytes(inst.shape)
  return array_bytes(inst.shape)


def kernel_bytes(module: Module, comp_insts: dict, inst: Inst) -> float:
  """Bytes `inst` (a top-level instruction that runs on the device) reads and writes."""
  if inst.opcode == "fusion":
    called = module.computations.get(inst.attr("calls"), [])
    read = sum(
      _param_read(called, i, array_bytes(comp_insts[o].shape)) if o in comp_insts else 0.0
      for i, o in enumerate(inst.operands)
    )
    root = next((i for i in called if i.root), None)
    return read + (_written(called, root) if root else array_bytes(inst.shape))
  skip = inst.opcode == "custom-call"
  read = sum(array_bytes(comp_insts[o].shape, skip) for o in inst.operands if o in comp_insts)
  if inst.opcode == "dynamic-update-slice":
    upd = comp_insts.get(inst.operands[1])
    return 2 * array_bytes(upd.shape) if upd else read
  if inst.opcode in ("dynamic-slice", "slice", "gather"):
    return 2 * array_bytes(inst.shape)
  return read + array_bytes(inst.shape, skip)


# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------
def _dims(shape_text: str) -> list:
  m = ARRAY_SHAPE.search(shape_text)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dot_flops(inst: Inst, insts: dict) -> float:
  """2 · |result| · Π contracting dims, for a dot or a cuBLAS custom call."""
  if inst.opcode == "dot":
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    contracting = [int(d) for d in m.group(1).split(",") if d] if m else []
  else:
    dn = inst.json_attr("backend_config").get("gemm_backend_config", {})
    contracting = [
      int(d) for d in dn.get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])
    ]
  lhs = insts.get(inst.operands[0]) if inst.operands else None
  if lhs is None:
    return 0.0
  lhs_dims = _dims(lhs.shape)
  k = math.prod(lhs_dims[d] for d in contracting if d < len(lhs_dims))
  out = _dims(inst.shape) if not inst.shape.startswith("(") else _dims(inst.shape[1:])
  return 2.0 * math.prod(out) * k


def _fmha_flops(inst: Inst, insts: dict) -> float:
  """cuDNN attention: 4·B·N·T·S·H forward, twice that backward (no causal discount)."""
  q = insts.get(inst.operands[0]) if inst.operands else None
  k = insts.get(inst.operands[1]) if len(inst.operands) > 1 else None
  if q is None or k is None:
    return 0.0
  qd, kd = _dims(q.shape), _dims(k.shape)
  if len(qd) != 4 or len(kd) != 4:
    return 0.0
  b, t, n, h = qd
  s = kd[1]
  flops = 4.0 * b * n * t * s * h
  return flops * (2 if "Backward" in inst.target else 1)


# --------------------------------------------------------------------------------------
# The whole module
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Kernel:
  name: str
  category: str
  bytes: float  # per run
  runs: int  # per step (trip counts multiplied)
  what: str  # the functions it computes, innermost first

  @property
  def total(self) -> float:
    return self.bytes * self.runs


def _category(module: Module, inst: Inst, called: list) -> tuple:
  """(category, description) of a top-level instruction, from its ops' stack frames."""
  if inst.opcode == "custom-call":
    if "cudnn" in inst.target.lower() or "fmha" in inst.target.lower():
      return "cudnn", inst.target
    if "gemm" in inst.target.lower() or "cublas" in inst.target.lower():
      return "matmul", inst.target
  if inst.opcode == "fusion" and ("gemm" in inst.name or "dot" in inst.attrs.split("calls=")[0]):
    if any(i.opcode in ("dot", "custom-call") for i in called):
      return "matmul", "dot fusion"
  if inst.opcode in ("copy", "copy-start"):
    return "copies", "copy"
  if (
    inst.opcode == "fusion"
    and called
    and all(
      i.opcode in ("parameter", "constant", "bitcast", "dynamic-slice", "slice", "copy")
      or re.fullmatch(r"[a-z0-9]+\[\]", i.shape.split("{")[0])  # index arithmetic
      for i in called
    )
  ):
    return "copies", "slice (a memcpy)"
  frames = [inst.stack_frame] + [i.stack_frame for i in called if i.root]
  frames += [i.stack_frame for i in called]
  seen_names = []
  for frame in frames:
    if frame is None:
      continue
    chain = module.functions.get(frame, [])
    for name in chain:
      if name in FUNCTION_CATEGORIES:
        return FUNCTION_CATEGORIES[name], "/".join(chain[:4])
    file = module.files.get(frame, "")
    if "optax" in file:
      return "optimizer", "/".join(chain[:3])
    seen_names.extend(chain[:3])
  if inst.opcode == "fusion" and any(
    i.opcode in ("dynamic-update-slice", "dynamic-slice") for i in called
  ):
    return "scan", "loop slice/update"
  if "while" in inst.op_name:
    return "scan", inst.op_name[-60:]
  return "other", "/".join(seen_names[:4]) or inst.op_name[-60:]


def kernels(module: Module) -> tuple:
  """(kernels, flops): every top-level device instruction with its bytes, category and
  runs per step, walking while bodies times their trip counts; matmul + attention FLOPs."""
  out, flops = [], [0.0]

  def walk(comp_name: str, runs: int):
    insts = module.computations.get(comp_name, [])
    by_name = {i.name: i for i in insts}
    for inst in insts:
      if inst.opcode == "while":
        trips = int(inst.json_attr("backend_config").get("known_trip_count", {}).get("n", 1))
        walk(inst.attr("body"), runs * trips)
        walk(inst.attr("condition"), runs * trips)
        continue
      if inst.opcode == "conditional":  # at its costliest branch
        branches = re.findall(r"%([\w.\-]+)", inst.attrs.split("branch_computations=")[-1])
        best = None
        for branch in (b for b in branches if b in module.computations):
          before, flops_before = len(out), flops[0]
          walk(branch, runs)
          taken = out[before:], flops[0] - flops_before
          del out[before:]
          flops[0] = flops_before
          if best is None or sum(k.total for k in taken[0]) > sum(k.total for k in best[0]):
            best = taken
        if best:
          out.extend(best[0])
          flops[0] += best[1]
        continue
      if inst.opcode == "call":
        walk(inst.attr("to_apply"), runs)
        continue
      if inst.opcode in _NO_KERNEL:
        continue
      called = module.computations.get(inst.attr("calls"), []) if inst.opcode == "fusion" else []
      category, what = _category(module, inst, called)
      out.append(Kernel(inst.name, category, kernel_bytes(module, by_name, inst), runs, what))
      called_by_name = {i.name: i for i in called}
      for i in called:
        if i.opcode == "dot":
          flops[0] += runs * _dot_flops(i, called_by_name)
      if inst.opcode == "custom-call":
        if "fmha" in inst.target.lower():
          flops[0] += runs * _fmha_flops(inst, by_name)
        elif "gemm" in inst.target.lower() or "cublas" in inst.target.lower():
          flops[0] += runs * _dot_flops(inst, by_name)
      elif inst.opcode == "dot":
        flops[0] += runs * _dot_flops(inst, by_name)

  walk(module.entry, 1)
  return out, flops[0]


def attention_kernels(module: Module) -> list:
  """How attention runs: one line per distinct cuDNN attention call ('cudnn causal',
  'cudnn causal + bias operand', 'cudnn packed (segment offsets)'), or 'xla'."""
  found = set()
  for insts in module.computations.values():
    for inst in insts:
      if inst.opcode != "custom-call" or "fmha" not in inst.target.lower():
        continue
      cfg = inst.json_attr("backend_config").get("cudnn_fmha_backend_config", {})
      mask = str(cfg.get("mask_type", "")).lower().replace("_", " ") or "no mask"
      packed = int(cfg.get("max_seg_per_batch", 1) or 1) > 1
      bias = "Bias" in inst.target  # e.g. __cudnn$fmhaScaleBiasSoftmax
      desc = f"cudnn {mask}"
      if packed:
        desc += ", packed (segment offsets)"
      if bias:
        desc += ", bias operand"
      found.add(desc)
  return sorted(found) or ["xla"]


# --------------------------------------------------------------------------------------
# Thunk sequence: what the GPU launches
# --------------------------------------------------------------------------------------
def thunk_annotations(metadata_text: str) -> dict:
  """thunk id -> HLO instruction name (the dump's `*thunk_metadata.txt`)."""
  out = {}
  for block in metadata_text.split("thunk_metadata {")[1:]:
    ann = re.search(r'profile_annotation:\s*"([^"]*)"', block)
    tid = re.search(r"thunk_id:\s*(\d+)", block)
    if ann and tid:
      out[int(tid.group(1))] = ann.group(1)
  return out


_THUNK = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s*(\[[^\]]*\])?\s*(.*)$")


def thunk_counts(sequence_text: str, annotations: dict, module: Module, bytes_of: dict) -> dict:
  """Per step: kernels launched, fusions, device copies (count and bytes), cuBLAS and
  cuDNN calls, from the thunk sequence, each loop body times its trip count.

  `bytes_of`: HLO instruction name -> bytes of one run (a copy's size)."""
  trips = {}
  for insts in module.computations.values():
    for inst in insts:
      if inst.opcode == "while":
        n = inst.json_attr("backend_config").get("known_trip_count", {}).get("n", 1)
        trips[inst.name] = int(n)
  counts, copy_names = collections.Counter(), set()
  stack = []  # (indent of the loop's line, multiplier[, the dynamic-slice fusion's name])
  for line in sequence_text.splitlines():
    m = _THUNK.match(line)
    if not m:
      continue
    indent = len(m.group(1))
    while stack and indent <= stack[-1][0]:
      stack.pop()
    mult = stack[-1][1] if stack else 1
    kind, tid, rest = m.group(3), int(m.group(2)), m.group(5)
    if kind == "kWhile":
      stack.append((indent, mult * trips.get(annotations.get(tid, ""), 1)))
      continue
    if kind in ("kSequential", "kCommandBuffer", "kConditional", "kDynamicSliceFusion"):
      if kind == "kDynamicSliceFusion":  # its inner copy moves the fusion's slice
        stack.append((indent, mult, annotations.get(tid, "")))
      continue
    # A copy inside a dynamic-slice fusion moves that fusion's slice.
    name = stack[-1][2] if stack and len(stack[-1]) == 3 else annotations.get(tid, "")
    counts["kernels"] += mult
    if kind == "kCopy":
      counts["copies"] += mult
      counts["copy_bytes"] += mult * bytes_of.get(name, 0.0)  # read + written
      copy_names.add(name)
    elif kind in ("kGemm", "kCublasLtMatmul"):
      counts["cublas"] += mult
    elif "CuDnn" in kind or "Cudnn" in kind or "cudnn" in rest.lower():
      counts["cudnn"] += mult
    elif kind in ("kCustomKernel", "kKernel"):
      counts["fusions"] += mult
  return dict(counts), copy_names


def summarize(hlo_text: str, sequence_text: str = "", metadata_text: str = "") -> dict:
  """The per-step figures of one compiled module (see the module docstring)."""
  module = parse_module(hlo_text)
  ks, flops = kernels(module)
  bytes_of = {k.name: k.bytes for k in ks}
  counts, copy_names = (
    thunk_counts(sequence_text, thunk_annotations(metadata_text), module, bytes_of)
    if sequence_text
    else ({}, set())
  )
  by_cat = collections.Counter()
  for k in ks:
    if k.name in copy_names:  # runs as a memcpy (a copy, or a dynamic-slice fusion's)
      k.category, k.what = "copies", f"memcpy ({k.what})"
    by_cat[k.category] += k.total
  return {
    "kernels": ks,
    "bytes": sum(k.total for k in ks),
    "by_category": {c: by_cat.get(c, 0.0) for c in CATEGORIES if by_cat.get(c)},
    "flops": flops,
    "counts": counts,
    "attention": attention_kernels(module),
  }
