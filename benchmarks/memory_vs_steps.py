"""Compiled train-step memory vs K: DiffEqFormer and GPT side by side (bench-small).

From XLA's memory analysis of the product's train step, compiled against the abstract
state (nothing is initialised or run): argument bytes (params, optimizer state, batch)
and temporaries, for K = L = 6, 12, 24. With
rematerialisation the temporaries may grow with K only by the scan carry (the residual
stream saved per step, batch × seq × width × dtype bytes). The DiffEqFormer also holds
its generated weights W(t_k), made for all K steps by one GEMM before the scan, and,
in the backward pass, their gradient — one layer's weights twice per step, by design.
Last line: `ode temp growth per step / scan carry: X`, that growth net of the generated
weights and their gradient (target ≤ 1; ≫ 1 would mean activations stored per step).
Whether the generated weights show at all depends on where the peak is: in the
activation-heavy backward pass, or in the optimizer update. The growth is the slope
between the two largest K.

  python -m benchmarks.memory_vs_steps [--remat=full] [--steps=6,12,24]
"""

from benchmarks import common
from odetransformer import cli_flags, errors
from odetransformer.model.param_count import layer_params

MiB = 2**20


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  common.define_common_flags(define, remat="full")
  define("string", "steps", "6,12,24", "comma-separated K = L values compiled")


def main(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  b, length = common.shape(args)
  try:
    ks = [int(k) for k in args.steps.split(",")]
  except ValueError:
    raise errors.UserError(
      f"--steps={args.steps}: give step counts separated by commas, e.g. 6,12,24"
    ) from None
  bytes_per = 2 if args.dtype == "bfloat16" else 4
  print(f"preset {args.preset}, batch {b} × seq {length}, {args.dtype}, remat {args.remat}")
  print(
    f"{'model':13s} {'K':>4s} {'arguments MiB':>14s} {'temporaries MiB':>16s} "
    f"{'generated W MiB':>16s}"
  )
  # The ODE's generated weights per step: one layer's params (the same at every K).
  weights_per_step = layer_params(common.model_config(args, "diffeqformer")) * bytes_per
  temps = {}
  for kind in ("diffeqformer", "transformer"):
    for k in ks:
      cfg = common.model_config(args, kind, solver_steps=k, num_layers=k)
      trainer = common.Trainer(cfg, allocate=False)  # compiled, never run
      stats = trainer.lower(trainer.batch(b, length)).compile().memory_analysis()
      temps[kind, k] = stats.temp_size_in_bytes
      weights = k * weights_per_step if kind == "diffeqformer" else 0
      print(
        f"{kind:13s} {k:4d} {stats.argument_size_in_bytes / MiB:14.1f} "
        f"{stats.temp_size_in_bytes / MiB:16.1f} {weights / MiB:16.1f}"
      )
      del trainer
  carry = b * length * common.PRESETS[args.preset]["model"]["d_model"] * bytes_per
  per_step = {
    kind: (temps[kind, ks[-1]] - temps[kind, ks[-2]]) / (ks[-1] - ks[-2])
    for kind in ("diffeqformer", "transformer")
  }
  for kind, growth in per_step.items():
    print(
      f"{kind:13s} temporaries grow {growth / MiB:.2f} MiB per added step "
      f"(K {ks[-2]} → {ks[-1]}) "
      f"= {growth / carry:.2f} × the scan carry ({carry / MiB:.2f} MiB)"
    )
  net = per_step["diffeqformer"] - 2 * weights_per_step
  print(
    f"diffeqformer  net of the generated weights and their gradient "
    f"(2 × {weights_per_step / MiB:.2f} MiB per step): {net / MiB:.2f} MiB per step"
  )
  print(
    f"ode temp growth per step / scan carry: {max(net, 0.0) / carry:.2f} "
    f"(gpt: {per_step['transformer'] / carry:.2f})"
  )


if __name__ == "__main__":
  errors.run_cli(main)
