"""Bytes moved between devices and per-device memory: DiffEqFormer vs GPT, same shape.

Compiles the product's real train step (`steps.make_train_step` on a real TrainState,
AdamW with clipping, donated state) for both models and both families on 8 host CPU
devices, on the meshes (data, fsdp, tensor) = (1,8,1), (2,4,1) and (1,2,4). Nothing is
run: the optimised HLO of each step is parsed (`odetransformer.tools.hlo_stats`) and the
bytes of every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute
are summed by kind, once as written in the program (static) and once weighted by the
trip counts of the while loops they sit in (the solver's scan: what a step really
moves). Each collective counts the bytes of its full (unsharded) buffer: an all-gather's
result, a reduce-scatter's operand, the others' result. Per-device memory is XLA's
`memory_analysis()` of the same compiled step: arguments + outputs − aliased + temporaries.

The two architectures are compared at equal work: the DiffEqFormer without the local
error penalty, K field evaluations against the GPT's K layers. Last line:
`diffeqformer/gpt collective bytes: max ratio R over meshes` (weighted bytes; target
≤ 1.10), and the memory target is DiffEqFormer ≤ 1.10 × GPT + the ODE's own
hypernetwork shard: the per-device training state of its weight generators (P and P0,
their float32 gradient and Adam moments), which a GPT of the same shape does not have.
Where configs/default.py turns the penalty on (`model.local_error_weight`), the
DiffEqFormer's step as configured is a third row ("+ local error"): its E more field
evaluations (on every `local_error_stride`-th row; `ModelConfig.local_error_evaluations`,
2 under the default `local_error_form='both'`) gather E more sets of generated weights,
and the line before the last prints its collective bytes over those of the K evaluations
without it (at most (K + E) / K: E more evaluations').

  python -m benchmarks.collectives                 # bench-small (vocab 8192, d 256, K 6)
  python -m benchmarks.collectives --tiny          # seconds-sized, for the tests
  python -m benchmarks.collectives --meshes=1,8,1 --families=llama
"""

import math

from benchmarks.host_devices import force_host_devices

NUM_DEVICES = 8
if __name__ == "__main__":
  force_host_devices(NUM_DEVICES)  # before jax is imported: 8 fake CPU devices

# The rest after force_host_devices (E402): jax must see the 8 fake devices.
from flax import nnx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import default as default_config  # noqa: E402
from odetransformer import cli_flags, errors  # noqa: E402
from odetransformer.model import config as config_lib  # noqa: E402
from odetransformer.tools import hlo_stats, memory  # noqa: E402
from odetransformer.train import optimizer as optimizer_lib  # noqa: E402
from odetransformer.train import sharding as sharding_lib  # noqa: E402
from odetransformer.train import steps  # noqa: E402

KINDS = hlo_stats.COLLECTIVES
MESHES = ((1, 8, 1), (2, 4, 1), (1, 2, 4))
MiB = 2**20

# `--tiny`: compiles in seconds (compile time follows the program, not its shapes), its
# heads and batch split over every mesh above, and its buffers are large enough that
# `odetransformer.tools.memory`'s estimate is not dominated by XLA's small fixed ones.
TINY = dict(
  model=dict(
    vocab_size=4096,
    d_model=128,
    num_heads=4,
    mlp_dim=512,
    solver_steps=2,
    num_layers=2,
    max_len=128,
    time_embed_dim=16,
    time_sinusoids=16,
  ),
  seq_len=128,
  batch=8,
)


def make_config(preset: dict, kind: str, family: str, mesh_shape, remat: str, penalty=False):
  """configs/default.py with the preset's model and batch on `mesh_shape`; the local
  error penalty as configs/default.py sets it with `penalty`, else off."""
  c = default_config.get_config()
  if not penalty:
    c.model.local_error_weight = 0.0
  for key, value in preset["model"].items():
    if key == "vocab_size":
      c.data.vocab_size = value
    else:
      c.model[key] = value
  c.model.kind, c.model.family, c.model.remat_policy = kind, family, remat
  c.seq_len, c.global_batch_size = preset["seq_len"], preset["batch"]
  c.mesh.shape = tuple(mesh_shape)
  return c


def hypernet_bytes(ts) -> int:
  """Per-device bytes of the hypernetworks' weight generators' training state: P and P0,
  their Adam moments, and their float32 gradient (the state a GPT of the same shape
  does not have; its layers' own state is the GPT's too)."""
  total = 0
  # part 0: the model's state, 1: the optimizer's
  for part, tree in enumerate((ts.abstract["model"], ts.abstract["optimizer"])):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if "'gens'" not in jax.tree_util.keystr(path):
        continue
      n = math.prod(x.sharding.shard_shape(x.shape))
      total += n * np.dtype(x.dtype).itemsize
      if part == 0:
        total += n * 4  # its gradient, in float32
  return total


def measure(config, devices) -> dict:
  """Collective bytes and memory of one compiled train step."""
  mesh = sharding_lib.make_mesh(config.mesh, devices)
  rules = sharding_lib.logical_axis_rules(config.mesh.rules)
  cfg = config_lib.model_config(config, config.data.vocab_size)
  tx = optimizer_lib.create_optimizer(config.optim, config.num_train_steps, ode=cfg.is_ode)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ts = steps.state_layout(cfg, tx, config.seed, mesh)
    compiled = memory.compile_train_step(config, cfg, ts, mesh, rules)
  stats = compiled.memory_analysis()
  peak = (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )
  out = hlo_stats.parse_step(compiled.as_text())
  estimate = memory.memory_report(config, compile_step=False, devices=devices).total_bytes
  out.update(peak=peak, temp=stats.temp_size_in_bytes, hyper=hypernet_bytes(ts), estimate=estimate)
  return out


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("bool", "tiny", False, "seconds-sized shapes (tests)")
  define(
    "string",
    "meshes",
    ";".join(",".join(map(str, m)) for m in MESHES),
    "';'-separated data,fsdp,tensor shapes of 8 devices",
  )
  define("string", "families", "gpt2,llama", "comma-separated model families")
  define("string", "remat", "dots_saveable", "remat policy (both models)")


def main(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  if jax.device_count() != NUM_DEVICES:
    raise errors.UserError(
      f"jax has {jax.device_count()} devices, not {NUM_DEVICES}; run as a "
      "program (`python -m benchmarks.collectives`) so XLA_FLAGS is set before jax"
    )
  try:
    meshes = [tuple(int(v) for v in m.split(",")) for m in args.meshes.split(";") if m]
    for m in meshes:
      sharding_lib.resolve_mesh_shape(m, NUM_DEVICES)
  except (ValueError, sharding_lib.MeshError) as e:
    raise errors.UserError(f"--meshes={args.meshes!r}: {e}; e.g. --meshes='1,8,1;2,4,1'") from None
  families = [f for f in args.families.split(",") if f]
  bad = [f for f in families if f not in config_lib.FAMILIES]
  if bad or not families:
    raise errors.UserError(
      f"--families={args.families!r}: choose from {','.join(config_lib.FAMILIES)}"
    )
  preset = TINY if args.tiny else common.PRESETS["bench-small"]
  m = preset["model"]
  print(
    f"{'tiny' if args.tiny else 'bench-small'}: vocab {m['vocab_size']}, d {m['d_model']}, "
    f"{m['num_heads']} heads, {m['solver_steps']} steps, seq {preset['seq_len']}, "
    f"batch {preset['batch']}, d_t {m['time_embed_dim']}, f32, remat {args.remat}; "
    f"{NUM_DEVICES} host devices"
  )
  short = {
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-reduce": "AR",
    "all-to-all": "A2A",
    "collective-permute": "CP",
  }
  print(
    "collective MiB per step (static in the program / weighted by loop trip counts); "
    "memory MiB per device"
  )
  print(
    f"{'mesh':9s} {'family':7s} {'model':14s} "
    + " ".join(f"{short[k]:>13s}" for k in KINDS)
    + f" {'total':>15s} {'peak mem':>9s} {'temp':>8s} {'hyper':>7s} {'estimate':>9s}"
  )
  devices = jax.devices()
  penalty = default_config.get_config().model.local_error_weight > 0
  models = {"transformer": ("transformer", False), "diffeqformer": ("diffeqformer", False)}
  if penalty:
    models["+ local error"] = ("diffeqformer", True)
  ratios, penalty_ratios, estimates, mem_ok = [], [], [], True
  for mesh_shape in meshes:
    for family in families:
      res = {}
      for name, (kind, on) in models.items():
        c = make_config(preset, kind, family, mesh_shape, args.remat, penalty=on)
        res[name] = r = measure(c, devices)
        cells = " ".join(
          f"{r['static'][k] / MiB:6.2f}/{r['weighted'][k] / MiB:6.2f}" for k in KINDS
        )
        s, w = sum(r["static"].values()), sum(r["weighted"].values())
        print(
          f"{str(mesh_shape):9s} {family:7s} {name:14s} {cells} "
          f"{s / MiB:7.2f}/{w / MiB:7.2f} {r['peak'] / MiB:9.1f} {r['temp'] / MiB:8.1f} "
          f"{r['hyper'] / MiB:7.1f} {r['estimate'] / MiB:9.1f}",
          flush=True,
        )
        estimates.append(r["estimate"] / r["peak"])
        if r["unknown_trip_counts"]:
          print(
            f"  note: {r['unknown_trip_counts']} while loop(s) without a known trip "
            "count, counted once"
          )
      gpt, ode = res["transformer"], res["diffeqformer"]
      w_gpt, w_ode = sum(gpt["weighted"].values()), sum(ode["weighted"].values())
      ratio = w_ode / w_gpt if w_gpt else (1.0 if not w_ode else math.inf)
      ratios.append(ratio)
      budget = 1.10 * gpt["peak"] + ode["hyper"]
      mem_ok &= ode["peak"] <= budget
      print(
        f"{'':9s} {family:7s} ratio ode/gpt: collective bytes {ratio:.2f} (static "
        f"{sum(ode['static'].values()) / max(1, sum(gpt['static'].values())):.2f}); "
        f"peak memory {ode['peak'] / gpt['peak']:.2f} × gpt, "
        f"{ode['peak'] / budget:.2f} of 1.10 × gpt + hypernetwork shard"
      )
      if penalty:
        extra = res["+ local error"]
        penalty_ratios.append(sum(extra["weighted"].values()) / max(1, w_ode))
        print(
          f"{'':9s} {family:7s} + local error / diffeqformer: collective bytes "
          f"{penalty_ratios[-1]:.2f}, peak memory {extra['peak'] / ode['peak']:.2f}"
        )
  print(
    f"odetransformer.tools.memory estimate / compiled peak: from {min(estimates):.3f} to "
    f"{max(estimates):.3f} over {len(estimates)} steps"
  )
  print(
    f"memory target (ode ≤ 1.10 × gpt + its hypernetwork shard) "
    f"{'met' if mem_ok else 'NOT met'} on every mesh"
  )
  if penalty:
    k = preset["model"]["solver_steps"]
    form = default_config.get_config().model.local_error_form
    e = config_lib.ModelConfig(local_error_form=form).local_error_evaluations
    print(
      f"local error penalty: collective bytes up to {max(penalty_ratios):.2f} × the K = {k} "
      f"evaluations' without it ({e} more evaluation(s)': {(k + e) / k:.2f})"
    )
  print(f"diffeqformer/gpt collective bytes: max ratio {max(ratios):.2f} over meshes")


if __name__ == "__main__":
  errors.run_cli(main)
