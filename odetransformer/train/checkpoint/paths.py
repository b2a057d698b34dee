"""Where a run's files live in its workdir, and which of its checkpoints are complete.

  config.json                  the run's full config (`fingerprint.save_config`)
  tokenizer.model              the run's tokenizer, copied in (`fingerprint.save_tokenizer`):
  or tokenizer.json            a SentencePiece model, or an imported model's Hugging Face one
  checkpoints/<step>/          one checkpoint (`manager.Checkpointer`)
  .save_owners/<step>.json     the run writing that step
  corrupt_checkpoints/         checkpoints set aside because they do not restore

A local step is complete once orbax renamed its temporary directory
(`<step>.orbax-checkpoint-tmp-<ts>`) to `<step>`; on an object store, where there is no
rename, once `<step>/` holds `commit_success.txt`.
"""

import json
import re

from odetransformer.errors import UserError
from odetransformer.runtime import fileio

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"  # the run's tokenizer, copied into its workdir
HF_TOKENIZER_FILE = "tokenizer.json"  # ... when it is a Hugging Face one (an imported model's)
TOKENIZER_FILES = (TOKENIZER_FILE, HF_TOKENIZER_FILE)
OWNERS_DIR = ".save_owners"  # <step>.json: the run that writes that step
COMMIT_FILE = "commit_success.txt"  # orbax's mark of a complete step on object stores
_TMP_STEP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")  # a local step being written


def is_hf_tokenizer(blob: bytes) -> bool:
  """Whether a tokenizer file's bytes are a Hugging Face tokenizer.json (JSON) rather
  than a SentencePiece model (protobuf). (`input_pipeline.tokenizer` has its own copy:
  it may not import train/.)"""
  return blob.lstrip()[:1] == b"{"


def tokenizer_file(blob: bytes) -> str:
  """The workdir name of a tokenizer file with these bytes: tokenizer.json for a Hugging
  Face tokenizer, else tokenizer.model (a SentencePiece model)."""
  return HF_TOKENIZER_FILE if is_hf_tokenizer(blob) else TOKENIZER_FILE


class CheckpointError(UserError, RuntimeError):
  """A workdir's checkpoints cannot be used or written (reported in one line)."""


def finalized_steps(workdir: str) -> list:
  """Steps with a complete checkpoint, ascending: plain integer directories (on an
  object store: those holding orbax's commit file)."""
  directory = checkpoint_dir(workdir)
  steps = [int(n) for n in fileio.listdir(directory) if n.isdigit()]
  if fileio.is_local(directory):
    return sorted(s for s in steps if fileio.isdir(fileio.join(directory, str(s))))
  return sorted(s for s in steps if fileio.exists(fileio.join(directory, str(s), COMMIT_FILE)))


def unfinished_steps(workdir: str) -> list:
  """[(step, directory)] of the checkpoints being written, or left by a run that
  stopped mid-save."""
  directory = checkpoint_dir(workdir)
  names = fileio.listdir(directory)
  if fileio.is_local(directory):
    found = [(int(m.group(1)), n) for n in names for m in [_TMP_STEP.match(n)] if m]
  else:
    found = [
      (int(n), n)
      for n in names
      if n.isdigit() and not fileio.exists(fileio.join(directory, n, COMMIT_FILE))
    ]
  return sorted((step, fileio.join(directory, name)) for step, name in found)


def checkpoint_dir(workdir: str) -> str:
  return fileio.join(workdir, CHECKPOINT_DIR)


def read_json(path: str) -> dict | None:
  """The JSON object in `path`; None when it is missing, unreadable or not an object."""
  try:
    value = json.loads(fileio.read_text(path))
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


def error_line(e: BaseException) -> str:
  """`<Type>: message` of `e` on one line, at most 300 characters."""
  text = " ".join(str(e).split())
  text = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return text[:300] + ("…" if len(text) > 300 else "")
