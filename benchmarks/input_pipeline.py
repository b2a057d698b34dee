"""Input-pipeline throughput against the training step it has to feed.

    python benchmarks/input_pipeline.py

Delivers WikiText-2 (../shared/data/wikitext-2/valid.txt through the 'local' source,
SentencePiece vocab 8192, seq 256, batch 8) with 0 and 2 tokenizer worker processes
and reports tokens/s for each. Then times the bench-small DiffEqFormer train step
(vocab 8192, d 256, 4 heads, mlp 1024, 6 Euler steps, d_t 64, f32, AdamW) on the
pipeline's own batches, in the same run. The last line is the slower pipeline
setting's tokens/s divided by the train step's: how many times over the pipeline
can feed training (>> 1 means the pipeline is never the bottleneck).
"""
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from absl import flags  # pylint: disable=g-import-not-at-top

VOCAB, SEQ, BATCH = 8192, 256, 8
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"


def pipeline_tokens_per_s(cache_dir: str, worker_count: int, num_batches: int):
  """(tokens/s over `num_batches` after the first, batches for the train step)."""
  from input_pipeline import config as config_lib  # pylint: disable=g-import-not-at-top
  from input_pipeline import create_datasets  # pylint: disable=g-import-not-at-top
  cfg = config_lib.get_config()
  cfg.source = "local"
  cfg.train_files = str(DATA / "valid.txt")
  cfg.eval_files = str(DATA / "test.txt")
  cfg.vocab_size = VOCAB
  cfg.worker_count = worker_count
  cfg.cache_dir = cache_dir
  t0 = time.perf_counter()
  ds = create_datasets(cfg, seq_len=SEQ, global_batch_size=BATCH, eval_batch_size=BATCH,
                       seed=0, workdir=None, process_index=0, process_count=1)
  it = iter(ds.train)
  first = next(it)  # includes worker start-up
  t1 = time.perf_counter()
  batches = [first]
  for _ in range(num_batches):
    batches.append(next(it))
  t2 = time.perf_counter()
  it.close()
  tps = num_batches * BATCH * SEQ / (t2 - t1)
  print(f"pipeline workers={worker_count}: {tps:,.0f} tokens/s "
        f"({num_batches} batches of {BATCH}x{SEQ}; setup + first batch {t1 - t0:.2f} s)")
  return tps, batches[:4]


def train_tokens_per_s(batches, num_timed: int = 3) -> float:
  """Tokens/s of the bench-small DiffEqFormer AdamW step on the given batches."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from odetransformer.config import ModelConfig, default_model_config  # pylint: disable=g-import-not-at-top
  from odetransformer.losses import token_cross_entropy  # pylint: disable=g-import-not-at-top
  from odetransformer.model import create_model  # pylint: disable=g-import-not-at-top

  c = default_model_config()
  c.vocab_size, c.d_model, c.num_heads, c.mlp_dim = VOCAB, 256, 4, 1024
  c.num_steps, c.max_len, c.time_embed_dim = 6, SEQ, 64
  model = create_model(ModelConfig.from_config(c), seed=0)
  opt = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

  def loss_fn(m, batch):
    logits = m(batch["inputs"], segment_ids_bl=batch["segment_ids"],
               positions_bl=batch["positions"])
    loss_sum, weight_sum = token_cross_entropy(logits, batch["targets"], batch["weights"])
    return loss_sum / weight_sum

  @nnx.jit
  def step(m, o, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(m, batch)
    o.update(m, grads)
    return loss

  t0 = time.perf_counter()
  jax.block_until_ready(step(model, opt, batches[0]))  # compile
  t1 = time.perf_counter()
  for i in range(num_timed):
    loss = step(model, opt, batches[(i + 1) % len(batches)])
  jax.block_until_ready(loss)
  t2 = time.perf_counter()
  tps = num_timed * BATCH * SEQ / (t2 - t1)
  print(f"train step (bench-small DiffEqFormer, {jax.devices()[0].platform}): {tps:,.0f} "
        f"tokens/s ({(t2 - t1) / num_timed * 1e3:.0f} ms/step, first call {t1 - t0:.1f} s, "
        f"loss {float(loss):.3f})")
  return tps


def main():
  flags.FLAGS.mark_as_parsed()  # grain reads absl flags when it starts workers
  if not (DATA / "valid.txt").exists():
    sys.exit(f"{DATA / 'valid.txt'} is missing (needs ../shared/data beside the repo)")
  cache_dir = tempfile.mkdtemp(prefix="odet_bench_pipeline_")
  try:
    tps0, batches = pipeline_tokens_per_s(cache_dir, worker_count=0, num_batches=400)
    tps2, _ = pipeline_tokens_per_s(cache_dir, worker_count=2, num_batches=400)
  finally:
    shutil.rmtree(cache_dir, ignore_errors=True)
  train = train_tokens_per_s(batches)
  print(f"pipeline/train tokens/s ratio: {min(tps0, tps2) / train:.1f}")


if __name__ == "__main__":
  main()
