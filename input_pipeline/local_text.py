"""Local text files as a TFDS dataset: split into documents, written once as array_record.

The builder lives in this importable module (not in `__main__`) so that grain worker
processes can unpickle the data sources made from it. Each distinct set of files
(paths, sizes, modification times) is prepared into its own directory, keyed by a
fingerprint, and reused by every later run. Preparing takes seconds and says so in one
log line: TFDS's download banner and progress bars (terminal escape codes in a log file)
are left out.
"""

from collections.abc import Iterator, Mapping, Sequence
import contextlib
import hashlib
import json
import os

from absl import logging
import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils

from input_pipeline import cache
from input_pipeline.errors import DataError
from odetransformer.runtime import fileio

# A document is built from whole paragraphs (runs of lines between blank lines) up to
# about this many characters; a longer paragraph is cut at line ends, a longer line
# at this length. Documents of a few KiB keep shuffling meaningful for single-file
# corpora (a 1 MB file gives ~250 documents) while keeping most context together.
DOC_CHARS = 4096


def split_documents(text: str, max_chars: int = DOC_CHARS) -> list[str]:
  """Splits `text` into documents of at most `max_chars` characters.

  Paragraphs (separated by blank lines) are packed greedily into a document until
  the next one would not fit; a paragraph longer than `max_chars` is cut at line
  ends, a line longer than `max_chars` into `max_chars` pieces. Blank lines at a
  document's edges are dropped; everything inside a document is kept verbatim.

  Args:
    text: The file's contents.
    max_chars: Upper bound on a document's length in characters.

  Returns:
    The non-blank documents in file order.
  """
  docs: list[str] = []
  current: list[str] = []
  size = 0

  def flush():
    nonlocal current, size
    doc = "".join(current).strip("\n")
    if doc.strip():
      docs.append(doc)
    current, size = [], 0

  paragraph: list[str] = []

  def add_paragraph():
    nonlocal size
    para = "".join(paragraph)
    if not para:
      return
    if size + len(para) > max_chars:
      flush()
    if len(para) <= max_chars:
      current.append(para)
      size += len(para)
      return
    for line in para.splitlines(keepends=True):  # paragraph too long: cut at line ends
      for start in range(0, len(line), max_chars):
        piece = line[start : start + max_chars]
        if size + len(piece) > max_chars:
          flush()
        current.append(piece)
        size += len(piece)

  for line in text.splitlines(keepends=True):
    paragraph.append(line)
    if not line.strip():  # a blank line ends a paragraph (and stays with it)
      add_paragraph()
      paragraph = []
  add_paragraph()
  flush()
  return docs


class LocalText(tfds.core.GeneratorBasedBuilder):
  """Text files split into documents; features: {'text': Text}.

  Construct with `split_files={'train': [...], 'validation': [...]}` to prepare;
  without it (as TFDS does when unpickling a data source) it can only read.
  """

  VERSION = tfds.core.Version("1.0.0")

  def __init__(
    self,
    *,
    split_files: Mapping[str, Sequence[str]] | None = None,
    doc_chars: int = DOC_CHARS,
    **kwargs,
  ):
    self._split_files = {k: list(v) for k, v in (split_files or {}).items()}
    self._doc_chars = doc_chars
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description="Local text files, split into documents of whole paragraphs.",
      features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    return {split: self._generate_examples(files) for split, files in self._split_files.items()}

  # TFDS prints a "Downloading and preparing dataset ..." banner and a "... downloaded
  # and prepared" line to stdout; nothing is downloaded here, and prepare() logs instead.
  def _log_download_bytes(self) -> None:
    pass

  def _log_download_done(self) -> None:
    pass

  def _generate_examples(self, files: Sequence[str]) -> Iterator[tuple[str, dict]]:
    for path in files:
      text = _read_text(path)
      for i, doc in enumerate(split_documents(text, self._doc_chars)):
        yield f"{path}:{i}", {"text": doc}


def fingerprint(split_files: Mapping[str, Sequence[str]], doc_chars: int = DOC_CHARS) -> str:
  """A short hash of the files (path, size, mtime) and the splitting; names the prepared dir."""
  desc = {"version": str(LocalText.VERSION), "doc_chars": doc_chars, "splits": {}}
  for split, files in sorted(split_files.items()):
    entries = []
    for f in files:
      st = os.stat(f)  # local files (expand_globs); nanosecond modification times
      entries.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    desc["splits"][split] = entries
  blob = json.dumps(desc, sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()[:16]


@contextlib.contextmanager
def _no_progress_bars():
  """TFDS without its tqdm bars for the duration (then as it was)."""
  was = getattr(tqdm_utils, "_active", True)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(was)


def _read_text(path: str) -> str:
  return fileio.read_bytes(path).decode("utf-8", errors="replace")


def _builder(split_files, doc_chars, data_dir) -> LocalText:
  return LocalText(
    split_files=split_files, doc_chars=doc_chars, data_dir=data_dir, file_format="array_record"
  )


def _is_prepared(builder: LocalText) -> bool:
  # is_prepared() warns about a version directory that does not exist yet: check first.
  return builder.data_path.exists() and builder.is_prepared()


def prepare(
  split_files: Mapping[str, Sequence[str]], root: str | os.PathLike, doc_chars: int = DOC_CHARS
) -> tuple[dict[str, Sequence], str]:
  """Prepares (once) and opens the files as array_record data sources.

  One job prepares at a time (`cache.exclusive` on `root`); a job that waited finds the
  data prepared. What a killed preparation left is removed first.

  Args:
    split_files: Split name -> text files.
    root: Local directory under which `local-<fingerprint>/` is written.
    doc_chars: See `split_documents`.

  Returns:
    (split name -> random-access source of {'text': bytes}, fingerprint, content hash:
    sha256 over the prepared files' sha256s, recorded when they were prepared).
  """
  root = os.fspath(root)
  if not fileio.is_local(root):
    raise DataError(
      f"data.cache_dir={root}: local text is prepared with array_record's "
      "local-file writer, not on an object store; fix: set data.cache_dir to "
      "a local directory (data.tokenizer_path and data.data_dir may be gs://)"
    )
  fp = fingerprint(split_files, doc_chars)
  data_dir = fileio.join(root, f"local-{fp}")
  builder = _builder(split_files, doc_chars, data_dir)
  if not _is_prepared(builder):
    for split, files in split_files.items():  # TFDS cannot write an empty split
      if not any(_read_text(f).strip() for f in files):
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise DataError(
          f"the {split} files contain no text ({shown}); "
          "fix: point the source at non-empty text files"
        )
    with cache.exclusive(root, "text"):
      builder = _builder(split_files, doc_chars, data_dir)  # as another job may have left it
      if not _is_prepared(builder):
        cache.remove_incomplete(os.fspath(builder.data_path.parent))
        files = {f for fs in split_files.values() for f in fs}
        logging.info(
          "preparing %d text file%s as array_record in %s (once; later runs reuse it)",
          len(files),
          "" if len(files) == 1 else "s",
          builder.data_dir,
        )
        need = 2 * sum(os.path.getsize(f) for f in files) + (1 << 20)
        with _no_progress_bars(), cache.one_line_errors(data_dir, need_bytes=need):
          builder.download_and_prepare()
          cache.write_manifest(os.fspath(builder.data_path))
        builder = _builder(split_files, doc_chars, data_dir)
  cache.check_manifest(os.fspath(builder.data_path), delete=data_dir)
  digest = cache.content_hash(os.fspath(builder.data_path)) or fp
  with cache.one_line_errors(data_dir, delete=data_dir):
    return (
      {k: cache.Checked(v, data_dir) for k, v in builder.as_data_source().items()},
      fp,
      digest,
    )
