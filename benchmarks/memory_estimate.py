"""`python -m odetransformer.memory`'s analytic estimate against the compiled train step.

For each shape, model (DiffEqFormer, GPT) and mesh (data, fsdp, tensor) of 8 host CPU
devices, builds the training config, and prints the analytic per-device total
(`memory.memory_report(compile_step=False)`: state, gradients and the peak of the
temporaries it models) next to XLA's memory analysis of the real train step compiled for
that mesh (arguments + outputs − aliased + temporaries), and their ratio. Shapes:
bench-small (vocab 8192, d 256, K 6, seq 256, batch 8; float32) under remat
'dots_saveable' and 'full', and configs/owt_small.py as it is (bf16, remat 'full',
batch 512 × 1024). Nothing is allocated: compiling owt_small takes about a minute per
mesh and a few GiB of host memory.

Last line: `memory estimate / compiled: from A to B over N configurations` (target:
within 0.85 to 1.15).

  python -m benchmarks.memory_estimate

The tests hold the estimate to ±15% at a seconds-sized shape through
`python -m benchmarks.collectives --tiny`, which prints it beside each compiled step.
"""

from benchmarks.host_devices import force_host_devices

NUM_DEVICES = 8
if __name__ == "__main__":
  force_host_devices(NUM_DEVICES)  # before jax is imported: 8 fake CPU devices

# The rest after force_host_devices (E402): jax must see the 8 fake devices.
import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.collectives import MESHES, make_config  # noqa: E402
from configs import owt_small  # noqa: E402
from odetransformer import cli_flags, errors  # noqa: E402
from odetransformer.tools import memory  # noqa: E402

MiB = 2**20
SHAPES = ("bench-small", "owt_small")
REMATS = ("dots_saveable", "full")


def configs(shape: str, kind: str, mesh, remats):
  """(label, training config) for one shape on `mesh`."""
  if shape == "owt_small":
    c = owt_small.get_config()
    c.model.kind = kind
    c.mesh.shape = tuple(mesh)
    yield f"owt_small {c.model.remat_policy}", c
    return
  for remat in remats:
    yield f"{shape} {remat}", make_config(common.PRESETS[shape], kind, "transformer", mesh, remat)


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("string", "shapes", "bench-small,owt_small", f"comma-separated, from {', '.join(SHAPES)}")
  define("string", "remat", ",".join(REMATS), "remat policies of bench-small (owt_small: its own)")


def main(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  remats = [r for r in args.remat.split(",") if r]
  if not remats or any(r not in REMATS for r in remats):
    raise errors.UserError(f"--remat={args.remat!r}: choose from {', '.join(REMATS)}")
  shapes = [s for s in args.shapes.split(",") if s]
  if not shapes or any(s not in SHAPES for s in shapes):
    raise errors.UserError(f"--shapes={args.shapes!r}: choose from {', '.join(SHAPES)}")
  if jax.device_count() != NUM_DEVICES:
    raise errors.UserError(
      f"jax has {jax.device_count()} devices, not {NUM_DEVICES}; run as a "
      "program (`python -m benchmarks.memory_estimate`) so XLA_FLAGS is set first"
    )
  print(
    f"per-device MiB on {NUM_DEVICES} host devices: the analytic estimate "
    "(odetransformer.tools.memory) and the compiled train step's memory analysis"
  )
  print(
    f"{'shape, remat':27s} {'model':12s} {'mesh':9s} {'estimate':>10s} "
    f"{'compiled':>10s} {'ratio':>6s}  estimate's peak temporaries"
  )
  ratios = []
  for shape in shapes:
    for kind in ("diffeqformer", "transformer"):
      for mesh in MESHES:
        for label, config in configs(shape, kind, mesh, remats):
          est = memory.memory_report(config, compile_step=False)
          xla = memory.memory_report(config, compile_step=True)
          ratio = est.total_bytes / xla.total_bytes
          ratios.append(ratio)
          t = est.temporaries
          which = "backward pass" if t["backward pass"] >= t["after the scan"] else "after the scan"
          print(
            f"{label:27s} {kind:12s} {str(mesh):9s} {est.total_bytes / MiB:10.1f} "
            f"{xla.total_bytes / MiB:10.1f} {ratio:6.3f}  {which}",
            flush=True,
          )
  print(
    f"memory estimate / compiled: from {min(ratios):.3f} to {max(ratios):.3f} over "
    f"{len(ratios)} configurations"
  )


if __name__ == "__main__":
  errors.run_cli(main)
