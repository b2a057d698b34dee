"""`config.data`, the input-pipeline section of every experiment config: `DataConfig`
holds each key's meaning and default; `get_config()` is the same as the ml_collections
section users override on the command line (`--config.data.source=local ...`)."""

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The data a run trains and evaluates on, and its tokenizer.

  Attributes:
    source: Where the text comes from: 'embedded' (the Python standard library's own .py
      files, offline everywhere), 'local' (train_files / eval_files), 'tfds:<name>' (any
      TFDS dataset prepared as array_record, e.g. 'tfds:lm1b', 'tfds:c4/en:3.1.0'),
      'openwebtext' or 'wikitext103' (the paper's corpora; prepare them once with
      `python -m input_pipeline.prepare --dataset=<name> --data_dir=DIR`).
    train_split: Split to train on (tfds / openwebtext / wikitext103); TFDS slices like
      'train[:90%]' work.
    eval_split: Split to evaluate on; '' = the source's own (validation, or test where
      there is none).
    data_dir: TFDS data_dir holding prepared datasets; '' = TFDS default
      (~/tensorflow_datasets).
    train_files: 'local': comma-separated globs of training text files.
    eval_files: 'local': comma-separated globs of validation text files.
    vocab_size: SentencePiece vocabulary size (tokenizer_path's must match).
    tokenizer_path: SentencePiece .model to use; '' = train on the training split and
      cache it.
    tokenizer_sample_bytes: Bytes of training text the tokenizer is trained on.
    text_key: Feature holding the text in each example.
    worker_count: Tokenizer worker processes per input shard; 0 tokenizes in the training
      process. 0 by default (one-machine runs and tests: workers cost seconds to start
      and a tokenizer's memory each, which small batches do not repay); the pod configs
      set 4. The batches are the same for any count.
    input_shards: Independent streams the training data is split into (documents
      i::input_shards), each filling global_batch_size / input_shards rows of every
      batch; each process reads only its input_shards / process_count of them. 0 = one
      per process. A resume with the same count continues exactly (on any process count
      dividing it); another count starts at the next epoch.
    shuffle_buffer: Packed rows shuffled together (0 or 1 = no row shuffle).
    eval_max_batches: Evaluate on at most this many batches (0 = the whole split).
    cache_dir: Tokenizers and prepared local text; '' = data_dir, else
      <workdir>/data_cache.
  """

  source: str = "embedded"
  train_split: str = "train"
  eval_split: str = ""
  data_dir: str = ""
  train_files: str = ""
  eval_files: str = ""
  vocab_size: int = 2048
  tokenizer_path: str = ""
  tokenizer_sample_bytes: int = 10_000_000
  text_key: str = "text"
  worker_count: int = 0
  input_shards: int = 0
  shuffle_buffer: int = 256
  eval_max_batches: int = 0
  cache_dir: str = ""

  def __post_init__(self):
    for name in ("vocab_size", "tokenizer_sample_bytes"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"data.{name}={getattr(self, name)} must be positive")
    for name in ("worker_count", "input_shards", "shuffle_buffer", "eval_max_batches"):
      if int(getattr(self, name)) < 0:
        raise ValueError(f"data.{name}={getattr(self, name)} must be >= 0")


def get_config() -> ml_collections.ConfigDict:
  """All `data.*` keys with their defaults (`DataConfig`)."""
  return ml_collections.ConfigDict(dataclasses.asdict(DataConfig()))
