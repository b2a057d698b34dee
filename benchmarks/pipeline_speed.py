"""Input-pipeline throughput against the training step it has to feed, and per-host work.

    python -m benchmarks.pipeline_speed --data_dir=DIR [--preset=bench-small] [--batches=400]

DIR holds WikiText-2's valid.txt and test.txt. Delivers valid.txt (through the 'local'
source, a SentencePiece vocabulary of the preset's size; bench-small: 8192, seq 256,
batch 8) with 0 and 2 tokenizer worker processes and reports tokens/s for each. Then times the
product's train step (`common.Trainer`: the step main.py runs, AdamW with clipping) of
the preset's DiffEqFormer on the pipeline's own batches, in the same run. The last line
is the slower pipeline setting's tokens/s divided by the train step's: how many times
over the pipeline can feed training (>> 1 means the pipeline is never the bottleneck).

Before that, per-host input: the CPU time (all threads) process 0 of P simulated
processes spends tokenizing and packing its share of `--batches` global batches of
`--scaling_batch` rows (P input shards, the default), for P = 1, 2, 4, and each P's
time as a fraction of P = 1's (1/P when each process does only its share).
"""

import os
import shutil
import statistics
import tempfile
import time

from absl import flags
import jax

from benchmarks import common  # huge pages as main.py
from input_pipeline import config as config_lib
from input_pipeline import create_datasets
from odetransformer import cli_flags, errors


def pipeline_tokens_per_s(
  data_dir: str,
  cache_dir: str,
  worker_count: int,
  num_batches: int,
  vocab: int,
  seq: int,
  batch: int,
):
  """(tokens/s over `num_batches` after the first, batches for the train step)."""
  cfg = _local_text_config(data_dir, cache_dir, vocab, worker_count)
  t0 = time.perf_counter()
  ds = create_datasets(
    cfg,
    seq_len=seq,
    global_batch_size=batch,
    eval_batch_size=batch,
    seed=0,
    workdir=None,
    process_index=0,
    process_count=1,
  )
  it = iter(ds.train)
  first = next(it)  # includes worker start-up
  t1 = time.perf_counter()
  batches = [first]
  for _ in range(num_batches):
    batches.append(next(it))
  t2 = time.perf_counter()
  it.close()
  tps = num_batches * batch * seq / (t2 - t1)
  print(
    f"pipeline workers={worker_count}: {tps:,.0f} tokens/s "
    f"({num_batches} batches of {batch}x{seq}; setup + first batch {t1 - t0:.2f} s)"
  )
  return tps, batches[:4]


def _local_text_config(data_dir: str, cache_dir: str, vocab: int, worker_count: int = 0):
  cfg = config_lib.get_config()
  cfg.source = "local"
  cfg.train_files = os.path.join(data_dir, "valid.txt")
  cfg.eval_files = os.path.join(data_dir, "test.txt")
  cfg.vocab_size = vocab
  cfg.worker_count = worker_count
  cfg.cache_dir = cache_dir
  return cfg


def per_process_work(
  data_dir: str,
  cache_dir: str,
  num_batches: int,
  vocab: int,
  seq: int,
  batch: int,
  processes=(1, 2, 4),
  rounds: int = 3,
) -> dict:
  """{P: CPU seconds process 0 of P spends on its share of `num_batches` global batches}
  (median of `rounds` rounds; the Ps alternate within a round, so that other work on the
  machine weighs on all alike)."""
  cfg = _local_text_config(data_dir, cache_dir, vocab)
  times = {p: [] for p in processes}
  for _ in range(rounds):
    for p in processes:
      ds = create_datasets(
        cfg,
        seq_len=seq,
        global_batch_size=batch,
        eval_batch_size=batch,
        seed=0,
        workdir=None,
        process_index=0,
        process_count=p,
      )
      it = iter(ds.train)
      for _ in range(max(1, num_batches // 4)):
        next(it)  # start-up and filling the read-ahead buffers: not counted
      t0 = time.process_time()
      for _ in range(num_batches):
        next(it)
      times[p].append(time.process_time() - t0)
      it.close()
  seconds = {p: statistics.median(t) for p, t in times.items()}
  base = seconds[processes[0]]
  print(
    f"per-process tokenize+pack CPU time for {num_batches} global batches of {batch}x{seq} "
    f"(process 0 of P, P input shards; median of {rounds}): "
    + ", ".join(f"P={p} {seconds[p]:.2f} s" for p in processes)
  )
  print(
    "per-process work relative to P=1 (ideal 1/P): "
    + "  ".join(f"P={p} {seconds[p] / base:.3f} (1/P={1 / p:.3f})" for p in processes)
  )
  return seconds


def train_tokens_per_s(args, batches, num_timed: int = 3) -> float:
  """Tokens/s of the preset's DiffEqFormer product train step on the given batches."""
  trainer = common.Trainer(common.model_config(args, "diffeqformer"))
  on_device = [jax.device_put(b, trainer.batch_sharding) for b in batches]
  b, length = on_device[0]["inputs"].shape
  t0 = time.perf_counter()
  common.block(trainer.step(on_device[0]))  # compile
  t1 = time.perf_counter()
  for i in range(num_timed):
    metrics = trainer.step(on_device[(i + 1) % len(on_device)])
  common.block(metrics)
  t2 = time.perf_counter()
  tps = num_timed * b * length / (t2 - t1)
  print(
    f"train step ({args.preset} DiffEqFormer, {jax.devices()[0].platform}): {tps:,.0f} "
    f"tokens/s ({(t2 - t1) / num_timed * 1e3:.0f} ms/step, first call {t1 - t0:.1f} s)"
  )
  return tps


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  common.define_common_flags(define)
  define("integer", "batches", 400, "timed pipeline batches")
  define("integer", "scaling_batch", 16, "global batch of the per-host section (a multiple of 4)")
  define("string", "data_dir", "", "directory with WikiText-2's valid.txt (delivered) and test.txt")


def main(argv=None):
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  for name in ("valid.txt", "test.txt"):
    if not os.path.isfile(os.path.join(args.data_dir, name)):
      raise errors.UserError(
        f"--data_dir={args.data_dir!r} holds no {name}; pass the directory "
        "with WikiText-2's valid.txt and test.txt"
      )
  batch, seq = common.shape(args)
  vocab = common.PRESETS[args.preset]["model"]["vocab_size"]
  flags.FLAGS.mark_as_parsed()  # grain reads absl flags when it starts workers
  cache_dir = tempfile.mkdtemp(prefix="odet_bench_pipeline_")
  try:
    per_process_work(args.data_dir, cache_dir, args.batches, vocab, seq, args.scaling_batch)
    tps0, batches = pipeline_tokens_per_s(
      args.data_dir, cache_dir, 0, args.batches, vocab, seq, batch
    )
    tps2, _ = pipeline_tokens_per_s(args.data_dir, cache_dir, 2, args.batches, vocab, seq, batch)
  finally:
    shutil.rmtree(cache_dir, ignore_errors=True)
  train = train_tokens_per_s(args, batches)
  print(f"pipeline/train tokens/s ratio: {min(tps0, tps2) / train:.1f}")


if __name__ == "__main__":
  errors.run_cli(main)
