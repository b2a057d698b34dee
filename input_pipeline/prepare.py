r"""One-time preparation of a corpus into array_record shards (needs network).

    python -m input_pipeline.prepare --dataset=openwebtext --data_dir=$HOME/tfds
    python -m input_pipeline.prepare --dataset=wikitext103 --data_dir=$HOME/tfds
    python -m input_pipeline.prepare --dataset=tfds:lm1b --data_dir=$HOME/tfds

then train with `--config.data.source=openwebtext --config.data.data_dir=$HOME/tfds`.
`--raw_dir` uses files downloaded by hand instead (see `input_pipeline/corpora.py`).
With `--vocab_size=N` it also trains and caches the tokenizer beside the data, so
that every host of a multi-host run later loads the same file instead of training.

OpenWebText: ~16 GB of parquet downloads, ~40 GB of array_record, two passes over the
raw files (train, then the 0.05% test hold-out); expect hours on one machine.
"""

import os

from absl import flags
import tensorflow_datasets as tfds

from input_pipeline import cache, corpora, sources
from input_pipeline import config as config_lib
from input_pipeline import tokenizer as tokenizer_lib
from input_pipeline.errors import DataError
from odetransformer import cli_flags


def prepare(
  dataset: str,
  data_dir: str,
  raw_dir: str | None = None,
  vocab_size: int = 0,
  sample_bytes: int = 10_000_000,
) -> str:
  """Prepares `dataset` in `data_dir` (a no-op if already there); returns a summary line."""
  if dataset in corpora.BUILDERS:
    kwargs = {"raw_dir": raw_dir} if raw_dir else {}
    builder = corpora.BUILDERS[dataset](data_dir=data_dir, file_format="array_record", **kwargs)
  elif dataset.startswith("tfds:"):
    try:
      builder = tfds.builder(dataset[len("tfds:") :], data_dir=data_dir, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError as e:
      raise DataError(
        f"unknown TFDS dataset {dataset!r}; fix: use a name from the TFDS catalog"
      ) from e
  else:
    raise DataError(
      f"cannot prepare {dataset!r}; fix: use 'openwebtext', 'wikitext103' or "
      "'tfds:<name>' ('embedded' and 'local' are prepared automatically)"
    )
  with cache.exclusive(data_dir, dataset):
    cache.remove_incomplete(os.fspath(builder.data_path.parent))
    with cache.one_line_errors(data_dir):
      builder.download_and_prepare()
    cache.write_manifest(os.fspath(builder.data_path))
  splits = {k: v.num_examples for k, v in builder.info.splits.items()}
  summary = f"{dataset}: prepared in {builder.data_dir}, documents per split {splits}"
  if vocab_size:
    cfg = config_lib.get_config()
    cfg.source, cfg.data_dir, cfg.vocab_size = dataset, data_dir, vocab_size
    cfg.tokenizer_sample_bytes = sample_bytes
    corpus = sources.open_corpus(cfg, cache_dir=data_dir)
    _, path = tokenizer_lib.get_tokenizer(
      tokenizer_path="",
      vocab_size=vocab_size,
      cache_dir=data_dir,
      fingerprint=corpus.fingerprint,
      source=corpus.train,
      text_key=cfg.text_key,
      sample_bytes=sample_bytes,
    )
    summary += f"; tokenizer {path}"
  return summary


def main(argv, flag_values=None):
  """The command line (flags: `define_flags`; `flag_values` defaults to absl's FLAGS)."""
  if len(argv) > 1:
    raise DataError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  f = flags.FLAGS if flag_values is None else flag_values
  print(prepare(f.dataset, f.data_dir, f.raw_dir, f.vocab_size, f.tokenizer_sample_bytes))


def define_flags(flag_values=None):
  """Defines this command's flags in `flag_values` (default: absl's global FLAGS)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  define = cli_flags.definer(fv)
  define("string", "dataset", None, "'openwebtext', 'wikitext103' or 'tfds:<name>'.", required=True)
  define("string", "data_dir", None, "TFDS data_dir to write to.", required=True)
  define("string", "raw_dir", None, "Raw files downloaded by hand (optional).")
  define("integer", "vocab_size", 0, "Also train the tokenizer (0 = do not).")
  define(
    "integer",
    "tokenizer_sample_bytes",
    config_lib.get_config().tokenizer_sample_bytes,
    "Bytes of training text for the tokenizer.",
  )
  define("bool", "verbose", False, "Show the traceback of a user error as well.")
  return fv


if __name__ == "__main__":
  cli_flags.run_absl_tool(main, define_flags)
