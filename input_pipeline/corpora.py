"""The paper's corpora, OpenWebText and WikiText-103, as TFDS array_record datasets.

TFDS has no builders for them, so these two do the one-time download and conversion
(run `python -m input_pipeline.prepare --dataset=openwebtext --data_dir=DIR`); the
pipeline then reads the prepared shards through `as_data_source()` like any TFDS set.

OpenWebText has only one split. As in nanoGPT, 0.05% of its documents are held out as
`test`, chosen by a hash of the document's index (its position in the sorted shard
files), so the hold-out is the same on every machine and needs no shuffling state.
WikiText-103 keeps its own train/validation/test split; documents are its articles.

The raw data come from the network (Hugging Face's parquet export of
`Skylion007/openwebtext`; the WikiText-103 raw zip) unless `raw_dir` points at files
fetched by hand: `*.parquet` (with a `text` column), `*.jsonl` or `*.txt` (one document
per file) for OpenWebText; `wiki.{train,valid,test}.raw` for WikiText-103.
"""

from collections.abc import Callable, Iterable, Iterator
import hashlib
import json
import os
import pathlib
import re
import urllib.request
import zipfile

from absl import logging
import tensorflow_datasets as tfds

from input_pipeline.errors import DataError

OPENWEBTEXT_TEST_FRACTION = 0.0005
OPENWEBTEXT_PARQUET_INDEX = (
  "https://datasets-server.huggingface.co/parquet?dataset=Skylion007/openwebtext"
)
WIKITEXT103_URLS = (
  "https://wikitext.smerity.com/wikitext-103-raw-v1.zip",
  "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-raw-v1.zip",
)

_TEXT_FEATURES = lambda: tfds.features.FeaturesDict({"text": tfds.features.Text()})


def is_heldout(index: int, fraction: float = OPENWEBTEXT_TEST_FRACTION) -> bool:
  """Whether document `index` belongs to the held-out split (a fixed hash, not an RNG)."""
  digest = hashlib.sha256(f"openwebtext-doc-{index}".encode()).digest()
  return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def _download(url: str, dest: pathlib.Path) -> pathlib.Path:
  """Fetches `url` to `dest` once (atomically: a partial file never has the final name)."""
  if dest.exists():
    return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp = dest.with_name(dest.name + ".partial")
  logging.info("downloading %s -> %s", url, dest)
  with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
    while chunk := r.read(1 << 22):
      f.write(chunk)
  os.replace(tmp, dest)
  return dest


def download_openwebtext(download_dir: pathlib.Path) -> pathlib.Path:
  """Downloads OpenWebText's parquet shards (~16 GB) into `download_dir`; returns it."""
  try:
    with urllib.request.urlopen(OPENWEBTEXT_PARQUET_INDEX, timeout=60) as r:
      index = json.load(r)
  except OSError as e:
    raise DataError(
      f"cannot list OpenWebText parquet files at {OPENWEBTEXT_PARQUET_INDEX} ({e}); "
      "fix: download them by hand and pass --raw_dir=DIR"
    ) from e
  if index.get("partial"):
    raise DataError(
      "the Hugging Face parquet export of OpenWebText is partial; fix: download "
      "the full corpus by hand (parquet, jsonl or txt) and pass --raw_dir=DIR"
    )
  files = [f for f in index.get("parquet_files", []) if f.get("split") == "train"]
  if not files:
    raise DataError(
      f"no OpenWebText parquet files listed at {OPENWEBTEXT_PARQUET_INDEX}; "
      "fix: download them by hand and pass --raw_dir=DIR"
    )
  for f in files:
    _download(f["url"], download_dir / f"{f['config']}-{f['split']}-{f['filename']}")
  return download_dir


def iter_raw_documents(raw_dir: pathlib.Path) -> Iterator[str]:
  """Documents from `raw_dir` in a fixed order: sorted *.parquet, then *.jsonl, then *.txt."""
  raw_dir = pathlib.Path(raw_dir)
  parquet = sorted(raw_dir.rglob("*.parquet"))
  jsonl = sorted(raw_dir.rglob("*.jsonl"))
  txt = sorted(raw_dir.rglob("*.txt"))
  if not (parquet or jsonl or txt):
    raise DataError(
      f"no *.parquet, *.jsonl or *.txt files under {raw_dir}; "
      "fix: point --raw_dir at the downloaded OpenWebText files"
    )
  if parquet:
    import pyarrow.parquet as pq  # lazy: pyarrow only for parquet files

    for path in parquet:
      for batch in pq.ParquetFile(path).iter_batches(columns=["text"], batch_size=1024):
        yield from batch.column(0).to_pylist()
  for path in jsonl:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if line.strip():
          yield json.loads(line)["text"]
  for path in txt:
    yield path.read_text(encoding="utf-8", errors="replace")


class Openwebtext(tfds.core.GeneratorBasedBuilder):
  """OpenWebText (Gokaslan & Cohen 2019): train, and a 0.05% hash-held-out test split.

  Args (besides TFDS's data_dir etc.):
    raw_dir: prepared-by-hand raw files (see module docstring); default: download.
    raw_documents: a callable returning the documents in order; replaces raw_dir and
      the download (tests use a tiny fake corpus).
    test_fraction: the held-out fraction (tests raise it to see a non-empty split).
  """

  VERSION = tfds.core.Version("1.0.0")

  def __init__(
    self,
    *,
    raw_dir: str | None = None,
    raw_documents: Callable[[], Iterable[str]] | None = None,
    test_fraction: float = OPENWEBTEXT_TEST_FRACTION,
    **kwargs,
  ):
    self._raw_dir = raw_dir
    self._raw_documents = raw_documents
    self._test_fraction = test_fraction
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      features=_TEXT_FEATURES(),
      description="OpenWebText; test = documents whose index hashes below 0.05%.",
      homepage="https://skylion007.github.io/OpenWebTextCorpus/",
    )

  def _split_generators(self, dl_manager):
    if self._raw_documents is not None:
      docs = self._raw_documents
    else:
      raw_dir = (
        pathlib.Path(self._raw_dir)
        if self._raw_dir
        else download_openwebtext(pathlib.Path(dl_manager.download_dir) / "openwebtext")
      )
      docs = lambda: iter_raw_documents(raw_dir)
    # Two passes over the raw files (one per split): simple, and this runs once.
    return {
      "train": self._generate_examples(docs, heldout=False),
      "test": self._generate_examples(docs, heldout=True),
    }

  def _generate_examples(self, docs, heldout: bool):
    for index, text in enumerate(docs()):
      if is_heldout(index, self._test_fraction) == heldout:
        yield index, {"text": text}


_ARTICLE_TITLE = re.compile(r"^ = [^=].* = $")


def split_wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
  """Groups WikiText lines into articles: a new one starts at each ' = Title = ' line."""
  article: list[str] = []
  for line in lines:
    if _ARTICLE_TITLE.match(line.rstrip("\n")) and any(l.strip() for l in article):
      yield "".join(article).strip("\n")
      article = []
    article.append(line)
  if any(l.strip() for l in article):
    yield "".join(article).strip("\n")


class Wikitext103(tfds.core.GeneratorBasedBuilder):
  """WikiText-103 raw (Merity et al. 2016); one document per article.

  Args (besides TFDS's data_dir etc.):
    raw_dir: a directory holding wiki.{train,valid,test}.raw; default: download.
  """

  VERSION = tfds.core.Version("1.0.0")

  def __init__(self, *, raw_dir: str | None = None, **kwargs):
    self._raw_dir = raw_dir
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      features=_TEXT_FEATURES(),
      description="WikiText-103 raw, one document per article.",
      homepage="https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/",
    )

  def _split_generators(self, dl_manager):
    raw_dir = (
      pathlib.Path(self._raw_dir)
      if self._raw_dir
      else self._download(pathlib.Path(dl_manager.download_dir))
    )
    paths = {
      s: raw_dir / f"wiki.{f}.raw"
      for s, f in (("train", "train"), ("validation", "valid"), ("test", "test"))
    }
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
      raise DataError(
        f"WikiText-103 files missing: {', '.join(missing)}; fix: pass "
        "--raw_dir=DIR holding wiki.train.raw, wiki.valid.raw, wiki.test.raw"
      )
    return {s: self._generate_examples(p) for s, p in paths.items()}

  def _download(self, download_dir: pathlib.Path) -> pathlib.Path:
    out = download_dir / "wikitext-103-raw"
    if (out / "wiki.train.raw").exists():
      return out
    errors = []
    for url in WIKITEXT103_URLS:
      try:
        archive = _download(url, download_dir / "wikitext-103-raw-v1.zip")
        break
      except OSError as e:
        errors.append(f"{url}: {e}")
    else:
      raise DataError(
        f"cannot download WikiText-103 ({'; '.join(errors)}); fix: fetch "
        "wikitext-103-raw-v1.zip by hand, unzip it and pass --raw_dir=DIR"
      )
    with zipfile.ZipFile(archive) as z:
      z.extractall(download_dir)
    return out

  def _generate_examples(self, path: pathlib.Path):
    with open(path, encoding="utf-8") as f:
      for i, article in enumerate(split_wikitext_articles(f)):
        yield i, {"text": article}


BUILDERS = {"openwebtext": Openwebtext, "wikitext103": Wikitext103}
