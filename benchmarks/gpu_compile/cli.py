"""The real train step compiled for an H100 on a CPU machine: where every byte of a step goes.

XLA compiles for a GPU from a target description alone (`--target`, default the H100 SXM
spec in odetransformer/tools/targets/). This command builds the product's train step
(`steps.make_train_step`, the code `main.py` runs: AdamW with clipping, donation,
sharding constraints) for our GPT and the DiffEqFormer at a preset's shape, compiles it
for that target without a GPU, and prints per step: kernels launched, fusions, device
copies (count and bytes), cuBLAS and cuDNN calls, the attention kernel chosen, bytes
accessed by category (`hlo_bytes`), FLOPs, temporaries and the compile time.

  pip install -r requirements.txt -r requirements-compile.txt      # the CUDA compiler
  python -m benchmarks.gpu_compile --preset=owt-small --batch=16    # both models
  python -m benchmarks.gpu_compile --kinds=transformer --remat=none --top=15

The attention kernel is chosen for the target (its devices are the mesh's), not for this
host. `--packed` feeds packed documents (segment ids); without it the batch has none, as
an unpacked batch: cuDNN's plain causal kernel. Last line:
`h100 train step (P, bf16, B x L): transformer C copies, G GB; diffeqformer C copies, G GB`
(per step; G in units of 1e9 bytes). With ODET_GPU_COMPILE_DUMP=DIR, XLA's dump of the
train step (optimized HLO, thunk sequence, buffer assignment) is kept in DIR.
"""

import contextlib
import glob
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.gpu_compile import hlo_bytes
from odetransformer import cli_flags, errors
from odetransformer.tools import compile_targets

DEFAULT_TARGET = str(compile_targets.H100_TARGET)
GB = 1e9


def define_flags(define) -> None:
  # remat 'none': with the layer loop unrolled (model.layer_loop, on GPUs) the fewest
  # bytes, where memory allows (benchmarks/README.md).
  common.define_common_flags(define, remat="none")
  define("string", "kinds", "transformer,diffeqformer", "model kinds, comma-separated")
  define("string", "target", DEFAULT_TARGET, "XLA GPU target config (text proto)")
  define("bool", "packed", False, "feed packed documents (segment ids) instead of none")
  define(
    "bool",
    "triton_gemm",
    False,
    "let XLA emit Triton GEMM fusions (untuned without a GPU); default: every matmul a "
    "cuBLAS call, as autotuning picks on an H100 at these sizes",
  )
  define("integer", "top", 0, "list the N kernels that move most bytes per step")
  define("string", "json", "", "also write the figures to this JSON file")
  define("string", "overrides", "", "model config fields, e.g. layer_loop=scan,remat_policy=full")


def topology(target: str):
  """Compile-only devices of one GPU described by the text proto at `target`."""
  try:
    spec = pathlib.Path(target).read_text()
  except OSError as e:
    raise errors.UserError(
      f"--target={target}: cannot read it ({e.strerror}); pass a GPU target config text proto"
    ) from None
  try:
    return compile_targets.cuda_devices(spec, "1x1x1")
  except Exception as e:  # noqa: BLE001 (one line for any plugin failure)
    raise errors.UserError(
      f"cannot make a CUDA compile target ({str(e).splitlines()[0][:160]}); install "
      "requirements-compile.txt and run with JAX_PLATFORMS=cpu"
    ) from None


def batch_structs(trainer, b: int, length: int, packed: bool) -> dict:
  """The batch as ShapeDtypeStructs on the trainer's mesh (segment ids only if packed)."""
  spec = {"inputs": jnp.int32, "targets": jnp.int32, "positions": jnp.int32, "weights": jnp.float32}
  if packed:
    spec["segment_ids"] = jnp.int32
  return {
    k: jax.ShapeDtypeStruct((b, length), dt, sharding=trainer.batch_sharding)
    for k, dt in spec.items()
  }


@contextlib.contextmanager
def _dump_dir():
  """XLA dumps the thunk sequence of each program it compiles into a fresh directory."""
  keep = os.environ.get("ODET_GPU_COMPILE_DUMP")  # a directory to keep the dump in
  with (
    contextlib.nullcontext(keep)
    if keep
    else tempfile.TemporaryDirectory(prefix="gpu_compile_") as d
  ):
    old = os.environ.get("XLA_FLAGS")
    yield d
    if old is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = old


def compile_step(cfg, b: int, length: int, devices, packed: bool, dump_dir: str) -> dict:
  """Compiles the product's train step of `cfg` for `devices`; its per-step figures."""
  trainer = common.Trainer(cfg, allocate=False, devices=devices)
  batch = batch_structs(trainer, b, length, packed)
  rng = jax.ShapeDtypeStruct(
    (),
    jax.random.key(0).dtype,
    sharding=jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec()),
  )
  start = time.perf_counter()
  compiled = trainer.lower(batch, rng).compile()
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  seq = meta = ""
  seqs = sorted(
    glob.glob(os.path.join(dump_dir, "*train_step*thunk_sequence.txt")), key=os.path.getmtime
  )
  if seqs:
    seq = pathlib.Path(seqs[-1]).read_text()
    meta_path = seqs[-1].replace("thunk_sequence.txt", "thunk_metadata.txt")
    meta = pathlib.Path(meta_path).read_text() if os.path.exists(meta_path) else ""
  out = hlo_bytes.summarize(text, seq, meta)
  mem = compiled.memory_analysis()
  out.update(
    compile_s=seconds,
    temp=mem.temp_size_in_bytes,
    args=mem.argument_size_in_bytes,
    tokens=b * length,
  )
  return out


def figures(r: dict) -> dict:
  """One model's per-step figures as plain JSON values (no kernel list)."""
  out = {k: v for k, v in r.items() if k != "kernels"}
  out["bytes_per_token"] = r["bytes"] / r["tokens"]
  return out


def report(kind: str, r: dict, top: int) -> str:
  c = r["counts"]
  lines = [
    f"{kind}: {c.get('kernels', 0):,} kernels ({c.get('fusions', 0):,} fusions, "
    f"{c.get('cublas', 0)} cuBLAS, {c.get('cudnn', 0)} cuDNN), {c.get('copies', 0)} device "
    f"copies ({c.get('copy_bytes', 0) / GB:.1f} GB); attention: {', '.join(r['attention'])}",
    f"  {r['bytes'] / GB:.1f} GB accessed per step ({r['bytes'] / r['tokens']:,.0f} B/token), "
    f"{r['flops'] / 1e12:.2f} TFLOP (matmul + attention), temporaries "
    f"{r['temp'] / 2**30:.1f} GiB, arguments {r['args'] / 2**30:.2f} GiB, compile "
    f"{r['compile_s']:.0f} s",
    "  GB by category: "
    + ", ".join(
      f"{k} {v / GB:.1f}" for k, v in sorted(r["by_category"].items(), key=lambda kv: -kv[1])
    ),
  ]
  if top:
    lines.append(f"  top {top} kernels by bytes per step (GB, runs, what):")
    for k in sorted(r["kernels"], key=lambda k: -k.total)[:top]:
      lines.append(
        f"    {k.total / GB:6.2f}  x{k.runs:<3d} {k.category:10s} {k.name[:40]:40s} {k.what[:70]}"
      )
  return "\n".join(lines)


def main(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  kinds = [k for k in args.kinds.split(",") if k]
  overrides = {}
  fields = common.model_config(args, "transformer")
  for item in filter(None, args.overrides.split(",")):
    key, _, value = item.partition("=")
    if not hasattr(fields, key):
      raise errors.UserError(
        f"--overrides: {key!r} is not a model config field; see model/config.py"
      )
    overrides[key] = type(getattr(fields, key))(value)
  b, length = common.shape(args)
  results = {}
  with _dump_dir() as dump:
    # Read by XLA when it first starts (the topology call): set before it.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_dump_to={dump} --xla_dump_hlo_module_re=train_step"
      + ("" if args.triton_gemm else " --xla_gpu_enable_triton_gemm=false")
    ).strip()
    devices = topology(args.target)
    for kind in kinds:
      cfg = common.model_config(
        args,
        kind,
        max_len=max(length, common.PRESETS[args.preset]["model"]["max_len"]),
        **overrides,
      )
      results[kind] = compile_step(cfg, b, length, devices, args.packed, dump)
      print(report(kind, results[kind], args.top), flush=True)
  layout = ("bf16" if args.dtype == "bfloat16" else args.dtype) + (
    ", packed" if args.packed else ""
  )
  if args.json:
    common.write_json(args.json, {k: figures(r) for k, r in results.items()})
  print(
    f"h100 train step ({args.preset}, {layout}, {b} x {length}): "
    + "; ".join(
      f"{k} {r['counts'].get('copies', 0)} copies, {r['bytes'] / GB:.1f} GB"
      for k, r in results.items()
    )
  )
  return results
