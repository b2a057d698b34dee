r"""A pretrained Llama (SmolLM2-135M) imported, fitted as a DiffEqFormer, evaluated at
other N and fine-tuned at N = L/2.

  python -m benchmarks.import_fit --from=SmolLM2-135M-Instruct.Q4_1.gguf \
      --eval_text=DATA/wikitext-2/test.txt --train_text=DATA/wikitext-2/valid.txt \
      --workdir=$HOME/odet_import_fit [--max_batches=4] [--finetune_steps=40]

Stages (each result is kept in WORKDIR/results.json; a stage already there is not run
again, so an interrupted run continues where it stopped):

1. `import_checkpoint` of the baseline and of `--fit=diffeqformer`, each its own process:
   wall time and peak RSS.
2. Held-out perplexity on `--eval_text` (rows of `--seq_len`, the first `--max_batches`
   batches of `--batch_size`): the imported model, the fitted DiffEqFormer solved by
   split_euler at N = L, L/2, 2L, 4L, and the same weights under the parallel Euler
   field (dx/dt = A(x) + F(x), the paper's DiffEqFormer) at N = L and 2L.
3. Fine-tuning at N = L/2 from the fitted model on `--train_text` (LoRA and full, main.py
   with configs/finetune_imported.py): the evaluation before and after, and what it
   recovers of the gap to N = L.

Prints a markdown table and, last, `import_fit: ppl(N=L) / ppl(imported) = R`.
"""

import json
import os
import re
import resource
import subprocess
import sys
import time

from odetransformer.runtime import hugepages

if getattr(sys.modules["__main__"].__spec__, "name", "").startswith("benchmarks."):
  hugepages.reexec_with_huge_pages()

import numpy as np  # noqa: E402

from odetransformer import cli_flags, errors  # noqa: E402
from odetransformer.train import metrics as metrics_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("string", "from", None, "A model directory or .gguf file.", required=True)
  define("string", "eval_text", None, "Held-out text file.", required=True)
  define("string", "train_text", "", "Fine-tuning text ('' skips stage 3).")
  define("string", "workdir", None, "Where the workdirs and results go.", required=True)
  define("integer", "seq_len", 512, "Rows of the evaluation (and the fine-tuning).")
  define("integer", "batch_size", 8, "Evaluation rows per batch.")
  define("integer", "max_batches", 4, "Evaluation batches.")
  define("integer", "finetune_steps", 40, "Fine-tuning steps per method.")
  define("integer", "finetune_batch", 4, "Fine-tuning rows per step.")


def parse_args(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  args.source = getattr(args, "from")
  return args


class Results:
  """WORKDIR/results.json: stage name -> result, written after every stage."""

  def __init__(self, workdir):
    self.path = os.path.join(workdir, "results.json")
    self.data = json.load(open(self.path)) if os.path.isfile(self.path) else {}

  def stage(self, name, run):
    if name not in self.data:
      self.data[name] = run()
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(self.data, f, indent=1)
      os.replace(tmp, self.path)
      print(f"{name}: {self.data[name]}", flush=True)
    else:
      print(f"{name}: {self.data[name]} (kept from an earlier run)", flush=True)
    return self.data[name]


def _import(source, workdir, fit):
  cmd = [sys.executable, "-m", "odetransformer.import_checkpoint", f"--from={source}"]
  cmd += [f"--workdir={workdir}"] + (["--fit=diffeqformer"] if fit else [])
  t0 = time.time()
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"import failed: {out.stderr.strip().splitlines()[-1]}")
  peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # GiB
  info = json.load(open(os.path.join(workdir, "import.json")))
  result = {"seconds": round(time.time() - t0, 1), "peak_rss_gib_so_far": round(peak, 2)}
  result["parameters"] = info["parameters"]
  if fit:
    f = info["fit"]
    result.update(
      fit_seconds=f["seconds"],
      time_embed_dim=f["time_embed_dim"],
      sinusoids=f["sinusoids"],
      condition=round(f["condition"], 2),
      max_relative_error=max(f["relative_errors"].values()),
      relative_errors=f["relative_errors"],
    )
  return result


def _evaluate(workdir, args, n=None, parallel=False):
  from odetransformer.tools import evaluate, ode_fit
  from odetransformer.train import loading

  loaded = loading.load_model(workdir)
  model = ode_fit.parallel_field(loaded.model) if parallel else loaded.model
  data = evaluate.eval_data(
    workdir,
    loaded.config,
    data=f"local:{args.eval_text}",
    batch_size=args.batch_size,
    seq_len=args.seq_len,
    max_batches=args.max_batches,
  )
  r = evaluate.evaluate_model(model, data.batches(), n)
  return {
    "n": r.num_steps,
    "perplexity": round(float(r.perplexity), 3),
    "loss": round(float(r.loss), 5),
    "tokens": int(r.num_tokens),
    "seconds": round(float(r.seconds), 1),
  }


def _finetune(fit_dir, out, args, method, n):
  lr = {"lora": 1e-3, "full": 1e-4}[method]
  cmd = [
    sys.executable,
    "main.py",
    f"--config=configs/finetune_imported.py:{fit_dir}",
    f"--workdir={out}",
    f"--config.finetune.method={method}",
    f"--config.finetune.solver_steps={n}",
    f"--config.num_train_steps={args.finetune_steps}",
    f"--config.eval_every_steps={args.finetune_steps}",
    f"--config.checkpoint_every_steps={args.finetune_steps}",
    f"--config.seq_len={args.seq_len}",  # evaluated as the table is
    f"--config.global_batch_size={args.finetune_batch}",
    f"--config.eval_batch_size={args.batch_size}",
    f"--config.optim.learning_rate={lr}",
    "--config.data.source=local",
    f"--config.data.train_files={args.train_text}",
    f"--config.data.eval_files={args.eval_text}",
    f"--config.data.eval_max_batches={args.max_batches}",
  ]
  t0 = time.time()
  out_ = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if out_.returncode not in (0,):
    raise SystemExit(f"fine-tuning failed: {out_.stderr.strip().splitlines()[-1]}")
  losses = dict(metrics_lib.read_scalars(os.path.join(out, "tensorboard"))["eval/loss"])
  tok_s = re.findall(r"tok/s ([\d,]+)", out_.stderr)
  return {
    "method": method,
    "n": n,
    "steps": args.finetune_steps,
    "ppl_before": round(float(np.exp(losses[0])), 3),
    "ppl_after": round(float(np.exp(losses[max(losses)])), 3),
    "tokens_per_s": tok_s[-1] if tok_s else "",
    "seconds": round(time.time() - t0, 1),
  }


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.workdir, exist_ok=True)
  results = Results(args.workdir)
  base, fit = os.path.join(args.workdir, "imported"), os.path.join(args.workdir, "fitted")
  results.stage("import", lambda: _import(args.source, base, fit=False))
  results.stage("import_fit", lambda: _import(args.source, fit, fit=True))
  from odetransformer.train import loading

  depth = loading.load_run_config(base).model.depth
  results.stage("ppl_imported", lambda: _evaluate(base, args))
  ns = (depth, depth // 2, 2 * depth, 4 * depth)
  for n in ns:
    results.stage(f"ppl_split_N{n}", lambda n=n: _evaluate(fit, args, n))
  for n in (depth, 2 * depth):
    results.stage(f"ppl_parallel_N{n}", lambda n=n: _evaluate(fit, args, n, parallel=True))
  if args.train_text:
    half = depth // 2
    for method in ("lora", "full"):
      out = os.path.join(args.workdir, f"ft_{method}_N{half}")
      results.stage(
        f"finetune_{method}_N{half}", lambda m=method, o=out: _finetune(fit, o, args, m, half)
      )
  _report(results.data, depth, args)


def _report(d, depth, args):
  base = d["ppl_imported"]["perplexity"]
  print("\n| model | solver | N | perplexity | / imported | tokens | seconds |")
  print("|---|---|---|---|---|---|---|")
  print(
    f"| imported | {depth} layers | {depth} | {base:.2f} | 1.000 | "
    f"{d['ppl_imported']['tokens']} | {d['ppl_imported']['seconds']} |"
  )
  for key, value in d.items():
    m = re.fullmatch(r"ppl_(split|parallel)_N(\d+)", key)
    if m:
      solver = "split_euler" if m.group(1) == "split" else "euler (parallel field)"
      print(
        f"| fitted DiffEqFormer | {solver} | {m.group(2)} | {value['perplexity']:.2f} | "
        f"{value['perplexity'] / base:.3f} | {value['tokens']} | {value['seconds']} |"
      )
  for key, value in d.items():
    if key.startswith("finetune_"):
      print(
        f"fine-tune {value['method']} at N={value['n']}, {value['steps']} steps: perplexity "
        f"{value['ppl_before']:.2f} -> {value['ppl_after']:.2f} ({value['seconds']} s)"
      )
  ratio = d[f"ppl_split_N{depth}"]["perplexity"] / base
  print(f"import_fit: ppl(N=L) / ppl(imported) = {ratio:.4f}")


if __name__ == "__main__":
  errors.run_cli(main)
