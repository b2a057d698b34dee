"""The run's tokenizer: a SentencePiece BPE trained once on a bounded sample of the
training split and cached, or a Hugging Face `tokenizer.json` (an imported model's own,
`python -m odetransformer.import_checkpoint`).

Settings make the round trip lossless for any text (`decode(encode(s)) == s`):
identity normalisation, no whitespace squeezing, byte fallback for unseen characters.
Training sentences are chunks of whole lines that keep their newlines, so newlines
and indentation get pieces of their own instead of falling back to bytes.
Ids are fixed: pad=0, unk=1, bos=2, eos=3 (recorded in a json beside the model).

Both kinds answer the same calls (`encode`, `decode`, `eos_id`, `get_piece_size`,
`id_to_piece`, `serialized_model_proto`): `load` and `from_bytes` tell them apart by the
file's content, so a workdir's tokenizer is used the same way whichever it holds.
"""

from collections.abc import Iterator, Sequence
import hashlib
import io
import json
import os
import re

from absl import logging
import numpy as np
import sentencepiece as spm

from input_pipeline import cache
from input_pipeline.errors import DataError
from odetransformer.runtime import fileio

SPECIAL_IDS = {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
# Bump when the trainer settings change, so cached tokenizers are not reused wrongly.
TRAINER_VERSION = 1
_SENTENCE_CHARS = 4000  # max_sentence_length is in bytes: 4000 chars <= 16000 bytes
_MIN_VOCAB = 256 + len(SPECIAL_IDS) + 1  # byte fallback needs all 256 byte pieces


def as_text(value) -> str:
  """A document as str (TFDS sources give bytes)."""
  if isinstance(value, bytes):
    return value.decode("utf-8", errors="replace")
  if isinstance(value, np.ndarray):  # a 0-d bytes array
    return as_text(value.item())
  return str(value)


def _chunks(text: str) -> Iterator[str]:
  """Whole lines (newlines kept) grouped into training sentences of <= _SENTENCE_CHARS."""
  current, size = [], 0
  for line in text.splitlines(keepends=True):
    for start in range(0, len(line), _SENTENCE_CHARS):
      piece = line[start : start + _SENTENCE_CHARS]
      if size + len(piece) > _SENTENCE_CHARS and current:
        yield "".join(current)
        current, size = [], 0
      current.append(piece)
      size += len(piece)
  if current:
    yield "".join(current)


def sample_text(source: Sequence, text_key: str, max_bytes: int) -> list[str]:
  """Documents in a fixed pseudo-random order (seed 0) until `max_bytes` of UTF-8."""
  order = np.random.default_rng(0).permutation(len(source))
  docs, total = [], 0
  for i in order:
    text = as_text(source[int(i)][text_key])
    docs.append(text)
    total += len(text.encode("utf-8"))
    if total >= max_bytes:
      break
  return docs


def train(docs: Sequence[str], vocab_size: int) -> bytes:
  """Trains a BPE model on `docs`; returns the serialized model proto."""
  if vocab_size < _MIN_VOCAB:
    raise DataError(
      f"data.vocab_size={vocab_size} is too small for a byte-fallback tokenizer; "
      f"fix: use data.vocab_size >= {_MIN_VOCAB}"
    )
  model = io.BytesIO()
  sentences = (c for d in docs for c in _chunks(d))
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=sentences,
      model_writer=model,
      vocab_size=vocab_size,
      model_type="bpe",
      character_coverage=1.0,
      byte_fallback=True,
      pad_id=SPECIAL_IDS["pad"],
      unk_id=SPECIAL_IDS["unk"],
      bos_id=SPECIAL_IDS["bos"],
      eos_id=SPECIAL_IDS["eos"],
      max_sentence_length=4 * _SENTENCE_CHARS,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      split_digits=True,
      allow_whitespace_only_pieces=True,
      num_threads=1,
      minloglevel=2,
    )
  except RuntimeError as e:
    raise DataError(_training_failure(str(e), vocab_size)) from e
  return model.getvalue()


def _training_failure(message: str, vocab_size: int) -> str:
  """SentencePiece's error as one line with the fix that applies to it."""
  detail = message.strip().splitlines()[-1] if message.strip() else "no message"
  detail = re.sub(r"^\w+: src/\S+ \[[^]]*\] ", "", detail)  # drop the C++ location
  if "smaller than required_chars" in detail:
    # More distinct characters than pieces (character_coverage=1.0 keeps them all).
    fix = (
      "raise data.vocab_size above that count, or check that the training files are "
      "text (binary data has many distinct characters)"
    )
  elif "too high" in detail:
    fix = "lower data.vocab_size, raise data.tokenizer_sample_bytes or use a larger corpus"
  else:
    fix = (
      "check data.vocab_size against the corpus, raise data.tokenizer_sample_bytes or "
      "use a larger corpus"
    )
  return f"SentencePiece training of a {vocab_size}-piece tokenizer failed ({detail}); fix: {fix}"


# Characters that do not occur in text: U+FFFD stands for bytes that are not UTF-8
# (sources decode with errors='replace'); C0 controls other than whitespace, and NUL,
# are what binary files are made of.
_NON_TEXT = re.compile("[\ufffd\x00-\x08\x0e-\x1f\x7f]")
MAX_NON_TEXT_FRACTION = 0.001  # web text has a few U+FFFD; Latin-1 or binary has many


def check_text(docs: Sequence[str], where: str) -> None:
  """DataError when the sampled training text is not UTF-8 text.

  More than MAX_NON_TEXT_FRACTION of its characters are U+FFFD (undecodable bytes: a
  Latin-1 or other non-UTF-8 file) or control characters (a binary file).
  """
  total = sum(len(d) for d in docs)
  bad = sum(len(_NON_TEXT.findall(d)) for d in docs)
  if total and bad > MAX_NON_TEXT_FRACTION * total:
    example = next(d for d in docs if _NON_TEXT.search(d))
    at = _NON_TEXT.search(example).start()
    snippet = example[max(0, at - 20) : at + 20].encode("unicode_escape").decode("ascii")
    raise DataError(
      f"the training text ({where}) is not UTF-8 text: {bad:,} of {total:,} sampled "
      f"characters are undecodable bytes or control characters (e.g. '{snippet}'); fix: "
      "convert the files to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave binary files "
      "out of data.train_files"
    )


# The document separator of a Hugging Face tokenizer: the first of these special tokens
# it has (GPT-2, SmolLM2 and most byte-level BPEs: <|endoftext|>; Llama 2: </s>; Llama 3:
# <|end_of_text|>). Training appends it after every document, generation stops at it.
HF_SEPARATORS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def is_hf_tokenizer(blob: bytes) -> bool:
  """Whether a tokenizer file's bytes are a Hugging Face tokenizer.json (JSON) rather
  than a SentencePiece model (protobuf)."""
  return blob.lstrip()[:1] == b"{"


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer (tokenizer.json) behind the SentencePiece
  processor's calls that this project makes.

  Ids are the file's own; the document separator (eos) is the first of `HF_SEPARATORS`
  among its special tokens; it has no pad, unk or bos id of its own here (-1), as the
  model never reads them. Text is encoded without special tokens (no BOS added: the
  separator before a document comes from packing, as for SentencePiece).
  """

  def __init__(self, blob: bytes, where: str = "the tokenizer"):
    try:
      import tokenizers  # lazy: only imported models' runs need it (requirements-import.txt)
    except ImportError as e:
      raise DataError(
        f"{where} is a Hugging Face tokenizer.json, which needs the tokenizers package; "
        "fix: pip install -r requirements-import.txt"
      ) from e
    try:
      self._tok = tokenizers.Tokenizer.from_str(blob.decode("utf-8"))
    except Exception as e:  # the Rust parser raises its own Exception type
      raise DataError(
        f"{where} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}); "
        "fix: point at the tokenizer.json of a model directory"
      ) from e
    self._blob = blob
    special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    found = [t for t in HF_SEPARATORS if t in special]
    if not found:
      raise DataError(
        f"{where} has none of the document separators {list(HF_SEPARATORS)} among its "
        f"special tokens ({sorted(special)[:8]}); fix: use a tokenizer that has one"
      )
    self._eos = self._tok.token_to_id(found[0])

  def encode(self, text: str) -> list:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def eos_id(self) -> int:
    return self._eos

  def bos_id(self) -> int:
    return -1

  def pad_id(self) -> int:
    return -1

  def unk_id(self) -> int:
    return -1

  def get_piece_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def id_to_piece(self, token_id: int) -> str:
    """The token's text (byte-level pieces decoded: 'Ġthe' -> ' the')."""
    return self.decode([token_id])

  def is_control(self, token_id: int) -> bool:
    return int(token_id) == self._eos

  def serialized_model_proto(self) -> bytes:
    """The tokenizer.json bytes (`from_bytes` rebuilds it; the name is SentencePiece's)."""
    return self._blob


Tokenizer = spm.SentencePieceProcessor | HFTokenizer


def from_bytes(blob: bytes, where: str = "the tokenizer") -> Tokenizer:
  """A SentencePiece processor or an `HFTokenizer`, whichever `blob` holds."""
  if is_hf_tokenizer(blob):
    return HFTokenizer(blob, where)
  return spm.SentencePieceProcessor(model_proto=blob)


def load(path: str, vocab_size: int) -> Tokenizer:
  """Loads a tokenizer file (a local path or a URL such as gs://...): a SentencePiece
  .model, whose vocab size and special ids must match the config, or a Hugging Face
  tokenizer.json, whose vocab size must."""
  if not fileio.isfile(path):
    raise DataError(
      f"tokenizer file {path} does not exist; fix: set data.tokenizer_path to an "
      "existing SentencePiece .model, or to '' to train one"
    )
  blob = fileio.read_bytes(path)
  if is_hf_tokenizer(blob):
    tok = HFTokenizer(blob, f"tokenizer file {path}")
    _check_size(tok, path, vocab_size)
    return tok
  try:
    sp = spm.SentencePieceProcessor(model_proto=blob)
  except (OSError, RuntimeError) as e:
    raise DataError(
      f"tokenizer file {path} is not a SentencePiece model ({e}); "
      "fix: point data.tokenizer_path at a .model file, or set it to '' to "
      "train one"
    ) from e
  _check(sp, path, vocab_size)
  return sp


def _check_size(sp, path: str, vocab_size: int) -> None:
  if sp.get_piece_size() != vocab_size:
    raise DataError(
      f"tokenizer {path} has {sp.get_piece_size()} pieces but data.vocab_size="
      f"{vocab_size}; fix: set --config.data.vocab_size={sp.get_piece_size()} "
      "or use a tokenizer trained with that size"
    )


def _check(sp: spm.SentencePieceProcessor, path: str, vocab_size: int) -> None:
  _check_size(sp, path, vocab_size)
  ids = {"pad": sp.pad_id(), "unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
  if ids != SPECIAL_IDS:
    raise DataError(
      f"tokenizer {path} has special ids {ids}, expected {SPECIAL_IDS}; "
      "fix: train it with those ids, or set data.tokenizer_path='' to train one"
    )


def cache_path(
  cache_dir: str, fingerprint: str, text_key: str, vocab_size: int, sample_bytes: int
) -> str:
  """Where the tokenizer for this (source, vocab size, sample size) is cached."""
  key = json.dumps(
    {
      "source": fingerprint,
      "text_key": text_key,
      "vocab_size": vocab_size,
      "sample_bytes": sample_bytes,
      "trainer": TRAINER_VERSION,
    },
    sort_keys=True,
  )
  digest = hashlib.sha256(key.encode()).hexdigest()[:12]
  slug = "".join(ch if ch.isalnum() else "_" for ch in fingerprint.split(":")[0])[:40]
  return fileio.join(
    cache_dir, "tokenizers", f"spm_{slug}_v{vocab_size}_s{sample_bytes}_{digest}.model"
  )


def get_tokenizer(
  *,
  tokenizer_path: str,
  vocab_size: int,
  cache_dir: str,
  fingerprint: str,
  source: Sequence,
  text_key: str,
  sample_bytes: int,
) -> tuple[Tokenizer, str]:
  """Loads `tokenizer_path`, or the cached tokenizer for this corpus, training it if absent
  (one job at a time per cache: `cache.exclusive`).

  Returns:
    (processor, path of its .model file).
  """
  if tokenizer_path:
    return load(tokenizer_path, vocab_size), tokenizer_path
  path = cache_path(cache_dir, fingerprint, text_key, vocab_size, sample_bytes)
  if fileio.exists(path):
    return load(path, vocab_size), path
  with cache.exclusive(cache_dir, "the tokenizer"):
    if fileio.exists(path):  # trained by the job we waited for
      return load(path, vocab_size), path
    return _train_and_cache(
      path,
      vocab_size=vocab_size,
      fingerprint=fingerprint,
      source=source,
      text_key=text_key,
      sample_bytes=sample_bytes,
    ), path


def _train_and_cache(
  path: str,
  *,
  vocab_size: int,
  fingerprint: str,
  source: Sequence,
  text_key: str,
  sample_bytes: int,
) -> spm.SentencePieceProcessor:
  docs = sample_text(source, text_key, sample_bytes)
  check_text(docs, fingerprint)
  n_bytes = sum(len(d.encode("utf-8")) for d in docs)
  logging.info(
    "training a %d-piece SentencePiece BPE on %d bytes of %s", vocab_size, n_bytes, fingerprint
  )
  proto = train(docs, vocab_size)
  sp = spm.SentencePieceProcessor(model_proto=proto)
  _check(sp, path, vocab_size)
  meta = {
    "special_ids": SPECIAL_IDS,
    "vocab_size": vocab_size,
    "source": fingerprint,
    "text_key": text_key,
    "sample_bytes": sample_bytes,
    "sampled_bytes": n_bytes,
    "model_type": "bpe",
    "trainer_version": TRAINER_VERSION,
  }
  directory = os.fspath(fileio.path(path).parent)
  with cache.one_line_errors(directory, need_bytes=2 * len(proto)):
    fileio.makedirs(directory)
    fileio.write_text_atomic(path[: -len(".model")] + ".json", json.dumps(meta, indent=1))
    fileio.write_bytes_atomic(path, proto)  # last: its existence means the entry is complete
  return sp
