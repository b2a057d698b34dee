"""The training text's one epoch, for `benchmarks.single_epoch`: its documents and
tokenizer (prepared once in the workdir), the documents and tokens of one pass (counted
once), the most steps that pass holds, and the check after a run that no document was
served twice."""

import os

from benchmarks import common
import input_pipeline
from input_pipeline import iterator_state, pipeline, sources
from odetransformer.errors import UserError
from odetransformer.train.checkpoint.fingerprint import tokenizer_sha256

EPOCH_FILE = "single_epoch_corpus.json"


class TrainingText:
  """The runs' training documents and tokenizer (prepared and trained once, in `root`)."""

  def __init__(self, config, root: str):
    self.config = config
    ds = input_pipeline.create_datasets(
      config.data,
      seq_len=config.seq_len,
      global_batch_size=config.global_batch_size,
      eval_batch_size=config.eval_batch_size,
      seed=config.seed,
      workdir=root,
      process_index=0,
      process_count=1,
    )
    self.tokenizer = ds.tokenizer
    self.documents = sources.open_corpus(config.data, config.data.cache_dir).train
    self.key = {"tokenizer": tokenizer_sha256(ds.tokenizer_path), "corpus": ds.content_hash}
    self.epoch = self._count(os.path.join(root, EPOCH_FILE))

  def _count(self, path: str) -> dict:
    """Documents and tokens in one pass (each document + eos, as the pipeline makes
    them), counted once and kept at `path` under the tokenizer's and corpus's hashes."""
    stored = common.read_json(path) or {}
    if stored.get("key") == self.key:
      return stored
    key = self.config.data.text_key
    texts = [self.documents[i][key] for i in range(len(self.documents))]
    lengths = [
      len(ids) + 1
      for ids in self.tokenizer.encode(
        [t.decode("utf-8") if isinstance(t, bytes) else t for t in texts]
      )
    ]
    counted = {
      "key": self.key,
      "documents": len(lengths),
      "tokens": sum(lengths),
      "longest_document": max(lengths),
      "vocab_size": self.tokenizer.get_piece_size(),
    }
    common.write_json(path, counted)
    return counted

  def documents_read(self, data_state, seed: int) -> int:
    """Document positions the training stream had read when it stopped (this epoch's
    while below the corpus's count): the packer's position once it filled the row
    shuffle's current window, replayed from the window's start in the saved state."""
    state = iterator_state.fix_grain_state(data_state)
    if state["num_shards"] != 1:
      raise UserError("the single-epoch check reads one input shard; fix: run on one process")
    shard = state["shards"]["0"]
    c = self.config
    rows = pipeline.packed_rows(
      self.documents,
      self.tokenizer.serialized_model_proto(),
      seq_len=c.seq_len,
      text_key=c.data.text_key,
      seed=seed,
      shuffle_buffer=0,
      worker_count=0,
    )
    it = iter(rows)
    it.set_state(shard.get("parent_window_start_state", shard))
    for _ in range(c.data.shuffle_buffer if "parent_window_start_state" in shard else 0):
      next(it)
    return int(it.get_state()["parent_state"]["next_index"])


def max_single_epoch_steps(config, epoch: dict) -> int:
  """The most steps whose rows fit in one pass: each row takes seq_len + 1 positions of
  the packed stream, the row shuffle reads up to one window of rows ahead, and the
  packer up to one document past the last row."""
  rows = (epoch["tokens"] - epoch["longest_document"]) // (config.seq_len + 1)
  return max(0, (rows - max(1, config.data.shuffle_buffer)) // config.global_batch_size)


def single_epoch_check(config, epoch: dict, steps: int, documents_read: int) -> str:
  """The tokens a run saw and its single-epoch proof, or UserError when a document was
  served a second time."""
  if documents_read > epoch["documents"]:
    raise UserError(
      f"the training stream read {documents_read:,} document positions, more "
      f"than the {epoch['documents']:,} documents of one pass: some tokens "
      "were served twice; fix: fewer --steps"
    )
  tokens = steps * config.global_batch_size * config.seq_len
  return (
    f"tokens seen per model: {tokens:,} ({steps:,} steps x {config.global_batch_size} "
    f"rows x {config.seq_len} targets); documents read {documents_read:,} of "
    f"{epoch['documents']:,} ({epoch['tokens']:,} tokens): single epoch, no token "
    "position of the training text served twice"
  )
