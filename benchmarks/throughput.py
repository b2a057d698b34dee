"""Train-step tokens/s of DiffEqFormer vs the GPT-2 of the same width and depth (K = L).

Both run the product's train step (AdamW, clipping, donation) and are timed in turn in
one process. Also times the forward pass of the materialised DiffEqFormer against the
GPT forward (target ≥ 0.98). Last line: `ode/gpt train tokens/s ratio: X.XX`
(target ≥ 0.90 on bench-small).

  python -m benchmarks.throughput                       # bench-small, f32, CPU
  python -m benchmarks.throughput --preset=gpt2-small --dtype=bfloat16 --seq_len=1024
  python -m benchmarks.throughput --also=parallel,shared   # where the ODE's extra time goes
"""
import argparse
import statistics

from flax import nnx
import jax

from benchmarks import common
from odetransformer.model.config import KINDS
from odetransformer.model.materialize import materialize
from odetransformer.model.param_count import count_params, flops_per_token
from odetransformer.train import metrics


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_common_flags(parser)
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--also", default="",
                      help="more model kinds timed in the same rotation, e.g. parallel,shared "
                           "(the discrete parallel-block model and the weight-sharing ODE: "
                           "the DiffEqFormer's layers without its hypernetwork)")
  args = parser.parse_args()
  also = [k for k in args.also.split(",") if k]
  baselines = [k for k in KINDS if k not in ("diffeqformer", "transformer")]
  for kind in also:
    if kind not in baselines:
      parser.error(f"--also={kind}: choose from {', '.join(baselines)}")
  b, length = common.shape(args)
  print(f"devices: {jax.device_count()} × {jax.devices()[0].device_kind}; preset {args.preset}, "
        f"batch {b} × seq {length}, {args.dtype}, remat {args.remat}")

  trainers = {kind: common.Trainer(common.model_config(args, kind))
              for kind in ("diffeqformer", "transformer", *also)}
  batches = {kind: t.batch(b, length) for kind, t in trainers.items()}
  rounds = common.time_rounds(
      {kind: (lambda k=kind: trainers[k].step(batches[k])) for kind in trainers},
      rounds=args.rounds)
  secs = {kind: statistics.median(ts) for kind, ts in rounds.items()}
  peak, source = metrics.device_peak_flops(dtype=args.dtype)
  if jax.devices()[0].platform != "cpu":
    peak *= jax.device_count()      # as the training log: XLA:CPU's devices share the host
  tokens = b * length
  tps = {}
  for kind, t in trainers.items():
    tps[kind] = tokens / secs[kind]
    fpt = flops_per_token(t.cfg, length, tokens_per_batch=tokens)
    print(f"{kind:13s} train: {secs[kind] * 1e3:8.1f} ms/step {tps[kind]:10,.0f} tokens/s "
          f"MFU {tps[kind] * fpt / peak:6.1%}  params {count_params(t.cfg) / 1e6:,.1f} M")
  for kind in also:
    print(f"{kind}/gpt train tokens/s ratio: {tps[kind] / tps['transformer']:.2f} "
          f"(per round: {common.paired_spread(rounds['transformer'], rounds[kind])})")
  print(f"(MFU against {peak / 1e12:.3f} TFLOP/s: {source}; the training log's definition, "
        "odetransformer.train.metrics.device_peak_flops)")

  # Inference: the materialised DiffEqFormer (plain parallel layers) vs GPT, forward only.
  ode_model = trainers["diffeqformer"].ts.merge(trainers["diffeqformer"].state)[0]
  gpt_model = trainers["transformer"].ts.merge(trainers["transformer"].state)[0]
  mat = materialize(ode_model, ode_model.config.depth)
  tokens_in = batches["transformer"]["inputs"]
  forward = nnx.jit(lambda m, x: m(x))
  # A forward is ~1/4 of a train step: 3× the rounds for a steadier median in less time.
  fwd = common.time_alternating({"materialised": lambda: forward(mat, tokens_in),
                                 "transformer": lambda: forward(gpt_model, tokens_in)},
                                rounds=3 * args.rounds)
  for name, s in fwd.items():
    print(f"{name:13s} forward: {s * 1e3:8.1f} ms {tokens / s:10,.0f} tokens/s")
  print(f"materialised/gpt forward tokens/s ratio: {fwd['transformer'] / fwd['materialised']:.2f}")
  # The ratio of the medians is the figure; the same ratio per round (each pair timed back
  # to back) shows how much of it is this machine's noise.
  print("ode/gpt train ratio per round: "
        + common.paired_spread(rounds["transformer"], rounds["diffeqformer"]))
  print(f"ode/gpt train tokens/s ratio: {tps['diffeqformer'] / tps['transformer']:.2f}")


if __name__ == "__main__":
  main()
