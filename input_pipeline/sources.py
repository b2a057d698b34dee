"""Turns `data.source` into two random-access document sources (train and eval).

Every source ends up as a TFDS array_record data source: `len()` plus `[i]` returning
a dict whose `data.text_key` entry holds the document text (bytes or str). Nothing here
uses tf.data.
"""

from collections.abc import Sequence
import dataclasses
import glob
import os

import ml_collections
import tensorflow_datasets as tfds

from input_pipeline import cache, corpora, embedded, local_text
from input_pipeline.errors import DataError
from odetransformer.runtime import fileio

SOURCES = "'embedded', 'local', 'tfds:<name>', 'openwebtext', 'wikitext103'"


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The documents a run trains and evaluates on.

  Attributes:
    name: What `data.source` named, for messages.
    fingerprint: Identifies the exact training data (keys the tokenizer cache).
    train: Random-access training documents.
    eval: Random-access evaluation documents.
    eval_split: The split `eval` was read from.
    content_hash: sha256 of the prepared files (recorded when they were prepared here);
      for data prepared without that record, `fingerprint`.
  """

  name: str
  fingerprint: str
  train: Sequence
  eval: Sequence
  eval_split: str
  content_hash: str


def expand_globs(patterns: str, what: str = "", flag: str = "") -> list[str]:
  """Comma-separated globs -> sorted unique files; no glob, or one matching nothing, is a
  DataError naming where the globs came from: the config key `data.<what>`, or `flag`,
  the command-line flag that gave them (e.g. evaluate's `--data=local:`, which it then
  passes on as both data.train_files and data.eval_files)."""
  globs = [p.strip() for p in patterns.split(",") if p.strip()]
  if not globs:
    if flag:
      raise DataError(f"{flag} names no file; fix: pass {flag}<glob of text files>")
    raise DataError(f"data.{what} is empty; fix: set --config.data.{what}=<glob of text files>")
  files = set()
  for g in globs:
    matches = [m for m in glob.glob(os.path.expanduser(g), recursive=True) if os.path.isfile(m)]
    if not matches:
      raise DataError(
        f"{flag + patterns if flag else 'data.' + what}: no file matches {g!r}; fix: check "
        "the path (globs are relative to the working directory)"
      )
    files.update(os.path.abspath(m) for m in matches)
  return sorted(files)


def _local(split_files: dict[str, list[str]], name: str, cache_dir: str) -> Corpus:
  srcs, fp, digest = local_text.prepare(split_files, fileio.join(cache_dir, "prepared"))
  return Corpus(
    name=name,
    fingerprint=f"{name}-{fp}",
    train=srcs["train"],
    eval=srcs["validation"],
    eval_split="validation",
    content_hash=digest,
  )


def _open_builder(
  builder, name: str, prepare_hint: str, train_split: str, eval_split: str
) -> Corpus:
  """Opens a prepared TFDS builder's two splits as data sources (DataError if unprepared)."""
  if not builder.is_prepared():
    raise DataError(
      f"dataset {name!r} is not prepared in {builder.data_dir}; fix: run "
      f"{prepare_hint} (or set data.data_dir to where it was prepared)"
    )
  cache.check_manifest(
    os.fspath(builder.data_path), delete=os.fspath(builder.data_path), reprepare=prepare_hint
  )
  splits = list(builder.info.splits.keys())
  if not eval_split:
    eval_split = next((s for s in ("validation", "test") if s in splits), "")
    if not eval_split:
      raise DataError(
        f"dataset {name!r} has no validation or test split (splits: {splits}); "
        "fix: set data.eval_split, e.g. 'train[:1%]' with train_split='train[1%:]'"
      )
  sources = []
  for split in (train_split, eval_split):
    try:
      sources.append(builder.as_data_source(split=split))
    except NotImplementedError as e:  # prepared as tfrecord
      raise DataError(
        f"dataset {name!r} in {builder.data_dir} is not in array_record format; "
        f"fix: re-prepare it with {prepare_hint} into another data_dir"
      ) from e
    except (KeyError, ValueError, AssertionError) as e:
      raise DataError(
        f"dataset {name!r}: bad split {split!r} ({str(e).splitlines()[0]}); "
        f"fix: use one of {splits} (TFDS slicing like 'train[:10%]' works)"
      ) from e
  train, eval_ = (cache.Checked(s, os.fspath(builder.data_dir), prepare_hint) for s in sources)
  fingerprint = f"{builder.info.full_name}:{train_split}:{len(train)}"
  digest = cache.content_hash(os.fspath(builder.data_path)) or fingerprint
  return Corpus(
    name=name,
    fingerprint=fingerprint,
    train=train,
    eval=eval_,
    eval_split=eval_split,
    content_hash=digest,
  )


def _tfds(name: str, data_cfg: ml_collections.ConfigDict) -> Corpus:
  data_dir = data_cfg.data_dir or None
  hint = f"python -m input_pipeline.prepare --dataset=tfds:{name} --data_dir={data_dir or 'DIR'}"
  try:
    builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
  except tfds.core.registered.DatasetNotFoundError as e:
    raise DataError(
      f"unknown TFDS dataset {name!r}; fix: use a name from the TFDS catalog "
      "(https://www.tensorflow.org/datasets/catalog), e.g. "
      "data.source='tfds:lm1b'"
    ) from e
  return _open_builder(builder, f"tfds:{name}", hint, data_cfg.train_split, data_cfg.eval_split)


def open_corpus(data_cfg: ml_collections.ConfigDict, cache_dir: str) -> Corpus:
  """Opens (preparing local text once, into `cache_dir`) the corpus `data_cfg.source` names."""
  source = data_cfg.source
  if source == "embedded":
    return _local(embedded.corpus_files(), "embedded", cache_dir)
  if source == "local":
    return _local(
      {
        "train": expand_globs(data_cfg.train_files, "train_files"),
        "validation": expand_globs(data_cfg.eval_files, "eval_files"),
      },
      "local",
      cache_dir,
    )
  if source.startswith("tfds:") and source[len("tfds:") :]:
    return _tfds(source[len("tfds:") :], data_cfg)
  if source in corpora.BUILDERS:
    data_dir = data_cfg.data_dir or None
    builder = corpora.BUILDERS[source](data_dir=data_dir, file_format="array_record")
    hint = f"python -m input_pipeline.prepare --dataset={source} --data_dir={data_dir or 'DIR'}"
    return _open_builder(builder, source, hint, data_cfg.train_split, data_cfg.eval_split)
  raise DataError(f"unknown data.source {source!r}; fix: use one of {SOURCES}")
