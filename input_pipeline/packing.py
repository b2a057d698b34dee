"""The training stream: documents -> tokens -> packed rows -> this process's batches.

Per input shard s of `data.input_shards` (N)::

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
continue exactly (`input_pipeline.iterator_state`).

Tokenizing is the costly step and the only one in worker processes (`worker_count`
per shard; they exit when their parent does, `input_pipeline.workers`). Packing, row
shuffling and batching run after the workers, in this process, so the stream does not
depend on `worker_count` (grain's mp_prefetch interleaves the workers' strided slices
back into the original order).

Batch convention (train and eval, `input_pipeline.evaluation`), all arrays
[local_batch, seq_len]:
  inputs = w[:-1] and targets = w[1:] of a packed window w of seq_len+1 tokens;
  segment_ids, positions belong to the inputs: segment ids are 1, 2, ... for the
  documents in a row (0 = padding) and positions count from 0 at each document start.
  A document continued from the previous row restarts at position 0 (so positions
  stay below seq_len) and gets its own segment id. Attention must not cross
  segment ids. As in standard packed LM training, a target is scored even when it
  is the first token of the next document (predicted from the previous document's
  eos); weights are 0 only where the target is padding.
"""

from collections.abc import Sequence
import os
from typing import Any

from absl import flags
import grain
import numpy as np

from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline import workers

Batch = dict[str, np.ndarray]
TOKENS = "tokens"  # a tokenized document's feature (packing adds _segment_ids, _positions)
# Tokenized documents each worker process may have ready ahead of use: a batch takes
# many documents, so a deep buffer keeps the packer from waiting on one round trip.
_WORKER_BUFFER = 64


def derive_seed(seed: int, stream: int, shard: int = 0) -> int:
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
      self._sp = tokenizer_lib.from_bytes(self._model_proto)
    ids = self._sp.encode(tokenizer_lib.as_text(element[self._text_key]))
    ids.append(self._sp.eos_id())
    return {TOKENS: np.asarray(ids, np.int32)}


def to_model_batch(packed: dict[str, np.ndarray]) -> Batch:
  """Packed seq_len+1 windows -> the model batch (inputs/targets are w[:-1]/w[1:])."""
  tokens = packed[TOKENS]
  segs = packed[f"{TOKENS}_segment_ids"]
  positions = packed[f"{TOKENS}_positions"]
  return {
    "inputs": tokens[:, :-1].astype(np.int32),
    "targets": tokens[:, 1:].astype(np.int32),
    "segment_ids": segs[:, :-1].astype(np.int32),
    "positions": positions[:, :-1].astype(np.int32),
    "weights": (segs[:, 1:] > 0).astype(np.float32),
  }


def tokenized_documents(
  source: Sequence,
  model_proto: bytes,
  *,
  text_key: str,
  seed: int | None,
  num_epochs: int | None,
  worker_count: int,
  shard: int = 0,
  num_shards: int = 1,
) -> grain.IterDataset:
  """Documents as {'tokens': int32[n+1]}: the documents in `source` order, or shuffled
  anew every epoch when `seed` is set; of that sequence, positions `shard::num_shards`
  (only these documents are ever read)."""
  ds = grain.MapDataset.source(source)
  if seed is not None:
    ds = ds.shuffle(seed=derive_seed(seed, 0))
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
    ds = ds.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=worker_count, per_worker_buffer_size=_WORKER_BUFFER),
      worker_init_fn=workers.exit_with_parent(os.getpid()),
    )
  return ds


def packed_rows(
  source: Sequence,
  model_proto: bytes,
  *,
  seq_len: int,
  text_key: str,
  seed: int,
  shuffle_buffer: int,
  worker_count: int,
  num_epochs: int | None = None,
  shard: int = 0,
  num_shards: int = 1,
) -> grain.IterDataset:
  """Training rows {'tokens', 'tokens_segment_ids', 'tokens_positions'}: int32[seq_len+1]
  of input shard `shard` (documents `shard::num_shards`)."""
  ds = tokenized_documents(
    source,
    model_proto,
    text_key=text_key,
    seed=seed,
    num_epochs=num_epochs,
    worker_count=worker_count,
    shard=shard,
    num_shards=num_shards,
  )
  ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={TOKENS: seq_len + 1})
  if shuffle_buffer > 1:
    ds = grain.experimental.WindowShuffleIterDataset(
      ds, window_size=shuffle_buffer, seed=derive_seed(seed, 1, shard)
    )
  return ds


class ShardedBatches(grain.IterDataset):
  """This process's batches: the rows of each of its input shards, concatenated.

  Each shard is an independent stream (its own documents, packing and row shuffle)
  batched to `global_batch_size / num_shards` rows; a process owning shards [a, b)
  stacks their batches in shard order. The iterator state names every shard, so the
  states of all processes together give each shard's position whatever the process
  count (`iterator_state.state_for_process`).
  """

  def __init__(self, shards: dict[int, grain.IterDataset], num_shards: int, num_documents: int):
    super().__init__(list(shards.values()))
    self.shard_ids = list(shards)
    self.num_shards = num_shards
    self.num_documents = num_documents

  def __iter__(self) -> grain.DatasetIterator:
    return _ShardedBatchesIterator(self)


class _ShardedBatchesIterator(grain.DatasetIterator):
  def __init__(self, ds: ShardedBatches):
    super().__init__([p.__iter__() for p in ds._parents])
    self._ids = ds.shard_ids
    self._num_shards = ds.num_shards
    self._num_documents = ds.num_documents

  def __next__(self) -> Batch:
    parts = [next(it) for it in self._parents]
    if len(parts) == 1:
      return to_model_batch(parts[0])
    return to_model_batch({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})

  def get_state(self) -> dict[str, Any]:
    return {
      "num_shards": self._num_shards,
      "num_documents": self._num_documents,
      "shards": {str(i): it.get_state() for i, it in zip(self._ids, self._parents)},
    }

  def set_state(self, state: dict[str, Any]) -> None:
    for i, it in zip(self._ids, self._parents):
      it.set_state(state["shards"][str(i)])


def process_shards(num_shards: int, process_index: int, process_count: int) -> range:
  """The input shards process `process_index` reads: a contiguous block of them."""
  per = num_shards // process_count
  return range(process_index * per, (process_index + 1) * per)


def train_dataset(
  source: Sequence,
  model_proto: bytes,
  *,
  seq_len: int,
  global_batch_size: int,
  process_index: int,
  process_count: int,
  text_key: str,
  seed: int,
  shuffle_buffer: int,
  worker_count: int,
  num_shards: int | None = None,
  num_epochs: int | None = None,
) -> ShardedBatches:
  """Process-local training batches (infinite unless `num_epochs` is set, for tests).

  `num_shards` (default: `process_count`) input shards of `global_batch_size /
  num_shards` rows each; this process reads only its own shards' documents.
  """
  num_shards = num_shards or process_count
  rows = global_batch_size // num_shards
  shards = {}
  for s in process_shards(num_shards, process_index, process_count):
    shards[s] = packed_rows(
      source,
      model_proto,
      seq_len=seq_len,
      text_key=text_key,
      seed=seed,
      shuffle_buffer=shuffle_buffer,
      worker_count=worker_count,
      num_epochs=num_epochs,
      shard=s,
      num_shards=num_shards,
    ).batch(rows, drop_remainder=True)
  return ShardedBatches(shards, num_shards, len(source))
