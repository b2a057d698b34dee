"""The grain pipeline: documents -> tokens -> packed rows -> per-process batches.

Training (infinite, exactly resumable)::

  documents (random access) --shuffle(seed, reshuffled every epoch)--> repeat forever
    --tokenize (+eos), in `worker_count` processes-->
    --ConcatThenSplit into seq_len+1 windows--> --window-shuffle rows--> global batch
    --> this process's rows --> {'inputs', 'targets', 'segment_ids', 'positions', 'weights'}

Tokenizing is the costly step and the only one in worker processes. Packing, row
shuffling and batching run after the workers, in this process, so the stream does
not depend on `worker_count` (grain's mp_prefetch interleaves the workers' strided
slices back into the original order). Every process builds the same global batch and
keeps rows `[process_index * local : (process_index + 1) * local]`: the data a step
sees does not depend on the number of hosts, and iterator states are identical on
all hosts (at the cost of every host tokenizing the whole global batch).

Batch convention (train and eval), all arrays [local_batch, seq_len]:
  inputs = w[:-1] and targets = w[1:] of a packed window w of seq_len+1 tokens;
  segment_ids, positions belong to the inputs: segment ids are 1, 2, ... for the
  documents in a row (0 = padding) and positions count from 0 at each document start.
  A document continued from the previous row restarts at position 0 (so positions
  stay below seq_len) and gets its own segment id. Attention must not cross
  segment ids. As in standard packed LM training, a target is scored even when it
  is the first token of the next document (predicted from the previous document's
  eos); weights are 0 only where the target is padding.

Evaluation: documents in their stored order, with one eos in front of the first (so
its first token is scored too), cut into windows that overlap by one token, so every
token of the split (each document plus its eos) is a target exactly once. The last
batch is padded (segment id 0, weight 0), never dropped.
"""
from collections.abc import Callable, Iterable, Iterator, Sequence
import dataclasses
import os
from typing import Any

from absl import flags
import grain
import jax
import ml_collections
import numpy as np
import sentencepiece as spm

from input_pipeline import sources as sources_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.errors import DataError
from input_pipeline.iterator_state import restore_iterator_state  # re-exported

Batch = dict[str, np.ndarray]
_TOKENS = "tokens"
# Tokenized documents each worker process may have ready ahead of use: a batch takes
# many documents, so a deep buffer keeps the packer from waiting on one round trip.
_WORKER_BUFFER = 64


@dataclasses.dataclass(frozen=True)
class Datasets:
  """What the training code gets from `create_datasets`.

  Attributes:
    train: Infinite dataset of process-local training batches (dicts of numpy arrays,
      see the module docstring). `iter(train)` gives a grain DatasetIterator whose
      `get_state()` is JSON-serialisable; restore it with `restore_iterator_state`.
    eval_batches: Each call starts a fresh, deterministic pass over the eval split,
      yielding process-local batches; every process yields the same number of batches.
    tokenizer: The SentencePiece processor (pad=0, unk=1, bos=2, eos=3).
    vocab_size: The tokenizer's vocabulary size.
    tokenizer_path: The .model file the tokenizer was loaded from.
  """
  train: grain.IterDataset
  eval_batches: Callable[[], Iterator[Batch]]
  tokenizer: spm.SentencePieceProcessor
  vocab_size: int
  tokenizer_path: str


def _derive_seed(seed: int, stream: int) -> int:
  """Independent 32-bit seeds per stream (grain reseeds epochs as seed+epoch, so plain
  seed and seed+1 would give overlapping streams)."""
  return int(np.random.SeedSequence([seed % 2**63, stream]).generate_state(1)[0])


class Tokenize(grain.transforms.Map):
  """{text_key: text} -> {'tokens': int32[n + 1]} (the document's ids, then eos).

  Holds the serialized model, not a path, so it pickles into workers on any host;
  the processor is built lazily once per process.
  """

  def __init__(self, model_proto: bytes, text_key: str):
    self._model_proto = model_proto
    self._text_key = text_key
    self._sp = None

  def __getstate__(self):
    return {"_model_proto": self._model_proto, "_text_key": self._text_key, "_sp": None}

  def map(self, element: dict[str, Any]) -> dict[str, np.ndarray]:
    if self._sp is None:
      self._sp = spm.SentencePieceProcessor(model_proto=self._model_proto)
    ids = self._sp.encode(tokenizer_lib.as_text(element[self._text_key]))
    ids.append(self._sp.eos_id())
    return {_TOKENS: np.asarray(ids, np.int32)}


class ToModelBatch(grain.transforms.Map):
  """A global batch of packed seq_len+1 windows -> this process's model batch."""

  def __init__(self, process_index: int, local_batch: int):
    self._start = process_index * local_batch
    self._stop = self._start + local_batch

  def map(self, packed: dict[str, np.ndarray]) -> Batch:
    sl = slice(self._start, self._stop)
    tokens = packed[_TOKENS][sl]
    segs = packed[f"{_TOKENS}_segment_ids"][sl]
    positions = packed[f"{_TOKENS}_positions"][sl]
    return {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "segment_ids": segs[:, :-1].astype(np.int32),
        "positions": positions[:, :-1].astype(np.int32),
        "weights": (segs[:, 1:] > 0).astype(np.float32),
    }


def tokenized_documents(source: Sequence, model_proto: bytes, *, text_key: str,
                        seed: int | None, num_epochs: int | None,
                        worker_count: int) -> grain.IterDataset:
  """Documents as {'tokens': int32[n+1]}, shuffled per epoch when `seed` is set."""
  ds = grain.MapDataset.source(source)
  if seed is not None:
    ds = ds.shuffle(seed=_derive_seed(seed, 0))
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  ds = ds.map(Tokenize(model_proto, text_key))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))
  if worker_count > 0:
    if not flags.FLAGS.is_parsed():
      # grain reads its absl flags when it starts workers. A program that never
      # parsed flags (a notebook, a test) would fail there; take the defaults.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=worker_count, per_worker_buffer_size=_WORKER_BUFFER))
  return ds


def packed_rows(source: Sequence, model_proto: bytes, *, seq_len: int, text_key: str,
                seed: int, shuffle_buffer: int, worker_count: int,
                num_epochs: int | None = None) -> grain.IterDataset:
  """Training rows {'tokens', 'tokens_segment_ids', 'tokens_positions'}: int32[seq_len+1]."""
  ds = tokenized_documents(source, model_proto, text_key=text_key, seed=seed,
                           num_epochs=num_epochs, worker_count=worker_count)
  ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={_TOKENS: seq_len + 1})
  if shuffle_buffer > 1:
    ds = grain.experimental.WindowShuffleIterDataset(
        ds, window_size=shuffle_buffer, seed=_derive_seed(seed, 1))
  return ds


def train_dataset(source: Sequence, model_proto: bytes, *, seq_len: int,
                  global_batch_size: int, process_index: int, process_count: int,
                  text_key: str, seed: int, shuffle_buffer: int, worker_count: int,
                  num_epochs: int | None = None) -> grain.IterDataset:
  """Process-local training batches (infinite unless `num_epochs` is set, for tests)."""
  local = global_batch_size // process_count
  ds = packed_rows(source, model_proto, seq_len=seq_len, text_key=text_key, seed=seed,
                   shuffle_buffer=shuffle_buffer, worker_count=worker_count,
                   num_epochs=num_epochs)
  ds = ds.batch(global_batch_size, drop_remainder=True)
  return ds.map(ToModelBatch(process_index, local))


def _eval_row(tokens: np.ndarray, docs: np.ndarray, seq_len: int) -> Batch:
  """One eval window (<= seq_len+1 tokens and each one's document index) -> a row.

  A short (last) window is padded with zeros to seq_len+1 first, so that, as in
  training, inputs = w[:-1] and targets = w[1:] of one window.
  """
  m = len(tokens)  # real tokens in the window; m - 1 of them are scored targets
  window = np.zeros(seq_len + 1, np.int32)
  window[:m] = tokens
  n_in = min(m, seq_len)  # real inputs
  d = docs[:n_in]
  starts = np.concatenate([[True], d[1:] != d[:-1]])
  segment_ids = np.zeros(seq_len, np.int32)
  segment_ids[:n_in] = np.cumsum(starts)
  positions = np.zeros(seq_len, np.int32)
  positions[:n_in] = np.arange(n_in) - np.maximum.accumulate(np.where(starts, np.arange(n_in), 0))
  weights = np.zeros(seq_len, np.float32)
  weights[:m - 1] = 1.0
  return {"inputs": window[:-1], "targets": window[1:], "segment_ids": segment_ids,
          "positions": positions, "weights": weights}


def eval_rows(documents: Iterable[np.ndarray], seq_len: int, eos_id: int) -> Iterator[Batch]:
  """Cuts the token stream [eos] + doc_0 + doc_1 + ... into rows scoring each token once."""
  tok_buf = [np.asarray([eos_id], np.int32)]
  doc_buf = [np.asarray([-1], np.int64)]
  buffered = 1
  for i, tokens in enumerate(documents):
    tok_buf.append(tokens)
    doc_buf.append(np.full(len(tokens), i, np.int64))
    buffered += len(tokens)
    if buffered < seq_len + 1:
      continue
    toks, docs = np.concatenate(tok_buf), np.concatenate(doc_buf)
    start = 0
    while len(toks) - start >= seq_len + 1:
      yield _eval_row(toks[start:start + seq_len + 1], docs[start:start + seq_len + 1], seq_len)
      start += seq_len  # the last token is the next window's first input
    tok_buf, doc_buf, buffered = [toks[start:]], [docs[start:]], len(toks) - start
  toks, docs = np.concatenate(tok_buf), np.concatenate(doc_buf)
  if len(toks) > 1:
    yield _eval_row(toks, docs, seq_len)


def eval_batches(source: Sequence, model_proto: bytes, eos_id: int, *, seq_len: int,
                 global_batch_size: int, process_index: int, process_count: int,
                 text_key: str, max_batches: int = 0) -> Iterator[Batch]:
  """One deterministic pass over `source`: process-local batches, the last one padded."""
  local = global_batch_size // process_count
  docs = tokenized_documents(source, model_proto, text_key=text_key, seed=None,
                             num_epochs=1, worker_count=0)
  rows: list[Batch] = []
  emitted = 0

  def make_batch() -> Batch:
    pad = {k: np.zeros_like(v) for k, v in rows[0].items()}
    full = rows + [pad] * (global_batch_size - len(rows))
    mine = full[process_index * local:(process_index + 1) * local]
    return {k: np.stack([r[k] for r in mine]) for k in rows[0]}

  for row in eval_rows((d[_TOKENS] for d in docs), seq_len, eos_id):
    rows.append(row)
    if len(rows) == global_batch_size:
      yield make_batch()
      rows, emitted = [], emitted + 1
      if max_batches and emitted >= max_batches:
        return
  if rows:
    yield make_batch()


def _resolve_cache_dir(data_cfg: ml_collections.ConfigDict, workdir: str | None) -> str:
  if data_cfg.cache_dir:
    return os.path.expanduser(data_cfg.cache_dir)
  if data_cfg.data_dir:
    return os.path.expanduser(data_cfg.data_dir)
  if workdir:
    return os.path.join(workdir, "data_cache")
  return os.path.join(os.path.expanduser("~"), ".cache", "odetransformer")


def _local_size(global_size: int, process_count: int, what: str) -> int:
  if global_size <= 0 or global_size % process_count:
    raise DataError(f"{what}={global_size} must be a positive multiple of the process count "
                    f"({process_count}); fix: set it to a multiple of {process_count}")
  return global_size // process_count


def create_datasets(data_cfg: ml_collections.ConfigDict, *, seq_len: int,
                    global_batch_size: int, eval_batch_size: int, seed: int,
                    workdir: str | None, process_index: int | None = None,
                    process_count: int | None = None) -> Datasets:
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
    raise DataError(f"process_index={process_index} is not in [0, {process_count}); "
                    "fix: pass 0 <= process_index < process_count (or neither)")
  if seq_len <= 0:
    raise DataError(f"seq_len={seq_len} must be positive; fix: set config.seq_len >= 1")
  _local_size(global_batch_size, process_count, "global_batch_size")
  _local_size(eval_batch_size, process_count, "eval_batch_size")
  if data_cfg.worker_count < 0:
    raise DataError(f"data.worker_count={data_cfg.worker_count} must be >= 0; "
                    "fix: 0 tokenizes in the training process, N > 0 in N worker processes")

  cache_dir = _resolve_cache_dir(data_cfg, workdir)
  corpus = sources_lib.open_corpus(data_cfg, cache_dir)
  for split, src in (("training", corpus.train), (f"eval ({corpus.eval_split})", corpus.eval)):
    if len(src) == 0:
      raise DataError(f"source {corpus.name!r}: the {split} split is empty; "
                      "fix: point data.source / data.*_split / data.*_files at data with documents")
  first = corpus.train[0]
  if data_cfg.text_key not in first:
    raise DataError(f"source {corpus.name!r} has no feature {data_cfg.text_key!r} "
                    f"(features: {sorted(first)}); fix: set data.text_key to one of them")
  sp, sp_path = tokenizer_lib.get_tokenizer(
      tokenizer_path=data_cfg.tokenizer_path, vocab_size=data_cfg.vocab_size,
      cache_dir=cache_dir, fingerprint=corpus.fingerprint, source=corpus.train,
      text_key=data_cfg.text_key, sample_bytes=data_cfg.tokenizer_sample_bytes)
  proto = sp.serialized_model_proto()

  train = train_dataset(
      corpus.train, proto, seq_len=seq_len, global_batch_size=global_batch_size,
      process_index=process_index, process_count=process_count, text_key=data_cfg.text_key,
      seed=seed, shuffle_buffer=data_cfg.shuffle_buffer, worker_count=data_cfg.worker_count)

  def eval_fn() -> Iterator[Batch]:
    return eval_batches(
        corpus.eval, proto, sp.eos_id(), seq_len=seq_len, global_batch_size=eval_batch_size,
        process_index=process_index, process_count=process_count,
        text_key=data_cfg.text_key, max_batches=data_cfg.eval_max_batches)

  return Datasets(train=train, eval_batches=eval_fn, tokenizer=sp,
                  vocab_size=sp.get_piece_size(), tokenizer_path=sp_path)
