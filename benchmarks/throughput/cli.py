"""Train-step tokens/s of DiffEqFormer vs the GPT-2 of the same width and depth (K = L),
and, given a nanoGPT checkout, against nanoGPT's GPT-2 on the same device.

Both our models run the product's train step (AdamW, clipping, donation) and are timed in
turn in one process. Also times the forward pass of the materialised DiffEqFormer against
the GPT forward (target ≥ 0.98). Last line: `ode/gpt train tokens/s ratio: X.XX`
(target ≥ 0.90 on bench-small; one figure per batch with `--batches`).

  python -m benchmarks.throughput                       # bench-small, f32, CPU
  python -m benchmarks.throughput --preset=owt-small --dtype=bfloat16 --batches=16,32 \
      --nanogpt=DIR [--profile]                         # one GPU: the side-by-side table
  python -m benchmarks.throughput --also=parallel,shared   # where the ODE's extra time goes

`--nanogpt=DIR` (a checkout of karpathy/nanoGPT, never copied here) times nanoGPT's own
train step (`nanogpt_step`: torch.compile on CUDA, bf16 autocast, fused AdamW)
at each batch in a child process before jax takes the device, and prints each of our
models' tokens/s over nanoGPT's. `--profile` traces `--profile_steps` steps of each model
at each batch and prints where the step's time goes (`profile_split`: matmul,
attention, other fusions, copies, idle, and the costliest ops).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from flax import nnx
import jax

from benchmarks import common
from benchmarks.throughput import profile_split
from odetransformer import cli_flags, errors
from odetransformer.model.config import KINDS
from odetransformer.model.materialize import materialize
from odetransformer.model.param_count import count_params, flops_per_token
from odetransformer.train import metrics


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  common.define_common_flags(define)
  define("integer", "rounds", 10, "Timed rounds.")
  define(
    "string",
    "also",
    "",
    "more model kinds timed in the same rotation, e.g. parallel,shared "
    "(the discrete parallel-block model and the weight-sharing ODE: "
    "the DiffEqFormer's layers without its hypernetwork)",
  )
  define("string", "batches", "", "batch sizes timed in one run, e.g. 16,32 (default: --batch)")
  define(
    "string",
    "nanogpt",
    "",
    "a karpathy/nanoGPT checkout: time its train step at each batch "
    "in the same run and print our/nanoGPT tokens/s ratios",
  )
  define("integer", "nanogpt_rounds", 5, "nanoGPT's timed rounds (after 3 untimed steps)")
  define("integer", "nanogpt_steps_per_round", 10, "nanoGPT's steps per timed round")
  define(
    "bool",
    "profile",
    False,
    "trace each model at each batch and print where the step's time "
    "goes (matmul, attention, other fusions, copies, idle)",
  )
  define("integer", "profile_steps", 5, "Steps traced per model and batch with --profile.")
  define(
    "bool",
    "packed",
    False,
    "feed packed rows (segment ids, several documents a row, as the input pipeline makes "
    "them) instead of one document a row (causal attention only, as nanoGPT trains)",
  )


def parse_args(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  args.also = [k for k in args.also.split(",") if k]
  baselines = [k for k in KINDS if k not in ("diffeqformer", "transformer")]
  for kind in args.also:
    if kind not in baselines:
      raise errors.UserError(f"--also={kind}: choose from {', '.join(baselines)}")
  b, _ = common.shape(args)
  try:
    args.batches = [int(x) for x in args.batches.split(",") if x.strip()] or [b]
  except ValueError:
    raise errors.UserError(
      f"--batches={args.batches}: give batch sizes separated by commas, e.g. 16,32"
    ) from None
  if min(args.batches) <= 0:
    raise errors.UserError(
      f"--batches={args.batches}: batch sizes must be positive; e.g. --batches=16,32"
    )
  if args.nanogpt and not os.path.isfile(os.path.join(args.nanogpt, "model.py")):
    raise errors.UserError(
      f"--nanogpt={args.nanogpt} holds no model.py; pass a checkout of karpathy/nanoGPT"
    )
  if args.profile_steps <= 0:
    raise errors.UserError(
      f"--profile_steps={args.profile_steps} must be positive; pass --profile_steps=5"
    )
  return args


def nanogpt_step(args, batch: int, length: int) -> dict:
  """nanoGPT's train step at the preset's shape, timed in a child process
  (`nanogpt_step`): its JSON line as a dict."""
  model = common.PRESETS[args.preset]["model"]
  cmd = [
    sys.executable,
    "-m",
    "benchmarks.throughput.nanogpt_step",
    f"--nanogpt={args.nanogpt}",
    f"--batch={batch}",
    f"--seq_len={length}",
    f"--vocab={model['vocab_size']}",
    f"--layers={model['num_layers']}",
    f"--heads={model['num_heads']}",
    f"--d_model={model['d_model']}",
    f"--rounds={args.nanogpt_rounds}",
    f"--steps_per_round={args.nanogpt_steps_per_round}",
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO_ROOT, check=False)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise SystemExit(
      f"error: nanoGPT's step failed at batch {batch} ({why}); run "
      f"{' '.join(cmd[1:])} to see it whole"
    )
  return json.loads(lines[-1])


def main(argv=None):
  args = parse_args(argv)
  _, length = common.shape(args)
  fields = common.PRESETS[args.preset]["model"]
  # nanoGPT first, each batch in its own process: jax then has the device to itself.
  nano = {b: nanogpt_step(args, b, length) for b in args.batches} if args.nanogpt else {}
  print(
    f"devices: {jax.device_count()} × {jax.devices()[0].device_kind}; preset "
    f"{args.preset}, {args.dtype}, remat {args.remat}"
  )
  if nano and fields["mlp_dim"] != 4 * fields["d_model"]:
    print(
      f"note: nanoGPT's MLP is 4 × d_model; this preset's is {fields['mlp_dim']}: the "
      "nanoGPT ratios compare unequal shapes"
    )
  trainers = {
    kind: common.Trainer(common.model_config(args, kind))
    for kind in ("diffeqformer", "transformer", *args.also)
  }
  peak, source = metrics.device_peak_flops(dtype=args.dtype)
  if jax.devices()[0].platform != "cpu":
    peak *= jax.device_count()  # as the training log: XLA:CPU's devices share the host
  headline = {}
  for i, b in enumerate(args.batches):
    batches = {kind: t.batch(b, length, packed=args.packed) for kind, t in trainers.items()}
    headline[b] = time_batch(args, trainers, batches, nano.get(b), peak)
    if i == 0:
      time_forward(args, trainers, batches["transformer"]["inputs"], b * length)
  print(
    f"(MFU against {peak / 1e12:.3f} TFLOP/s: {source}; the training log's definition, "
    "odetransformer.train.metrics.device_peak_flops; nanoGPT's with our GPT's FLOPs)"
  )
  if len(headline) == 1:
    print(f"ode/gpt train tokens/s ratio: {headline[args.batches[0]]:.2f}")
  else:
    print(
      "ode/gpt train tokens/s ratio: "
      + ", ".join(f"{r:.2f} (batch {b})" for b, r in headline.items())
    )


def time_batch(args, trainers: dict, batches: dict, nano, peak: float) -> float:
  """Times (and with --profile traces) every model at one batch; prints its lines and
  returns the DiffEqFormer/GPT tokens/s ratio."""
  b, length = batches["transformer"]["inputs"].shape
  rows = "packed rows" if "segment_ids" in batches["transformer"] else "one document a row"
  print(f"-- batch {b} × seq {length}, {args.dtype}, remat {args.remat}, {rows}", flush=True)
  rounds = common.time_rounds(
    {kind: (lambda k=kind: trainers[k].step(batches[k])) for kind in trainers}, rounds=args.rounds
  )
  tokens = b * length
  tps = {}
  for kind, t in trainers.items():
    sec = statistics.median(rounds[kind])
    tps[kind] = tokens / sec
    fpt = flops_per_token(t.cfg, length, tokens_per_batch=tokens)
    print(
      f"{kind:13s} train: {sec * 1e3:8.1f} ms/step {tps[kind]:10,.0f} tokens/s "
      f"MFU {tps[kind] * fpt / peak:6.1%}  params {count_params(t.cfg) / 1e6:,.1f} M"
    )
  if nano:
    fpt = flops_per_token(trainers["transformer"].cfg, length, tokens_per_batch=tokens)
    print(
      f"{'nanogpt':13s} train: {nano['ms_per_step']:8.1f} ms/step "
      f"{nano['tokens_per_s']:10,.0f} tokens/s MFU {nano['tokens_per_s'] * fpt / peak:6.1%}"
      f"  params {nano['params'] / 1e6:,.1f} M (torch {nano['torch']}, "
      f"{'compiled' if nano['compiled'] else 'eager'}, {nano['device']})"
    )
    for kind in trainers:
      print(f"{kind}/nanogpt train tokens/s ratio: {tps[kind] / nano['tokens_per_s']:.2f}")
  for kind in args.also:
    print(
      f"{kind}/gpt train tokens/s ratio: {tps[kind] / tps['transformer']:.2f} "
      f"(per round: {common.paired_spread(rounds['transformer'], rounds[kind])})"
    )
  # The ratio of the medians is the figure; the same ratio per round (each pair timed back
  # to back) shows how much of it is this machine's noise.
  print(
    "ode/gpt train ratio per round: "
    + common.paired_spread(rounds["transformer"], rounds["diffeqformer"])
  )
  if args.profile:
    for kind, t in trainers.items():
      with tempfile.TemporaryDirectory(prefix="odet_profile_") as logdir:
        events, wall = profile_split.trace(
          lambda t=t, k=kind: t.step(batches[k]), args.profile_steps, logdir
        )
      for line in profile_split.format_split(
        f"{kind} {b}×{length}", profile_split.split(events, args.profile_steps, wall)
      ):
        print(line)
  return tps["diffeqformer"] / tps["transformer"]


def _forward(model, tokens_in):
  """A timed call of `model` on `tokens_in`, jitted over its state as a plain input.

  Not `nnx.jit` over the module: that writes the outputs' state back into it, in the
  shardings the compiler chose (the GPT's FSDP-sharded parameters came back replicated),
  and the module shares its arrays with the trainer's state, whose later train steps
  (the next --batches entry) would then run on those shardings, as another program."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  return lambda: forward(state, tokens_in)


def time_forward(args, trainers: dict, tokens_in, tokens: int) -> None:
  """The materialised DiffEqFormer (plain parallel layers) vs GPT, forward only."""
  ode_model = trainers["diffeqformer"].ts.merge(trainers["diffeqformer"].state)[0]
  gpt_model = trainers["transformer"].ts.merge(trainers["transformer"].state)[0]
  mat = materialize(ode_model, ode_model.config.depth)
  # A forward is ~1/4 of a train step: 3× the rounds for a steadier median in less time.
  fwd = common.time_alternating(
    {"materialised": _forward(mat, tokens_in), "transformer": _forward(gpt_model, tokens_in)},
    rounds=3 * args.rounds,
  )
  for name, s in fwd.items():
    print(f"{name:13s} forward: {s * 1e3:8.1f} ms {tokens / s:10,.0f} tokens/s")
  print(f"materialised/gpt forward tokens/s ratio: {fwd['transformer'] / fwd['materialised']:.2f}")
