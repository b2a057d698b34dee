"""The datasets a run gets: `create_datasets(config.data, ...)`.

documents -> tokens -> packed rows -> per-process batches: `create_datasets` checks the
settings, opens the corpus and the tokenizer (preparing and training them when not
cached), and builds the training stream (`input_pipeline.packing`: shuffling, input
shards, packing, per-host input, resume; the batch convention) and the eval pass
(`input_pipeline.evaluation`).

Preparation: process 0 prepares local text and trains the tokenizer while the others
wait, then they open the cache; jobs sharing a local cache take turns on its lock, and a
damaged cache or a full disk is one line (`input_pipeline.cache`). Caches, tokenizers and
text files go through `odetransformer.runtime.fileio`: a tokenizer may be read from or cached on
gs://; local text is prepared into a local cache only (a gs:// one is refused).
"""

from collections.abc import Callable, Iterator
import dataclasses
import itertools
import os
from typing import Any

import grain
import jax
from jax._src import distributed as jax_distributed  # the coordination service's store
import ml_collections

from input_pipeline import sources as sources_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.errors import DataError

# Re-exported: input_pipeline/__init__.py, benchmarks/ and tests use them as pipeline.NAME.
from input_pipeline.evaluation import (
  eval_batches,
  eval_rows,  # noqa: F401
)
from input_pipeline.iterator_state import restore_iterator_state  # noqa: F401
from input_pipeline.packing import (  # noqa: F401
  Batch,
  derive_seed,
  packed_rows,
  process_shards,
  to_model_batch,
  tokenized_documents,
  train_dataset,
)
from odetransformer.runtime import fileio

# The other processes wait this long for process 0 to prepare the data and tokenizer.
_PREPARE_WAIT_MS = 24 * 3600 * 1000
_PREPARATIONS = itertools.count()  # one key per create_datasets call (same on all)


@dataclasses.dataclass(frozen=True)
class Datasets:
  """What the training code gets from `create_datasets`.

  Attributes:
    train: Infinite dataset of process-local training batches (dicts of numpy arrays,
      the batch convention of `input_pipeline.packing`). `iter(train)` gives a grain
      DatasetIterator whose `get_state()` is JSON-serialisable; restore it with
      `restore_iterator_state`.
    eval_batches: Each call starts a fresh, deterministic pass over the eval split,
      yielding process-local batches; every process yields the same number of batches.
    tokenizer: The SentencePiece processor (pad=0, unk=1, bos=2, eos=3).
    vocab_size: The tokenizer's vocabulary size.
    tokenizer_path: The .model file the tokenizer was loaded from.
    content_hash: Identifies the data's content: sha256 over the sha256s of the prepared
      files, recorded when this project prepared them (local text, `input_pipeline.prepare`);
      for TFDS data prepared elsewhere, its name, split and size.
  """

  train: grain.IterDataset
  eval_batches: Callable[[], Iterator[Batch]]
  tokenizer: tokenizer_lib.Tokenizer
  vocab_size: int
  tokenizer_path: str
  content_hash: str = ""


def _resolve_cache_dir(data_cfg: ml_collections.ConfigDict, workdir: str | None) -> str:
  """data.cache_dir, else data.data_dir, else <workdir>/data_cache on a local workdir,
  else ~/.cache/odetransformer (a gs:// workdir: local text is prepared on local disk)."""
  local = lambda p: os.path.expanduser(p) if fileio.is_local(p) else p
  if data_cfg.cache_dir:
    return local(data_cfg.cache_dir)
  if data_cfg.data_dir:
    return local(data_cfg.data_dir)
  if workdir and fileio.is_local(workdir):
    return fileio.join(workdir, "data_cache")
  return os.path.join(os.path.expanduser("~"), ".cache", "odetransformer")


def _local_size(global_size: int, process_count: int, what: str) -> int:
  if global_size <= 0 or global_size % process_count:
    raise DataError(
      f"{what}={global_size} must be a positive multiple of the process count "
      f"({process_count}); fix: set it to a multiple of {process_count}"
    )
  return global_size // process_count


def input_shards(
  data_cfg: ml_collections.ConfigDict, global_batch_size: int, process_count: int
) -> int:
  """`data.input_shards` (0: one per process), checked against the batch and processes."""
  n = int(data_cfg.input_shards) or process_count
  if n < 0 or n % process_count:
    raise DataError(
      f"data.input_shards={n} must be a positive multiple of the process count "
      f"({process_count}); fix: set it to a multiple of {process_count}, or 0 "
      "for one shard per process"
    )
  if global_batch_size % n:
    raise DataError(
      f"global_batch_size={global_batch_size} is not a multiple of "
      f"data.input_shards={n}; fix: make the batch a multiple of the shard count"
    )
  return n


def _open(
  data_cfg: ml_collections.ConfigDict, cache_dir: str, num_shards: int, first_shard: int, seed: int
) -> tuple[sources_lib.Corpus, tokenizer_lib.Tokenizer, str]:
  """Opens the corpus and the tokenizer (preparing and training them if not cached)."""
  corpus = sources_lib.open_corpus(data_cfg, cache_dir)
  for split, src in (("training", corpus.train), (f"eval ({corpus.eval_split})", corpus.eval)):
    if len(src) == 0:
      raise DataError(
        f"source {corpus.name!r}: the {split} split is empty; "
        "fix: point data.source / data.*_split / data.*_files at data with documents"
      )
  if len(corpus.train) < num_shards:
    raise DataError(
      f"source {corpus.name!r} has {len(corpus.train)} training documents, fewer "
      f"than data.input_shards={num_shards}; fix: use more data or fewer shards"
    )
  # The first document this process reads (it reads no other process's).
  first = corpus.train[
    int(grain.MapDataset.range(len(corpus.train)).shuffle(seed=derive_seed(seed, 0))[first_shard])
  ]
  if data_cfg.text_key not in first:
    raise DataError(
      f"source {corpus.name!r} has no feature {data_cfg.text_key!r} "
      f"(features: {sorted(first)}); fix: set data.text_key to one of them"
    )
  sp, sp_path = tokenizer_lib.get_tokenizer(
    tokenizer_path=data_cfg.tokenizer_path,
    vocab_size=data_cfg.vocab_size,
    cache_dir=cache_dir,
    fingerprint=corpus.fingerprint,
    source=corpus.train,
    text_key=data_cfg.text_key,
    sample_bytes=data_cfg.tokenizer_sample_bytes,
  )
  return corpus, sp, sp_path


def _process_0_first(prepare: Callable[[], Any]) -> Any:
  """Runs `prepare` on process 0 and, once it has succeeded, on the other processes.

  Process 0 alone prepares the data and trains the tokenizer; the others wait for it
  (on the key-value store of jax.distributed's coordination service, as orbax does; no
  device computation) and then find them in the (shared) cache. A cache on host-local
  disks is prepared once per host. A failure on process 0 stops the others with one line.
  """
  if jax.process_count() == 1:
    return prepare()
  client = jax_distributed.global_state.client
  key = f"odetransformer/input_prepared/{next(_PREPARATIONS)}"
  if jax.process_index() == 0:
    ok = False
    try:
      result = prepare()
      ok = True
    finally:
      client.key_value_set(key, "ok" if ok else "failed")
    return result
  if client.blocking_key_value_get(key, _PREPARE_WAIT_MS) != "ok":
    raise DataError(
      "process 0 failed to prepare the data or tokenizer; fix: see its error "
      "(the first process's log)"
    )
  return prepare()


def create_datasets(
  data_cfg: ml_collections.ConfigDict,
  *,
  seq_len: int,
  global_batch_size: int,
  eval_batch_size: int,
  seed: int,
  workdir: str | None,
  process_index: int | None = None,
  process_count: int | None = None,
) -> Datasets:
  """Builds the training stream, the eval pass and the tokenizer for `config.data`.

  Args:
    data_cfg: `config.data` (defaults and field meanings: `input_pipeline/config.py`).
    seq_len: Tokens per row fed to the model.
    global_batch_size: Training rows per step over all processes.
    eval_batch_size: Eval rows per batch over all processes.
    seed: Shuffling seed (documents per epoch, and packed rows).
    workdir: The run's directory; caches go to `<workdir>/data_cache` unless
      `data.cache_dir` or `data.data_dir` is set.
    process_index: This process (default `jax.process_index()`).
    process_count: Number of processes (default `jax.process_count()`).

  Returns:
    A `Datasets`.

  Raises:
    DataError: bad configuration or input (one line: the problem and the fix).
  """
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise DataError(
      f"process_index={process_index} is not in [0, {process_count}); "
      "fix: pass 0 <= process_index < process_count (or neither)"
    )
  if seq_len <= 0:
    raise DataError(f"seq_len={seq_len} must be positive; fix: set config.seq_len >= 1")
  _local_size(global_batch_size, process_count, "global_batch_size")
  _local_size(eval_batch_size, process_count, "eval_batch_size")
  if data_cfg.worker_count < 0:
    raise DataError(
      f"data.worker_count={data_cfg.worker_count} must be >= 0; "
      "fix: 0 tokenizes in the training process, N > 0 in N worker processes"
    )
  num_shards = input_shards(data_cfg, global_batch_size, process_count)

  cache_dir = _resolve_cache_dir(data_cfg, workdir)
  first_shard = process_shards(num_shards, process_index, process_count)[0]
  corpus, sp, sp_path = _process_0_first(
    lambda: _open(data_cfg, cache_dir, num_shards, first_shard, seed)
  )
  proto = sp.serialized_model_proto()

  train = train_dataset(
    corpus.train,
    proto,
    seq_len=seq_len,
    global_batch_size=global_batch_size,
    process_index=process_index,
    process_count=process_count,
    text_key=data_cfg.text_key,
    seed=seed,
    shuffle_buffer=data_cfg.shuffle_buffer,
    worker_count=data_cfg.worker_count,
    num_shards=num_shards,
  )

  def eval_fn() -> Iterator[Batch]:
    return eval_batches(
      corpus.eval,
      proto,
      sp.eos_id(),
      seq_len=seq_len,
      global_batch_size=eval_batch_size,
      process_index=process_index,
      process_count=process_count,
      text_key=data_cfg.text_key,
      max_batches=data_cfg.eval_max_batches,
    )

  return Datasets(
    train=train,
    eval_batches=eval_fn,
    tokenizer=sp,
    vocab_size=sp.get_piece_size(),
    tokenizer_path=sp_path,
    content_hash=corpus.content_hash,
  )
