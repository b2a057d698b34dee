"""Adaptive fine-tuning (paper Fig. 5) at CPU scale.

Pre-trains a small DiffEqFormer (K = 6 Euler steps) and a GPT of the same width and
depth on WikiText-2 validation (../shared/data), then fine-tunes each on Tiny
Shakespeare (first 90% train, last 10% validation) with every method at N ∈ {3, 4, 6, 8}
(K/2, 2K/3, K, 4K/3) steps; the GPT fine-tunes at its own depth (full and LoRA).
Writes `adaptive_finetune.md` (validation perplexity, method × N, GPT row) and
`adaptive_finetune.png` to --out, and prints the table; last line:

  best diffeqformer/gpt fine-tuned perplexity ratio: X      (< 1: DiffEqFormer better)

  python benchmarks/adaptive_finetune.py --out=/tmp/adaptive      # ~20-25 min, 2-core CPU
  python benchmarks/adaptive_finetune.py --pretrain_steps=10 --finetune_steps=5 --steps=3,6
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ml_collections  # noqa: E402
from absl import logging  # noqa: E402

from configs import default  # noqa: E402
from odetransformer import train  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared", "data")
METHODS = ("continuous", "full", "lora")


def base_config(args, cache_dir):
  c = default.get_config()
  c.model.d_model, c.model.num_heads, c.model.mlp_dim = args.d_model, 4, 4 * args.d_model
  c.model.num_steps = args.k
  c.model.max_len = c.seq_len = args.seq_len
  c.global_batch_size = c.eval_batch_size = args.batch
  c.log_every_steps = 50
  c.eval_every_steps = 0
  c.checkpoint_every_steps = 0
  c.optim.learning_rate = args.lr
  c.data.source = "local"
  c.data.vocab_size = args.vocab
  c.data.eval_max_batches = args.eval_batches
  c.data.cache_dir = cache_dir
  return c


def pretrain(args, kind, workdir, cache_dir):
  c = base_config(args, cache_dir)
  c.model.kind = kind
  c.num_train_steps = args.pretrain_steps
  c.data.train_files = os.path.join(SHARED, "wikitext-2", "valid.txt")
  c.data.eval_files = os.path.join(SHARED, "wikitext-2", "test.txt")
  return train.train_and_evaluate(c, workdir)


def finetune(args, init_from, method, n, workdir, cache_dir, files):
  c = base_config(args, cache_dir)
  c.init_from = init_from
  c.finetune = ml_collections.ConfigDict(dict(
      method=method, num_steps=n, lora_rank=8, lora_alpha=16.0,
      targets="wq,wk,wv,wo,w1,w2", train_embeddings=False))
  c.num_train_steps = args.finetune_steps
  # Adapters start at B = 0 and are few: LoRA conventionally takes a ~10x higher rate.
  c.optim.learning_rate = args.lora_lr if method == "lora" else args.finetune_lr
  c.data.train_files, c.data.eval_files = files
  return train.train_and_evaluate(c, workdir)["eval"]["perplexity"]


def split_shakespeare(directory):
  with open(os.path.join(SHARED, "tinyshakespeare", "input.txt")) as f:
    text = f.read()
  cut = text.rfind("\n\n", 0, int(0.9 * len(text)))
  paths = (os.path.join(directory, "shakespeare_train.txt"),
           os.path.join(directory, "shakespeare_valid.txt"))
  for path, part in zip(paths, (text[:cut], text[cut:])):
    with open(path, "w") as f:
      f.write(part)
  return paths


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="/tmp/odet_adaptive_finetune")
  parser.add_argument("--k", type=int, default=6, help="pre-training steps/layers")
  parser.add_argument("--steps", default="3,4,6,8", help="fine-tuning N values")
  parser.add_argument("--d_model", type=int, default=128)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--vocab", type=int, default=2048)
  parser.add_argument("--pretrain_steps", type=int, default=400)
  parser.add_argument("--finetune_steps", type=int, default=100)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--finetune_lr", type=float, default=5e-4)
  parser.add_argument("--lora_lr", type=float, default=5e-3)
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="fine-tuning methods to run (the GPT runs the discrete ones)")
  parser.add_argument("--eval_batches", type=int, default=8)
  args = parser.parse_args()
  logging.set_verbosity(logging.WARNING)
  os.makedirs(args.out, exist_ok=True)
  ns = [int(n) for n in args.steps.split(",")]
  work = tempfile.mkdtemp(prefix="adaptive_", dir=args.out)
  cache = os.path.join(work, "cache")
  files = split_shakespeare(work)

  pre = {}
  for kind in ("diffeqformer", "gpt"):
    wd = os.path.join(work, f"pre_{kind}")
    ppl = pretrain(args, kind, wd, cache)["eval"]["perplexity"]
    pre[kind] = wd
    print(f"pre-trained {kind}: WikiText-2 test perplexity {ppl:.1f}", flush=True)

  methods = [m for m in METHODS if m in args.methods.split(",")]
  table = {}
  for method in methods:
    for n in ns:
      wd = os.path.join(work, f"ft_{method}_{n}")
      table[method, n] = finetune(args, pre["diffeqformer"], method, n, wd, cache, files)
      print(f"diffeqformer {method:10s} N={n:2d}: {table[method, n]:8.2f}", flush=True)
  gpt = {}
  for method in [m for m in ("full", "lora") if m in methods]:
    wd = os.path.join(work, f"ft_gpt_{method}")
    gpt[method] = finetune(args, pre["gpt"], method, 0, wd, cache, files)
    print(f"gpt          {method:10s} L={args.k:2d}: {gpt[method]:8.2f}", flush=True)

  header = "| model / method | " + " | ".join(f"N={n}" for n in ns) + " |"
  lines = ["Tiny Shakespeare validation perplexity after fine-tuning "
           f"({args.finetune_steps} steps; pre-trained {args.pretrain_steps} steps on "
           f"WikiText-2, K = L = {args.k})", "", header,
           "|" + "---|" * (len(ns) + 1)]
  for method in methods:
    lines.append(f"| DiffEqFormer {method} | " +
                 " | ".join(f"{table[method, n]:.2f}" for n in ns) + " |")
  for method, value in gpt.items():
    lines.append(f"| GPT ({args.k} layers) {method} | " + " | ".join(
        f"{value:.2f}" if n == args.k else "–" for n in ns) + " |")
  text = "\n".join(lines)
  with open(os.path.join(args.out, "adaptive_finetune.md"), "w") as f:
    f.write(text + "\n")
  print(text)

  fig, ax = plt.subplots(figsize=(6, 4))
  for method in methods:
    ax.plot(ns, [table[method, n] for n in ns], marker="o", label=f"DiffEqFormer {method}")
  for method, value in gpt.items():
    ax.axhline(value, linestyle="--", color="gray" if method == "full" else "black",
               label=f"GPT {method} ({args.k} layers)")
  ax.set_xlabel("fine-tuning steps N")
  ax.set_ylabel("validation perplexity (log scale)")
  ax.set_yscale("log")
  ax.set_title("Adaptive fine-tuning on Tiny Shakespeare")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "adaptive_finetune.png"), dpi=120)
  if gpt:
    ratio = min(table.values()) / min(gpt.values())
    print(f"best diffeqformer/gpt fine-tuned perplexity ratio: {ratio:.3f}")


if __name__ == "__main__":
  main()
