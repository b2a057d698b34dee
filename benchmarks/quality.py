"""Quality: DiffEqFormer vs GPT at the same width, depth, tokens and schedule.

Both models train on WikiText-2 validation (../shared/data/wikitext-2/valid.txt) with
the same SentencePiece tokenizer, data order, batch, steps and AdamW schedule, and are
evaluated on every token of WikiText-2 test. The last line is the key ratio:

  diffeqformer/gpt test perplexity ratio: X        (< 1: DiffEqFormer is better)

  python benchmarks/quality.py                      # ~10 min on a 2-core CPU
  python benchmarks/quality.py --steps=20 --eval_batches=2   # smoke run, ~2 min

Defaults (d 256, 4 heads, 6 steps/layers, seq 128, batch 16, 600 steps, vocab 4096,
d_t 64, lr 1e-3, β2 0.95) are sized to fit the 20-minute budget on the reference CPU;
DESIGN.md §8 quotes a prototype at seq 256 / 500 steps / vocab 8192 (GPT 133.5,
naive DiffEqFormer 145.6), which takes about twice as long here.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import logging  # pylint: disable=g-import-not-at-top

from configs import default  # pylint: disable=g-import-not-at-top
from odetransformer import train  # pylint: disable=g-import-not-at-top

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                    "shared", "data", "wikitext-2")


def make_config(args, kind: str, cache_dir: str):
  c = default.get_config()
  c.model.kind = kind
  c.model.d_model = args.d_model
  c.model.num_heads = args.num_heads
  c.model.mlp_dim = 4 * args.d_model
  c.model.num_steps = args.num_steps
  c.model.max_len = args.seq_len
  c.model.time_embed_dim = args.time_embed_dim
  c.model.time_sinusoids = 32
  c.seq_len = args.seq_len
  c.global_batch_size = args.batch
  c.eval_batch_size = args.batch
  c.num_train_steps = args.steps
  c.log_every_steps = max(1, args.steps // 10)
  c.eval_every_steps = 0                      # only at the end
  c.checkpoint_every_steps = 0                # only at the end
  c.optim.learning_rate = args.lr
  c.optim.b2 = args.b2
  c.data.source = "local"
  c.data.train_files = os.path.join(args.data, "valid.txt")
  c.data.eval_files = os.path.join(args.data, "test.txt")
  c.data.vocab_size = args.vocab
  c.data.eval_max_batches = args.eval_batches
  c.data.cache_dir = cache_dir                # one tokenizer for both models
  return c


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--num_steps", type=int, default=6, help="ODE steps = GPT layers")
  p.add_argument("--time_embed_dim", type=int, default=64)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--b2", type=float, default=0.95)
  p.add_argument("--eval_batches", type=int, default=0, help="0 = all of test.txt")
  p.add_argument("--data", default=DATA)
  p.add_argument("--workdir", default="", help="default: a fresh temporary directory")
  args = p.parse_args()
  for split in ("valid.txt", "test.txt"):
    if not os.path.exists(os.path.join(args.data, split)):
      sys.exit(f"error: {os.path.join(args.data, split)} not found (see ../shared/data)")
  logging.set_verbosity(logging.WARNING)

  root = args.workdir or tempfile.mkdtemp(prefix="odet_quality_")
  results = {}
  for kind in ("diffeqformer", "gpt"):
    workdir = os.path.join(root, kind)
    if os.path.exists(os.path.join(workdir, "checkpoints")):
      sys.exit(f"error: {workdir} already holds a run; pass a fresh --workdir")
    t = time.perf_counter()
    r = train.train_and_evaluate(make_config(args, kind, os.path.join(root, "cache")), workdir)
    results[kind] = r
    hist = r["loss_history"]
    print(f"{kind:13s} params {r['num_params']:>12,} | train loss {hist[0][1]:.3f} -> "
          f"{hist[-1][1]:.3f} | test loss {r['eval']['loss']:.4f} | test ppl "
          f"{r['eval']['perplexity']:.2f} | test tokens {int(r['eval']['num_tokens']):,} | "
          f"{time.perf_counter() - t:.0f}s", flush=True)
  ratio = results["diffeqformer"]["eval"]["perplexity"] / results["gpt"]["eval"]["perplexity"]
  print(f"diffeqformer/gpt test perplexity ratio: {ratio:.3f}")


if __name__ == "__main__":
  main()
