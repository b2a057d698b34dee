"""Defaults for `config.data`, the input-pipeline section of every experiment config."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """All `data.*` keys with defaults: the embedded corpus, offline on any machine."""
  c = ml_collections.ConfigDict()
  # Where the text comes from: 'embedded' (the Python standard library's own .py
  # files, offline everywhere), 'local' (train_files / eval_files), 'tfds:<name>'
  # (any TFDS dataset prepared as array_record, e.g. 'tfds:lm1b', 'tfds:c4/en:3.1.0'),
  # 'openwebtext' or 'wikitext103' (the paper's corpora; prepare them once with
  # `python -m input_pipeline.prepare --dataset=<name> --data_dir=DIR`).
  c.source = "embedded"
  # Split to train on (tfds / openwebtext / wikitext103); TFDS slices like 'train[:90%]' work.
  c.train_split = "train"
  # Split to evaluate on; '' = the source's own (validation, or test where there is none).
  c.eval_split = ""
  # TFDS data_dir holding prepared datasets; '' = TFDS default (~/tensorflow_datasets).
  c.data_dir = ""
  c.train_files = ""  # 'local': comma-separated globs of training text files
  c.eval_files = ""  # 'local': comma-separated globs of validation text files
  c.vocab_size = 2048  # SentencePiece vocabulary size (tokenizer_path's must match)
  # SentencePiece .model to use; '' = train on the training split and cache it.
  c.tokenizer_path = ""
  c.tokenizer_sample_bytes = 10_000_000  # bytes of training text the tokenizer is trained on
  c.text_key = "text"  # feature holding the text in each example
  # Tokenizer worker processes per input shard; 0 tokenizes in the training process. 0 by
  # default (one-machine runs and tests: workers cost seconds to start and a tokenizer's
  # memory each, which small batches do not repay); the pod configs set 4. The batches
  # are the same for any count.
  c.worker_count = 0
  # Independent streams the training data is split into (documents i::input_shards),
  # each filling global_batch_size / input_shards rows of every batch; each process
  # reads only its input_shards / process_count of them. 0 = one per process. A resume
  # with the same count continues exactly (on any process count dividing it); another
  # count starts at the next epoch.
  c.input_shards = 0
  c.shuffle_buffer = 256  # packed rows shuffled together (0 or 1 = no row shuffle)
  c.eval_max_batches = 0  # evaluate on at most this many batches (0 = the whole split)
  # Tokenizers and prepared local text; '' = data_dir, else <workdir>/data_cache.
  c.cache_dir = ""
  return c
