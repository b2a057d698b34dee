"""The --config mode of `benchmarks.single_epoch` (GPT-2 small on one GPU): the
order of its runs (every seed trains the models one whole epoch by default, each in one
training call), its header lines (tokenizer, device, model and optimizer), the wall
times, and the report's last lines: the mean ± spread of the per-seed perplexity ratios
on the test split and on every --eval_text."""

import time

from benchmarks.single_epoch.analysis import analyse_or_say_why_not
from benchmarks.single_epoch.corpus import TrainingText, single_epoch_check
from benchmarks.single_epoch.report import (
  mean_spread,
  model_label,
  print_eval_texts,
  print_table_and_parameters,
  write_curves,
)
from benchmarks.single_epoch.runs import KINDS, describe_device, run_whole


def main_config(args, root: str, config, text: TrainingText, began: float) -> None:
  """--config mode: every seed trains both models one whole epoch (by default) through
  one training call each; the report ends with the mean ± spread of the ratios."""
  epoch = text.epoch
  label = model_label(config)
  tokens_per_step = config.global_batch_size * config.seq_len
  print(
    f"tokenizer: SentencePiece, {epoch['vocab_size']:,} pieces, trained once on "
    f"{args.data_dir}/train-*.txt, shared by every run (sha256 "
    f"{text.key['tokenizer'][:12]}); the same data order for both models of a seed",
    flush=True,
  )
  print(
    f"device: {describe_device()}; {label}: {config.model.d_model} wide, "
    f"{config.model.num_heads} heads, K = L = {config.model.solver_steps}, d_t "
    f"{config.model.time_embed_dim}, S {config.model.time_sinusoids}, dropout "
    f"{config.model.dropout_rate}, {config.model.dtype} compute; AdamW peak lr "
    f"{config.optim.learning_rate:g}, betas {config.optim.b1:g}/{config.optim.b2:g}, "
    f"weight decay {config.optim.weight_decay:g}, warm-up "
    f"{config.optim.warmup_frac:.0%} then {config.optim.schedule} to "
    f"{config.optim.min_lr_ratio:g}x; batch {config.global_batch_size} x "
    f"{config.seq_len}",
    flush=True,
  )
  stop = args.stop_after or max(args.steps, args.seed_steps)
  finals, first = {}, args.first_seed
  compare = args.kinds == KINDS
  for seed in range(first, first + args.seeds):
    steps = args.steps if seed == first else args.seed_steps
    runs = {kind: run_whole(args, kind, seed, steps, root, stop, text) for kind in args.kinds}
    if any(r is None for r in runs.values()):
      print(
        f"stopped after step {stop} (--stop_after); the same command without it continues",
        flush=True,
      )
      return
    finals[seed] = runs
    if compare:
      ratio = runs["diffeqformer"]["test"]["perplexity"] / runs["transformer"]["test"]["perplexity"]
      print(
        f"seed {seed} ({steps} steps) diffeqformer/gpt test perplexity ratio: {ratio:.3f}",
        flush=True,
      )
    print_eval_texts(args, seed, runs)
    print(
      single_epoch_check(config, epoch, steps, max(r["documents_read"] for r in runs.values())),
      flush=True,
    )
    if seed == first and compare:
      table = write_curves(root, runs, tokens_per_step)
    if seed == first and args.analysis:
      analyse_or_say_why_not(args, root, seed, steps)
  for kind in args.kinds:
    seconds = [finals[s][kind]["train_seconds"] for s in finals]
    print(
      f"wall time {kind}: training "
      + ", ".join(f"{x:.1f}" for x in seconds)
      + " s per seed (compilation and the curve's evaluations included), scoring "
      + ", ".join(f"{finals[s][kind]['score_seconds']:.1f}" for s in finals)
      + " s",
      flush=True,
    )
  print(
    f"wall time of this command: {time.perf_counter() - began:.1f} s on {describe_device()}",
    flush=True,
  )
  if not compare:
    return
  print_table_and_parameters(root, table, finals[first])
  seeds = sorted(finals)
  for path in args.eval_texts:
    ratios = [
      finals[s]["diffeqformer"]["texts"][path]["perplexity"]
      / finals[s]["transformer"]["texts"][path]["perplexity"]
      for s in seeds
    ]
    print(
      f"eval_text {path}: diffeqformer/gpt perplexity ratio {mean_spread(ratios)} "
      f"({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
    )
  ratios = [
    finals[s]["diffeqformer"]["test"]["perplexity"] / finals[s]["transformer"]["test"]["perplexity"]
    for s in seeds
  ]
  tokens = args.steps * tokens_per_step
  others = (
    f"; seeds after the first {args.seed_steps * tokens_per_step:,} tokens"
    if args.seeds > 1 and args.seed_steps != args.steps
    else ""
  )
  print(
    f"{label} single-epoch diffeqformer/gpt test perplexity ratio: "
    f"{mean_spread(ratios)} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}, "
    f"{tokens:,} tokens{others})"
  )
