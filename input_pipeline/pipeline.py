"""The grain pipeline: documents -> tokens -> packed rows -> per-process batches.

Training (infinite, exactly resumable), per input shard s of `data.input_shards` (N)::

  documents (random access) --shuffle(seed; every epoch)--> repeat forever
    --> positions s, s+N, s+2N, ... --tokenize (+eos), in `worker_count` processes-->
    --ConcatThenSplit into seq_len+1 windows--> --window-shuffle rows-->
    batches of global_batch_size / N rows
  process p: its shards' batches side by side (shards p*N/P ... (p+1)*N/P - 1, P the
  process count) --> {'inputs', 'targets', 'segment_ids', 'positions', 'weights'}

Per-host input: a process reads and tokenizes only the documents of its own
shards, so its work is 1/P of the global batch's. The global batch is the shards'
rows in shard order, whatever the process count: a 1-process run with N shards sees
exactly the global batches an N-process run sees. N defaults to the process count
(one shard per process); set it explicitly to compare runs or to resume on another
process count.

Resume: each process's iterator state names its shards (`ShardedBatches`), and the
checkpoint keeps every process's state. With the same process count each process
restores its own; given every process's states (a run with another process count),
`restore_iterator_state` gives each shard the position it had, so the stream continues
exactly when N is kept. With another N (another stream) every shard starts at the
beginning of the epoch after the furthest one reached: the rest of that epoch is
skipped, no token is seen twice in an epoch, and a warning names the N to set to
continue exactly.

Tokenizing is the costly step and the only one in worker processes (`worker_count`
per shard; they exit when their parent does, `input_pipeline.workers`). Packing, row
shuffling and batching run after the workers, in this process, so the stream does not
depend on `worker_count` (grain's mp_prefetch interleaves the workers' strided slices
back into the original order).

Evaluation is bounded (`eval_max_batches`) and read whole by every process, which keeps
its rows `[p * local, (p + 1) * local)` of each eval batch, so every process yields the
same number of batches.

Preparation: process 0 prepares local text and trains the tokenizer while the others
wait, then they open the cache; jobs sharing a local cache take turns on its lock, and a
damaged cache or a full disk is one line (`input_pipeline.cache`). Caches, tokenizers and
text files go through `odetransformer.runtime.fileio`: a tokenizer may be read from or cached on
gs://; local text is prepared into a local cache only (a gs:// one is refused).

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
import itertools
import os
from typing import Any

from absl import flags
import grain
import jax
from jax._src import distributed as jax_distributed  # the coordination service's store
import ml_collections
import numpy as np
import sentencepiece as spm

from input_pipeline import sources as sources_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline import workers
from input_pipeline.errors import DataError
from input_pipeline.iterator_state import restore_iterator_state  # re-exported
from odetransformer.runtime import fileio

Batch = dict[str, np.ndarray]
_TOKENS = "tokens"
# Tokenized documents each worker process may have ready ahead of use: a batch takes
# many documents, so a deep buffer keeps the packer from waiting on one round trip.
_WORKER_BUFFER = 64
# The other processes wait this long for process 0 to prepare the data and tokenizer.
_PREPARE_WAIT_MS = 24 * 3600 * 1000
_PREPARATIONS = itertools.count()    # one key per create_datasets call (same on all)


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
    content_hash: Identifies the data's content: sha256 over the sha256s of the prepared
      files, recorded when this project prepared them (local text, `input_pipeline.prepare`);
      for TFDS data prepared elsewhere, its name, split and size.
  """
  train: grain.IterDataset
  eval_batches: Callable[[], Iterator[Batch]]
  tokenizer: spm.SentencePieceProcessor
  vocab_size: int
  tokenizer_path: str
  content_hash: str = ""


def _derive_seed(seed: int, stream: int, shard: int = 0) -> int:
  """Independent 32-bit seeds per stream and input shard (grain reseeds epochs as
  seed+epoch, so plain seed and seed+1 would give overlapping streams)."""
  entropy = [seed % 2**63, stream] + ([shard] if shard else [])
  return int(np.random.SeedSequence(entropy).generate_state(1)[0])


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


def to_model_batch(packed: dict[str, np.ndarray]) -> Batch:
  """Packed seq_len+1 windows -> the model batch (inputs/targets are w[:-1]/w[1:])."""
  tokens = packed[_TOKENS]
  segs = packed[f"{_TOKENS}_segment_ids"]
  positions = packed[f"{_TOKENS}_positions"]
  return {
      "inputs": tokens[:, :-1].astype(np.int32),
      "targets": tokens[:, 1:].astype(np.int32),
      "segment_ids": segs[:, :-1].astype(np.int32),
      "positions": positions[:, :-1].astype(np.int32),
      "weights": (segs[:, 1:] > 0).astype(np.float32),
  }


def tokenized_documents(source: Sequence, model_proto: bytes, *, text_key: str,
                        seed: int | None, num_epochs: int | None, worker_count: int,
                        shard: int = 0, num_shards: int = 1) -> grain.IterDataset:
  """Documents as {'tokens': int32[n+1]}: the documents in `source` order, or shuffled
  anew every epoch when `seed` is set; of that sequence, positions `shard::num_shards`
  (only these documents are ever read)."""
  ds = grain.MapDataset.source(source)
  if seed is not None:
    ds = ds.shuffle(seed=_derive_seed(seed, 0))
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  if num_shards > 1:
    ds = ds[shard::num_shards]
  ds = ds.map(Tokenize(model_proto, text_key))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))
  if worker_count > 0:
    if not flags.FLAGS.is_parsed():
      # grain reads its absl flags when it starts workers. A program that never
      # parsed flags (a notebook, a test) would fail there; take the defaults.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=worker_count, per_worker_buffer_size=_WORKER_BUFFER),
        worker_init_fn=workers.exit_with_parent(os.getpid()))
  return ds


def packed_rows(source: Sequence, model_proto: bytes, *, seq_len: int, text_key: str,
                seed: int, shuffle_buffer: int, worker_count: int,
                num_epochs: int | None = None, shard: int = 0,
                num_shards: int = 1) -> grain.IterDataset:
  """Training rows {'tokens', 'tokens_segment_ids', 'tokens_positions'}: int32[seq_len+1]
  of input shard `shard` (documents `shard::num_shards`)."""
  ds = tokenized_documents(source, model_proto, text_key=text_key, seed=seed,
                           num_epochs=num_epochs, worker_count=worker_count, shard=shard,
                           num_shards=num_shards)
  ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={_TOKENS: seq_len + 1})
  if shuffle_buffer > 1:
    ds = grain.experimental.WindowShuffleIterDataset(
        ds, window_size=shuffle_buffer, seed=_derive_seed(seed, 1, shard))
  return ds


class ShardedBatches(grain.IterDataset):
  """This process's batches: the rows of each of its input shards, concatenated.

  Each shard is an independent stream (its own documents, packing and row shuffle)
  batched to `global_batch_size / num_shards` rows; a process owning shards [a, b)
  stacks their batches in shard order. The iterator state names every shard, so the
  states of all processes together give each shard's position whatever the process
  count (`iterator_state.state_for_process`).
  """

  def __init__(self, shards: dict[int, grain.IterDataset], num_shards: int,
               num_documents: int):
    super().__init__(list(shards.values()))
    self.shard_ids = list(shards)
    self.num_shards = num_shards
    self.num_documents = num_documents

  def __iter__(self) -> grain.DatasetIterator:
    return _ShardedBatchesIterator(self)


class _ShardedBatchesIterator(grain.DatasetIterator):

  def __init__(self, ds: ShardedBatches):
    super().__init__([p.__iter__() for p in ds._parents])  # pylint: disable=protected-access
    self._ids = ds.shard_ids
    self._num_shards = ds.num_shards
    self._num_documents = ds.num_documents

  def __next__(self) -> Batch:
    parts = [next(it) for it in self._parents]
    if len(parts) == 1:
      return to_model_batch(parts[0])
    return to_model_batch({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})

  def get_state(self) -> dict[str, Any]:
    return {"num_shards": self._num_shards, "num_documents": self._num_documents,
            "shards": {str(i): it.get_state() for i, it in zip(self._ids, self._parents)}}

  def set_state(self, state: dict[str, Any]) -> None:
    for i, it in zip(self._ids, self._parents):
      it.set_state(state["shards"][str(i)])


def process_shards(num_shards: int, process_index: int, process_count: int) -> range:
  """The input shards process `process_index` reads: a contiguous block of them."""
  per = num_shards // process_count
  return range(process_index * per, (process_index + 1) * per)


def train_dataset(source: Sequence, model_proto: bytes, *, seq_len: int,
                  global_batch_size: int, process_index: int, process_count: int,
                  text_key: str, seed: int, shuffle_buffer: int, worker_count: int,
                  num_shards: int | None = None,
                  num_epochs: int | None = None) -> ShardedBatches:
  """Process-local training batches (infinite unless `num_epochs` is set, for tests).

  `num_shards` (default: `process_count`) input shards of `global_batch_size /
  num_shards` rows each; this process reads only its own shards' documents.
  """
  num_shards = num_shards or process_count
  rows = global_batch_size // num_shards
  shards = {}
  for s in process_shards(num_shards, process_index, process_count):
    shards[s] = packed_rows(
        source, model_proto, seq_len=seq_len, text_key=text_key, seed=seed,
        shuffle_buffer=shuffle_buffer, worker_count=worker_count, num_epochs=num_epochs,
        shard=s, num_shards=num_shards).batch(rows, drop_remainder=True)
  return ShardedBatches(shards, num_shards, len(source))


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
    raise DataError(f"{what}={global_size} must be a positive multiple of the process count "
                    f"({process_count}); fix: set it to a multiple of {process_count}")
  return global_size // process_count


def input_shards(data_cfg: ml_collections.ConfigDict, global_batch_size: int,
                 process_count: int) -> int:
  """`data.input_shards` (0: one per process), checked against the batch and processes."""
  n = data_cfg.get("input_shards", 0) or process_count
  if n < 0 or n % process_count:
    raise DataError(f"data.input_shards={n} must be a positive multiple of the process count "
                    f"({process_count}); fix: set it to a multiple of {process_count}, or 0 "
                    "for one shard per process")
  if global_batch_size % n:
    raise DataError(f"global_batch_size={global_batch_size} is not a multiple of "
                    f"data.input_shards={n}; fix: make the batch a multiple of the shard count")
  return n


def _open(data_cfg: ml_collections.ConfigDict, cache_dir: str, num_shards: int,
          first_shard: int, seed: int) -> tuple[sources_lib.Corpus, spm.SentencePieceProcessor, str]:
  """Opens the corpus and the tokenizer (preparing and training them if not cached)."""
  corpus = sources_lib.open_corpus(data_cfg, cache_dir)
  for split, src in (("training", corpus.train), (f"eval ({corpus.eval_split})", corpus.eval)):
    if len(src) == 0:
      raise DataError(f"source {corpus.name!r}: the {split} split is empty; "
                      "fix: point data.source / data.*_split / data.*_files at data with documents")
  if len(corpus.train) < num_shards:
    raise DataError(f"source {corpus.name!r} has {len(corpus.train)} training documents, fewer "
                    f"than data.input_shards={num_shards}; fix: use more data or fewer shards")
  # The first document this process reads (it reads no other process's).
  first = corpus.train[int(grain.MapDataset.range(len(corpus.train)).shuffle(
      seed=_derive_seed(seed, 0))[first_shard])]
  if data_cfg.text_key not in first:
    raise DataError(f"source {corpus.name!r} has no feature {data_cfg.text_key!r} "
                    f"(features: {sorted(first)}); fix: set data.text_key to one of them")
  sp, sp_path = tokenizer_lib.get_tokenizer(
      tokenizer_path=data_cfg.tokenizer_path, vocab_size=data_cfg.vocab_size,
      cache_dir=cache_dir, fingerprint=corpus.fingerprint, source=corpus.train,
      text_key=data_cfg.text_key, sample_bytes=data_cfg.tokenizer_sample_bytes)
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
    raise DataError("process 0 failed to prepare the data or tokenizer; fix: see its error "
                    "(the first process's log)")
  return prepare()


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
  num_shards = input_shards(data_cfg, global_batch_size, process_count)

  cache_dir = _resolve_cache_dir(data_cfg, workdir)
  first_shard = process_shards(num_shards, process_index, process_count)[0]
  corpus, sp, sp_path = _process_0_first(
      lambda: _open(data_cfg, cache_dir, num_shards, first_shard, seed))
  proto = sp.serialized_model_proto()

  train = train_dataset(
      corpus.train, proto, seq_len=seq_len, global_batch_size=global_batch_size,
      process_index=process_index, process_count=process_count, text_key=data_cfg.text_key,
      seed=seed, shuffle_buffer=data_cfg.shuffle_buffer, worker_count=data_cfg.worker_count,
      num_shards=num_shards)

  def eval_fn() -> Iterator[Batch]:
    return eval_batches(
        corpus.eval, proto, sp.eos_id(), seq_len=seq_len, global_batch_size=eval_batch_size,
        process_index=process_index, process_count=process_count,
        text_key=data_cfg.text_key, max_batches=data_cfg.eval_max_batches)

  return Datasets(train=train, eval_batches=eval_fn, tokenizer=sp,
                  vocab_size=sp.get_piece_size(), tokenizer_path=sp_path,
                  content_hash=corpus.content_hash)
