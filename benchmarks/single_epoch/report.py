"""The reports of `benchmarks.single_epoch`: the first seed's learning curves as
D/single_epoch.md, .json and .png (`write_table` in the preset mode, `write_curves` in the
--config mode), the --eval_text lines, the model's label and the mean ± spread of the
per-seed ratios."""

import os
import statistics

from benchmarks import common
from benchmarks.single_epoch.runs import KINDS, SPLITS


def write_table(root: str, curves: dict, tokens_per_step: int) -> list:
  """The first seed's learning curves as markdown, JSON and a PNG in `root`; returns the rows."""
  rows = []
  for step in sorted(set(curves["transformer"]) & set(curves["diffeqformer"])):
    row = {"step": step, "tokens": step * tokens_per_step}
    for kind in KINDS:
      for split in SPLITS:
        row[f"{kind}_{split}"] = curves[kind][step][split]["perplexity"]
    row["test_ratio"] = row["diffeqformer_test"] / row["transformer_test"]
    row["test_tokens_scored"] = curves["transformer"][step]["test"]["tokens"]
    rows.append(row)
  common.write_json(os.path.join(root, "single_epoch.json"), rows)
  lines = [
    "| step | tokens | DiffEqFormer valid | DiffEqFormer test | GPT valid | GPT test "
    "| test ratio | test tokens scored |",
    "|---|---|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {r['step']} | {r['tokens']:,} | {r['diffeqformer_valid']:.2f} | "
    f"{r['diffeqformer_test']:.2f} | {r['transformer_valid']:.2f} | "
    f"{r['transformer_test']:.2f} | "
    f"{r['test_ratio']:.3f} | {r['test_tokens_scored']:,} |"
    for r in rows
  ]
  with open(os.path.join(root, "single_epoch.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  from matplotlib.figure import Figure  # lazy: matplotlib only for the plots

  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  for kind in KINDS:
    for split, style in zip(SPLITS, ("--", "-")):
      ax.plot(
        [r["tokens"] for r in rows],
        [r[f"{kind}_{split}"] for r in rows],
        "o" + style,
        label=f"{kind} {split}",
      )
  ax.set_yscale("log")
  ax.set_xlabel("training tokens")
  ax.set_ylabel("perplexity")
  ax.legend()
  fig.savefig(os.path.join(root, "single_epoch.png"))
  return lines


def write_curves(root: str, finals: dict, tokens_per_step: int) -> list:
  """--config mode: the first seed's valid curves and final scores as markdown, JSON and
  a PNG in `root`; returns the markdown lines."""
  ode, gpt = (finals[kind] for kind in KINDS)
  steps = sorted(set(map(int, ode["curve"])) & set(map(int, gpt["curve"])))
  rows = [
    {
      "step": s,
      "tokens": s * tokens_per_step,
      "diffeqformer_valid": ode["curve"][str(s)],
      "transformer_valid": gpt["curve"][str(s)],
    }
    for s in steps
  ]
  for row in rows:
    row["valid_ratio"] = row["diffeqformer_valid"] / row["transformer_valid"]
  final = {
    f"{kind}_{split}": finals[kind][split]["perplexity"] for kind in KINDS for split in SPLITS
  }
  common.write_json(os.path.join(root, "single_epoch.json"), {"curve": rows, "final": final})
  lines = [
    "| step | tokens | DiffEqFormer valid | GPT valid | valid ratio |",
    "|---|---|---|---|---|",
  ]
  lines += [
    f"| {r['step']} | {r['tokens']:,} | {r['diffeqformer_valid']:.2f} | "
    f"{r['transformer_valid']:.2f} | {r['valid_ratio']:.3f} |"
    for r in rows
  ]
  lines += ["", "| final (whole splits) | DiffEqFormer | GPT | ratio |", "|---|---|---|---|"]
  lines += [
    f"| {split} | {final['diffeqformer_' + split]:.2f} | "
    f"{final['transformer_' + split]:.2f} | "
    f"{final['diffeqformer_' + split] / final['transformer_' + split]:.3f} |"
    for split in SPLITS
  ]
  with open(os.path.join(root, "single_epoch.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  from matplotlib.figure import Figure  # lazy: matplotlib only for the plots

  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  last = steps[-1] * tokens_per_step if steps else 0
  for kind, color in zip(KINDS, ("tab:blue", "tab:orange")):
    ax.plot(
      [r["tokens"] for r in rows],
      [r[f"{kind}_valid"] for r in rows],
      "o-",
      color=color,
      label=f"{kind} valid",
    )
    ax.plot([last], [final[f"{kind}_test"]], "s", color=color, label=f"{kind} test (end)")
  ax.set_yscale("log")
  ax.set_xlabel("training tokens")
  ax.set_ylabel("perplexity")
  ax.legend()
  fig.savefig(os.path.join(root, "single_epoch.png"))
  return lines


def model_label(config) -> str:
  """'gpt2-small' (or medium, large) for the GPT-2 shapes, else d<width>-K<depth>."""
  m = config.model
  shapes = {
    (768, 12, 12): "gpt2-small",
    (1024, 16, 24): "gpt2-medium",
    (1280, 20, 36): "gpt2-large",
  }
  return shapes.get(
    (m.d_model, m.num_heads, m.solver_steps), f"d{m.d_model}-h{m.num_heads}-K{m.solver_steps}"
  )


def mean_spread(values: list) -> str:
  """'mean ± sample standard deviation' (just the value for one)."""
  if len(values) == 1:
    return f"{values[0]:.3f}"
  return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def print_eval_texts(args, seed: int, finals: dict) -> None:
  """One line per --eval_text file: each model's perplexity on it (and their ratio)."""
  for path in args.eval_texts:
    scored = {kind: finals[kind]["texts"][path] for kind in finals}
    parts = [f"{kind} ppl {scored[kind]['perplexity']:.2f}" for kind in scored]
    if len(scored) == len(KINDS):
      ratio = scored["diffeqformer"]["perplexity"] / scored["transformer"]["perplexity"]
      parts.append(f"diffeqformer/gpt ratio {ratio:.3f}")
    tokens = next(iter(scored.values()))["tokens"]
    print(
      f"seed {seed} eval_text {path} | " + " | ".join(parts) + f" | {tokens:,} tokens", flush=True
    )


def print_table_and_parameters(root: str, table: list, first_seed: dict) -> None:
  """The table's lines, where its files are, and both models' parameter counts (from the
  first seed's results, {kind: {..., 'num_params'}})."""
  print("\n".join(table))
  print(f"table: {root}/single_epoch.md, .json; learning curves: {root}/single_epoch.png")
  n_ode, n_gpt = (first_seed[kind]["num_params"] for kind in KINDS)
  print(
    f"parameters: diffeqformer {n_ode:,} | gpt {n_gpt:,}: the DiffEqFormer holds "
    f"{n_ode / n_gpt:.1f}x GPT's parameters (its hypernetworks)"
  )
