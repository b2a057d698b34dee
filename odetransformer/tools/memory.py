"""Will it fit? Per-device memory of a config's training state on an N-device mesh.

  python -m odetransformer.memory --config=configs/owt_medium.py --compile_for=v5e-256
  python -m odetransformer.memory --config=configs/owt_large.py --num_devices=64 \
      [--config.mesh.shape=1,-1,1] [--device_memory_gib=80] [--compile | --nocompile]

Pre-flight (`--compile_for=TARGET`: v5e-N, v5p-N, h100xN; `compile_targets`): the real
train and eval steps, with the config's mesh and remat, are compiled for that TPU slice
or H100 cluster on this CPU by its own compiler (requirements-compile.txt), which needs
no hardware. It prints per-chip argument, output and temporary memory against the
chip's, FITS or DOES NOT FIT, the planner's estimate beside the compiled figure, the
collectives a step runs (count and bytes by kind, `hlo_stats`), the compile time, and on
TPU the compiler's estimated step time and the MFU it implies. A config that does not
fit ends with one line naming what to change and exit status 2 (so launch/ refuses it).

Run as a program, this module makes `--num_devices` fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before jax is imported) and
builds the config's ('data', 'fsdp', 'tensor') mesh and logical-axis rules on them, the
same way `loop.train_and_evaluate` does. Then either

* compiled (`--compile`, or the default when the model has fewer than
  `--compile_max_params` parameters): the real train step (`steps.make_train_step`) is
  lowered on abstract inputs and compiled for that mesh, and XLA's
  `memory_analysis()` gives per-device argument, output, temporary and generated-code
  bytes; the eval step (`steps.make_eval_step`, `eval_batch_size` rows) is compiled
  the same way and its peak reported beside the train step's. Nothing is allocated.
  Compiling a large model for 64 fake devices on a CPU takes minutes and many GiB of
  host memory, hence the threshold; or
* analytic (`--nocompile`, or the default for large models): the shapes and
  shardings of parameters and Adam state come from `nnx.get_abstract_model` (the
  shardings training will use), so their per-device bytes are exact; the step's
  temporaries are estimated by kind (`memory_temporaries.py`: gradients, DiffEqFormer's
  generated W(t), saved activations per remat policy, and the head, layer and
  embedding buffers, which are live one phase at a time) and taken at their peak.
  How close the total comes to XLA:CPU's compiled step on 8 devices is measured by
  `python -m benchmarks.memory_estimate` (benchmarks/README.md, "Memory estimate against
  the compiled step"). `--compile` compiles for fake CPU devices too: for a GPU or TPU
  number, compile on the target itself.

The verdict compares the total against `--device_memory_gib` (default: the target's chip,
else 80, an H100; e.g. 141 for an H200, 32 for a TPU v4 chip, 16 for v5e, 95 for v5p).
Fake CPU devices do not make the GPU/TPU compilers' fusion and rematerialisation
choices: for an accelerator, `--compile_for` gives its compiler's figure.

`--json=PATH` also writes the numbers as JSON (used by the tests).
"""

import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time

from absl import flags
from ml_collections import config_flags
import numpy as np

from odetransformer.tools import compile_targets  # imports no jax (used before it loads)


def _force_host_device_count(argv) -> None:
  """Sets XLA_FLAGS for `--num_devices` (must run before jax is imported)."""
  num = None
  for i, arg in enumerate(argv):
    if arg.startswith("--num_devices="):
      num = arg.split("=", 1)[1]
    elif arg == "--num_devices" and i + 1 < len(argv):
      num = argv[i + 1]
  if num is None or not num.isdigit():
    return
  flags = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
  ).strip()
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # fake devices are CPU devices


def _compile_only_platform(argv) -> None:
  """`--compile_for`: `compile_targets.compile_only_environment` for its platform."""
  target = next((a.split("=", 1)[1] for a in argv if a.startswith("--compile_for=")), None)
  if target:
    compile_targets.compile_only_environment(("cuda",) if target.startswith("h100") else ("tpu",))


if __name__ == "__main__":
  if "jax" in sys.modules:  # cannot happen with `python -m`; guard against misuse
    print(
      "warning: jax was imported before odetransformer.tools.memory; --num_devices may be ignored",
      file=sys.stderr,
    )
  _force_host_device_count(sys.argv)
  _compile_only_platform(sys.argv)

# jax reads XLA_FLAGS once, when it is imported: these imports come after the
# `_force_host_device_count` above.
from flax import nnx  # noqa: E402
import jax  # noqa: E402
from jax._src import config as jax_config  # noqa: E402  (the persistent cache's threshold)
import jax.numpy as jnp  # noqa: E402

from odetransformer import cli_flags, errors  # noqa: E402
from odetransformer.model import blocks  # noqa: E402
from odetransformer.model.param_count import attention_flops_per_token, flops_per_token  # noqa: E402
from odetransformer.tools import hlo_stats  # noqa: E402
from odetransformer.tools.memory_temporaries import temporaries_estimate  # noqa: E402
from odetransformer.train import optimizer as optimizer_lib  # noqa: E402
from odetransformer.train import setup, steps  # noqa: E402
from odetransformer.train import sharding as sharding_lib  # noqa: E402
from odetransformer.train.run_config import RunConfig  # noqa: E402

GIB = 1024**3
DEFAULT_COMPILE_MAX_PARAMS = 50_000_000


@dataclasses.dataclass
class MemoryReport:
  """Per-device bytes (the largest shard over all devices of each array)."""

  num_devices: int
  mesh_shape: dict
  num_params: int
  param_bytes: int  # nnx.Param leaves of the model
  other_model_bytes: int  # non-Param model state (RNG counters, ...)
  opt_state_bytes: int  # Adam mu/nu, step counters
  grad_bytes: int  # analytic: one float32 copy of the params' shards
  activation_bytes: int  # analytic: the batch + the peak temporaries but the gradients;
  # compiled: XLA temp bytes
  compiled: bool
  compile_seconds: float = 0.0
  xla: dict | None = None  # compiled: memory_analysis() fields
  device_memory_gib: float = 80.0
  temporaries: dict | None = None  # analytic estimate by kind (`temporaries_estimate`)
  eval_xla: dict | None = None  # compiled: the eval step's memory_analysis() fields
  estimate_bytes: int = 0  # the planner's (analytic) total, beside a compiled one
  target: str = ""  # `--compile_for`: the slice compiled for
  hlo: dict | None = None  # compiled: collectives and (TPU) cycles, `hlo_stats.parse_step`
  step_seconds: float = 0.0  # TPU: the compiler's estimated step time (0: none)
  mfu: float = 0.0  # the MFU that step time implies
  compile_oom: str = ""  # the target's compiler refused the step: more than its memory

  @property
  def state_bytes(self) -> int:
    return self.param_bytes + self.other_model_bytes + self.opt_state_bytes

  @property
  def total_bytes(self) -> int:
    if self.compiled:
      return _peak(self.xla)
    return self.state_bytes + self.grad_bytes + self.activation_bytes

  @property
  def eval_bytes(self) -> int | None:
    """The compiled eval step's peak (state, batch, temporaries), or None."""
    return _peak(self.eval_xla) if self.eval_xla else None

  @property
  def fits(self) -> bool:
    return not self.compile_oom and self.total_bytes <= self.device_memory_gib * GIB

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(
      state_bytes=self.state_bytes,
      total_bytes=self.total_bytes,
      fits=self.fits,
      eval_bytes=self.eval_bytes,
    )
    return d


_XLA_FIELDS = (
  "argument_size_in_bytes",
  "output_size_in_bytes",
  "alias_size_in_bytes",
  "temp_size_in_bytes",
  "generated_code_size_in_bytes",
)


def _xla_stats(compiled) -> dict:
  stats = compiled.memory_analysis()
  return {f: int(getattr(stats, f, 0) or 0) for f in _XLA_FIELDS}


def _peak(x: dict) -> int:
  """A compiled step's per-device peak from its memory_analysis() fields: arguments (the
  state + batch) live across the step; outputs alias a donated state; temporaries cover
  gradients and activations."""
  return (
    x["argument_size_in_bytes"]
    + x["output_size_in_bytes"]
    - x["alias_size_in_bytes"]
    + x["temp_size_in_bytes"]
    + x["generated_code_size_in_bytes"]
  )


def _per_device_bytes(tree) -> int:
  """Bytes on the most loaded device: sum over leaves of one shard's size."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def memory_report(
  config,
  *,
  compile_step: bool | None = None,
  compile_max_params: int = DEFAULT_COMPILE_MAX_PARAMS,
  device_memory_gib: float | None = None,
  devices=None,
  target: compile_targets.Target | None = None,
) -> MemoryReport:
  """Per-device memory of training `config` on `devices` (default: all of jax.devices()).

  Args:
    config: a training ConfigDict (configs/*.py); model.vocab_size is taken from
      data.vocab_size (the tokenizer's size at training time).
    compile_step: True = lower and compile the train step; False = analytic; None =
      compile when the model has fewer than `compile_max_params` parameters.
    device_memory_gib: the verdict's memory per device (default: the target chip's,
      else 80, an H100).
    target: a slice to compile for (`compile_targets.parse`): its compile-only devices
      (unless `devices` are given), always compiled; the report adds its step's
      collectives and, on TPU, the compiler's estimated step time and MFU.
  """
  if target is not None:
    devices = compile_targets.devices(target) if devices is None else devices
    compile_step = True
  device_memory_gib = device_memory_gib or (target.memory_gib if target else 80.0)
  devices = list(jax.devices() if devices is None else devices)
  settings = RunConfig.from_config(config)
  try:
    mesh = sharding_lib.make_mesh(settings.mesh, devices)
  except sharding_lib.MeshError as e:
    raise errors.ConfigError(str(e)) from e
  rules = settings.mesh.rules
  setup.check_config(settings, mesh)
  cfg = dataclasses.replace(settings.model, vocab_size=settings.data.vocab_size)
  tx = optimizer_lib.create_optimizer(
    settings.optim, settings.schedule.num_train_steps, ode=cfg.is_ode
  )

  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ts = steps.state_layout(cfg, tx, config.seed, mesh)
  abs_model, abs_opt = (ts.abstract["model"], ts.abstract["optimizer"])
  params = abs_model.filter(nnx.Param)
  num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  param_bytes = _per_device_bytes(params)
  model_bytes = _per_device_bytes(abs_model)
  temporaries = temporaries_estimate(config, cfg, mesh, rules, params)
  batch_shards = sharding_lib.num_batch_shards(mesh, rules)
  batch_bytes = 5 * (config.global_batch_size // batch_shards) * config.seq_len * 4
  report = MemoryReport(
    num_devices=len(devices),
    mesh_shape=dict(mesh.shape),
    num_params=num_params,
    param_bytes=param_bytes,
    other_model_bytes=model_bytes - param_bytes,
    opt_state_bytes=_per_device_bytes(abs_opt),
    grad_bytes=temporaries["gradients"],
    activation_bytes=batch_bytes + temporaries["peak"] - temporaries["gradients"],
    compiled=False,
    device_memory_gib=device_memory_gib,
    temporaries=temporaries,
    target=target.name if target else "",
  )

  report.estimate_bytes = report.total_bytes
  if compile_step is None:
    compile_step = num_params < compile_max_params
  if not compile_step:
    return report

  t0 = time.perf_counter()
  try:
    compiled = compile_train_step(config, cfg, ts, mesh, rules)
  except errors.UserError:
    raise
  except Exception as e:  # noqa: BLE001 (a target's compiler failing: one line)
    if target is None:
      raise
    if is_out_of_memory(str(e)):
      # XLA:TPU refuses a program larger than the chip's HBM: a verdict, not a failure.
      report.compile_oom = str(e).strip().splitlines()[0][:300]
      report.compile_seconds = time.perf_counter() - t0
      return report
    raise errors.UserError(compile_failure(e, cfg, config.seq_len, target)) from e
  report.compile_seconds = time.perf_counter() - t0
  report.xla = _xla_stats(compiled)
  report.activation_bytes = report.xla["temp_size_in_bytes"]
  report.compiled = True
  report.hlo = hlo_stats.parse_step(compiled.as_text())
  if target is not None and target.clock_hz and report.hlo["cycles"]:
    _estimate_step_time(report, config, cfg, target)
  report.eval_xla = _xla_stats(compile_eval_step(config, ts, mesh, rules))
  return report


def is_out_of_memory(message: str) -> bool:
  """Whether an XLA error says it ran out of memory: RESOURCE_EXHAUSTED from an allocator
  or a compiler (XLA:TPU refusing a program larger than HBM), XLA:CPU's dispatch's
  'INTERNAL: ... Out of memory allocating N bytes'."""
  return "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()


KERNEL_NAMES = {"splash": "Pallas splash attention (Mosaic)", "cudnn": "cuDNN flash attention"}


def compile_failure(e: Exception, cfg, seq_len: int, target) -> str:
  """The line for a train step `target`'s compiler rejected: what failed and, when a
  fused attention kernel did (named in the error, or the kernel the run uses), the
  fallback to XLA's attention."""
  text = str(e).strip()
  first = (text.splitlines() or [type(e).__name__])[0][:200]
  lowered = text.lower()
  named = (
    "splash"
    if any(w in lowered for w in ("mosaic", "tpu_custom_call", "pallas", "splash"))
    else "cudnn"
    if any(w in lowered for w in ("cudnn", "fmha"))
    else None
  )
  try:
    kernel = named or blocks.attention_kernel(cfg, seq_len, target.platform)
  except errors.ConfigError as config_error:
    return f"the train step does not compile for {target.name}: {config_error}"
  where = f"the train step does not compile for {target.name}: {first}"
  if kernel not in KERNEL_NAMES:
    return where
  return (
    f"{where}; {'it is' if named else 'it may be'} the {KERNEL_NAMES[kernel]} kernel: "
    "--config.model.attention_impl=xla falls back to XLA's attention"
  )


def advice(config) -> str:
  """What to change when a step does not fit, in the order that costs the run least
  (this report's last line, and main.py's when XLA runs out of memory)."""
  model, optim = config.model, config.optim
  changes = [
    f"--config.model.remat_policy=full (now {model.remat_policy!r})"
    if model.get("remat_policy", "full") != "full"
    else None,
    f"--config.optim.grad_accum_steps={2 * int(optim.grad_accum_steps)} (the same "
    f"global batch in {2 * int(optim.grad_accum_steps)} passes) or a smaller "
    f"--config.global_batch_size (now {config.global_batch_size})",
    "more devices in --config.mesh.shape (FSDP shards the parameters and AdamW state)",
  ]
  return "lower it with " + ", or ".join(c for c in changes if c)


def _estimate_step_time(report, config, cfg, target) -> None:
  """The compiler's estimate of one step on a TPU chip and the MFU it implies.

  Its kernels' estimated cycles (`hlo_stats`) at the chip's clock, plus, for each Pallas
  kernel (splash attention: the compiler has no estimate for Mosaic calls), the
  attention FLOPs of its share at the chip's peak. Collectives are taken as overlapped.
  """
  tokens = config.global_batch_size * config.seq_len
  fpt = flops_per_token(cfg, config.seq_len, tokens_per_batch=tokens)
  seconds = compile_targets.step_seconds(target, report.hlo["cycles"])
  if report.hlo["uncosted_kernels"]:
    attention = attention_flops_per_token(cfg, config.seq_len) * tokens / report.num_devices
    seconds += attention / target.peak_flops
  report.step_seconds = seconds
  report.mfu = fpt * tokens / (seconds * target.peak_flops * report.num_devices)


def abstract_batch(config, mesh, rules, batch_size=None) -> dict:
  """A step's batch (default: the train step's, `global_batch_size` rows) as
  ShapeDtypeStructs in the batch sharding (no data)."""
  batch_sharding = sharding_lib.batch_sharding(mesh, rules)
  shape = (batch_size or config.global_batch_size, config.seq_len)
  dtypes = {
    "inputs": jnp.int32,
    "targets": jnp.int32,
    "segment_ids": jnp.int32,
    "positions": jnp.int32,
    "weights": jnp.float32,
  }
  return {k: jax.ShapeDtypeStruct(shape, d, sharding=batch_sharding) for k, d in dtypes.items()}


def compile_train_step(config, cfg, ts, mesh, rules):
  """The real train step (`steps.make_train_step`) compiled for `mesh` on abstract inputs
  (`ts.abstract`, `abstract_batch`): nothing is allocated."""
  schedule = optimizer_lib.learning_rate_schedule(config.optim, config.num_train_steps)
  step = steps.make_train_step(
    ts,
    schedule,
    rules,
    grad_accum_steps=int(config.optim.grad_accum_steps),
    use_dropout=cfg.dropout_rate > 0,
  )
  rng = jax.eval_shape(lambda: jax.random.key(0))
  return _compile(step, mesh, rules, ts.abstract, abstract_batch(config, mesh, rules), rng)


def compile_eval_step(config, ts, mesh, rules):
  """The real eval step (`steps.make_eval_step`) compiled for `mesh` on an abstract
  state and a batch of `eval_batch_size` rows: nothing is allocated."""
  step = steps.make_eval_step(ts, rules)
  batch = abstract_batch(config, mesh, rules, config.eval_batch_size)
  return _compile(step, mesh, rules, ts.abstract, batch)


def _compile(step, mesh, rules, *abstract_args):
  """A `steps.make_*_step` compiled on abstract arguments. Its wrapper applies the
  activation rules when called; lowering bypasses it, so they are applied here. A
  program compiled for devices this process does not have (`--compile_for`) never goes
  into jax's persistent compilation cache: it could not be loaded back."""
  jitted = getattr(step, "__wrapped__", step)
  foreign = mesh.devices.flat[0].platform != jax.default_backend()
  with (
    jax.set_mesh(mesh),
    nnx.logical_axis_rules(sharding_lib.activation_rules(rules)),
    jax_config.persistent_cache_min_compile_time_secs(1e9) if foreign else contextlib.nullcontext(),
  ):
    return jitted.lower(*abstract_args).compile()


def format_report(r: MemoryReport) -> str:
  def gib(n):
    return f"{n / GIB:9.3f} GiB" if n >= GIB / 10 else f"{n / 2**20:9.3f} MiB"

  lines = [
    f"mesh {r.mesh_shape} on {r.num_devices} devices; {r.num_params:,} parameters",
    f"per device ({'compiled train step' if r.compiled else 'analytic'}):",
    f"  parameters          {gib(r.param_bytes)}",
    f"  other model state   {gib(r.other_model_bytes)}",
    f"  optimizer state     {gib(r.opt_state_bytes)}",
  ]
  if r.compiled:
    x = r.xla
    lines += [
      f"  XLA arguments       {gib(x['argument_size_in_bytes'])}  (state + batch)",
      f"  XLA outputs         {gib(x['output_size_in_bytes'])}  "
      f"({x['alias_size_in_bytes'] / GIB:.3f} GiB aliased to donated arguments)",
      f"  XLA temporaries     {gib(x['temp_size_in_bytes'])}  (gradients, activations)",
      f"  XLA code            {gib(x['generated_code_size_in_bytes'])}",
      f"  compile time        {r.compile_seconds:9.1f} s",
    ]
    if r.eval_xla:
      lines.append(
        f"  eval step peak      {gib(r.eval_bytes)}  (state + eval batch + "
        f"{r.eval_xla['temp_size_in_bytes'] / 2**20:.3f} MiB temporaries; "
        f"the train step's: {r.total_bytes / 2**20:.3f} MiB)"
      )
  else:
    lines += [f"  gradients (f32)     {gib(r.grad_bytes)}"]
    tmp = r.temporaries or {}
    names = (
      "hypernetwork gradients",
      "generated W(t)",
      "saved activations",
      "head",
      "layer",
      "embedding",
    )
    lines += [f"  {name:19s} {gib(tmp[name])}  (estimate)" for name in names if tmp.get(name)]
    if tmp:
      lines.append(
        f"  peak temporaries    {gib(tmp['peak'])}  (the larger of the backward "
        f"pass, {tmp['backward pass'] / GIB:.3f} GiB, and after the scan, "
        f"{tmp['after the scan'] / GIB:.3f} GiB: gradients, one phase of head / "
        "layer / embedding, and during the backward pass the saved activations)"
      )
  if r.compiled and r.estimate_bytes:
    lines.append(
      f"  planner's estimate  {gib(r.estimate_bytes)}  (compiled / estimate "
      f"{r.total_bytes / r.estimate_bytes:.2f}; `--nocompile` prints its parts)"
    )
  if r.hlo:
    lines.append(f"  collectives         {format_collectives(r.hlo)}")
  if r.step_seconds:
    lines.append(
      f"  step time           {r.step_seconds * 1e3:9.1f} ms  (the TPU compiler's estimate: "
      f"its kernels' cycles, Pallas kernels at peak FLOP/s, collectives overlapped) "
      f"-> MFU {100 * r.mfu:.0f}%"
    )
  if r.compile_oom:
    lines.append(
      f"  compiled            the {r.target} compiler ran out of memory: {r.compile_oom}"
    )
  verdict = "FITS" if r.fits else "DOES NOT FIT"
  where = f"per {r.target} chip" if r.target else "per device"
  lines.append(
    f"  total               {gib(r.total_bytes)}  of {r.device_memory_gib:g} GiB "
    f"{where}: {verdict} ({100 * r.total_bytes / (r.device_memory_gib * GIB):.0f}%)"
  )
  return "\n".join(lines)


def format_collectives(hlo: dict) -> str:
  """'all-gather 29 (0.287 GB), all-reduce 17 (...)' per step (loops times their trips)."""
  parts = [
    f"{kind} {hlo['counts'][kind]:,} ({hlo['weighted'][kind] / 1e9:.3f} GB)"
    for kind in hlo_stats.COLLECTIVES
    if hlo["counts"][kind]
  ]
  return (", ".join(parts) or "none") + " per step"


def main(argv, flag_values=None):
  """A bad flag or config is a UserError: one line and exit 2 (`errors.run_cli`);
  `flag_values` defaults to absl's FLAGS."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  if len(argv) > 1:
    raise errors.UserError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  if flag_values.num_devices and jax.device_count() != flag_values.num_devices:
    raise errors.UserError(
      f"asked for {flag_values.num_devices} devices but jax has {jax.device_count()} "
      f"({jax.devices()[0].platform}); run as `python -m odetransformer.memory` so "
      "XLA_FLAGS is set before jax loads"
    )
  target = None
  if flag_values.compile_for:
    if flag_values.num_devices:
      raise errors.UserError("--compile_for and --num_devices: give one (the target has its own)")
    target = compile_targets.parse(flag_values.compile_for)
  config = cli_flags.load_config_flag(flag_values["config"])
  if target:
    print(
      f"compiling the train and eval steps for {target.name} ({target.chips} chips, "
      f"{target.memory_gib:g} GiB each) on this CPU ...",
      flush=True,
    )
  report = memory_report(
    config,
    compile_step=flag_values.compile,
    compile_max_params=flag_values.compile_max_params,
    device_memory_gib=flag_values.device_memory_gib,
    target=target,
  )
  print(format_report(report))
  if flag_values.json:
    with open(flag_values.json, "w") as f:
      json.dump(report.to_dict(), f, indent=2)
  if not report.fits:
    why = (
      f"the {report.target} compiler ran out of memory ({report.compile_oom})"
      if report.compile_oom
      else f"{report.total_bytes / GIB:.2f} GiB per "
      f"{'chip of ' + report.target if report.target else 'device'}, "
      f"{report.device_memory_gib:g} GiB there"
    )
    raise errors.UserError(f"does not fit: {why}; {advice(config)}")


def define_flags(flag_values=None):
  """Defines this command's flags in `flag_values` (default: absl's global FLAGS)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  define = cli_flags.definer(fv)
  config_flags.DEFINE_config_file(
    "config", None, "Training config file (configs/*.py).", flag_values=fv, lock_config=True
  )
  define("integer", "num_devices", 0, "Fake CPU devices to plan for (0 = the real ones).")
  define(
    "string",
    "compile_for",
    "",
    f"Compile for this TPU slice or H100 cluster on this CPU ({compile_targets.EXAMPLES}).",
  )
  define(
    "float",
    "device_memory_gib",
    0.0,
    "Memory per device (default: the --compile_for chip's, else 80, an H100).",
  )
  define(
    "bool",
    "compile",
    None,
    "Compile the train step (default: only below "
    "--compile_max_params parameters); --nocompile = analytic only.",
  )
  define(
    "integer",
    "compile_max_params",
    DEFAULT_COMPILE_MAX_PARAMS,
    "Auto mode compiles only models smaller than this.",
  )
  define("string", "json", "", "Also write the report as JSON to this path.")
  define("bool", "verbose", False, "Show the traceback of a user error as well.")
  flags.mark_flags_as_required(["config"], flag_values=fv)
  return fv


if __name__ == "__main__":
  cli_flags.run_absl_tool(main, define_flags)
