"""The report of `benchmarks.adaptive_finetune`: the table of fine-tuned validation
perplexities (mean ± std over seeds, then every seed's values) written to
--out/adaptive_finetune.md and printed, the plot --out/adaptive_finetune.png, and the
last line, the diffeqformer/gpt ratio at N = K per pre-training grid."""

import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  after the Agg backend is chosen


def mean_std(values):
  return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(values):
  m, s = mean_std(values)
  return f"{m:.2f} ± {s:.2f}" if len(values) > 1 else f"{m:.2f}"


def write_report(args, seeds, ode: dict, start_ppl: dict, gpt: dict) -> None:
  """Writes and prints the table and the plot of the perplexities gathered over `seeds`:
  `ode` (grid, method, N), `start_ppl` (grid, N) and `gpt` (method) -> [ppl per seed]."""
  ns, s = args.ns, args.seeds
  rows = {}  # row name -> [values per N, each a list over seeds]
  for grid in args.grids:
    rows[f"DiffEqFormer {grid} before"] = [start_ppl[grid, n] for n in ns]
    for method in args.methods:
      rows[f"DiffEqFormer {grid} {method}"] = [ode[grid, method, n] for n in ns]
  for method, values in gpt.items():
    rows[f"GPT ({args.gpt_layers} layers) {method}"] = [values for _ in ns]
  header = "| model pre-training grid, method | " + " | ".join(f"N={n}" for n in ns) + " |"
  rule = "|" + "---|" * (len(ns) + 1)
  lines = [
    f"Fine-tuned validation perplexity, mean ± std over {s} seeds "
    f"({args.finetune_steps} fine-tuning steps after {args.pretrain_steps} "
    f"pre-training steps; DiffEqFormer K = {args.k}, GPT {args.gpt_layers} layers; "
    f"d {args.d_model}, LoRA r {args.lora_rank} alpha {args.lora_alpha:g}; "
    "'before' = the pre-trained model, not fine-tuned)",
    "",
    header,
    rule,
  ]
  lines += [
    f"| {name} | " + " | ".join(fmt(v) for v in values) + " |" for name, values in rows.items()
  ]
  lines += [
    "",
    "Per seed:",
    "",
    "| seed | run | " + " | ".join(f"N={n}" for n in ns) + " |",
    "|---|" + "---|" * (len(ns) + 1),
  ]
  for i, seed in enumerate(seeds):
    lines += [
      f"| {seed} | {name} | " + " | ".join(f"{v[i]:.2f}" for v in values) + " |"
      for name, values in rows.items()
    ]
  text = "\n".join(lines)
  with open(os.path.join(args.out, "adaptive_finetune.md"), "w") as f:
    f.write(text + "\n")
  print(text)

  fig, ax = plt.subplots(figsize=(6, 4))
  for grid, style in zip(args.grids, ("-", "--", ":")):
    for method, color in zip(args.methods, ("C0", "C1", "C2")):  # 'before': in the table
      means = [mean_std(v) for v in rows[f"DiffEqFormer {grid} {method}"]]
      ax.errorbar(
        ns,
        [m for m, _ in means],
        yerr=[e for _, e in means],
        marker="o",
        capsize=3,
        linestyle=style,
        color=color,
        label=f"DiffEqFormer {grid} {method}",
      )
  for method, values in gpt.items():
    if method != "before":
      ax.axhline(
        mean_std(values)[0],
        linestyle="-." if method == "full" else ":",
        color="black",
        label=f"GPT {method} ({args.gpt_layers} layers)",
      )
  ax.set_xlabel("fine-tuning steps N")
  ax.set_ylabel("validation perplexity (log scale)")
  ax.set_yscale("log")
  ax.set_title(f"Adaptive fine-tuning, {s} seeds")
  ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "adaptive_finetune.png"), dpi=120)
  per_grid = []
  for grid in args.grids:
    ratios = [
      f"{m} {mean_std(ode[grid, m, args.k])[0] / mean_std(gpt[m])[0]:.3f}"
      for m in ("full", "lora")
      if m in gpt and (grid, m, args.k) in ode
    ]
    if ratios:
      per_grid.append(f"{grid}: {', '.join(ratios)}")
  if per_grid:
    print(
      f"diffeqformer/gpt fine-tuned perplexity ratio at N={args.k}: "
      f"{'; '.join(per_grid)} (mean of {s} seeds)"
    )
