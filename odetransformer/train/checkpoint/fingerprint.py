"""What a run's checkpoints depend on, checked before a resume writes anything.

Each checkpoint's `meta` records the run's fingerprint (`fingerprint`): what its arrays
mean — the model config, the data source and split, the tokenizer file's hash — and
what makes a resume exact — the training data's content hash, the batch shape and the
seed — so that a resume with other settings is refused before anything is written
(`check_resumable`, `check_tokenizer`); `resume_with_changes` accepts the latter
knowingly. Also the run's `config.json` and the copy of its tokenizer in the workdir.
"""

import dataclasses
import json

from absl import logging
import jax
import ml_collections

from odetransformer.errors import ConfigError
from odetransformer.model.config import (
  ModelConfig,
  default_model_config,
  migrate_model_fields,
  unread_fields,
)
from odetransformer.runtime import fileio
from odetransformer.train.checkpoint.paths import (
  CONFIG_FILE,
  checkpoint_dir,
  finalized_steps,
  read_json,
  tokenizer_file,
)
from odetransformer.train.run_config import migrate_config

# Model fields that may change between a run and its resumption: no effect on the
# checkpointed arrays or on what they mean (vocab_size is the tokenizer's, compared as
# data.vocab_size).
RESUMABLE_MODEL_FIELDS = (
  "vocab_size",
  "remat_policy",
  "dtype",
  "state_dtype",
  "attention_impl",
  "layer_loop",
)
# The data settings that decide what the run trains on and with which tokenizer.
FINGERPRINT_DATA_FIELDS = (
  "source",
  "train_split",
  "train_files",
  "text_key",
  "vocab_size",
  "tokenizer_sample_bytes",
)


# What makes a resume continue the run exactly: the batch shape and the seed.
RESUME_FIELDS = ("global_batch_size", "seq_len", "seed")
# Differences that `resume_with_changes` cannot accept: the arrays would mean something
# else (another model, vocabulary or tokenizer).
ARRAY_MEANING_DIFFS = (
  "model.",
  "data.vocab_size ",
  "data.tokenizer_sample_bytes ",
  "tokenizer file ",
)


def file_sha256(path: str) -> str:
  return fileio.sha256(path)


def fingerprint(record, tokenizer_sha256: str | None = None, data_hash: str | None = None) -> dict:
  """What a run's checkpoints depend on, as plain JSON values.

  `record`: the run's config as it records it (`RunConfig.record`, a dict; or a
  ConfigDict).

  The model config (less `RESUMABLE_MODEL_FIELDS`), the data source and split and the
  settings that train its tokenizer, the batch shape and seed (`RESUME_FIELDS`), the
  tokenizer file's sha256 and the training data's content hash (each None while not
  known yet).
  """
  if isinstance(record, ml_collections.ConfigDict):
    record = record.to_dict()
  plain = json.loads(json.dumps(record, default=list))
  model = {k: v for k, v in plain.get("model", {}).items() if k not in RESUMABLE_MODEL_FIELDS}
  data = {k: plain.get("data", {}).get(k) for k in FINGERPRINT_DATA_FIELDS}
  resume = {k: plain.get(k) for k in RESUME_FIELDS}
  return {
    "model": model,
    "data": data,
    "resume": resume,
    "tokenizer_sha256": tokenizer_sha256,
    "data_content_hash": data_hash,
  }


# ModelConfig's fields at their defaults, as a fingerprint records them (JSON values).
_MODEL_DEFAULTS = {
  k: v
  for k, v in json.loads(json.dumps(default_model_config().to_dict(), default=list)).items()
  if k in {f.name for f in dataclasses.fields(ModelConfig)}
}


def fingerprint_diffs(old: dict, new: dict) -> list:
  """'section.key old -> new' for each difference between two fingerprints.

  A None hash (not known yet, or a checkpoint written before hashes) matches any. When
  the new run names its tokenizer file, the hash decides and the settings that would
  train one (tokenizer_sample_bytes) do not matter. A model field one side lacks was
  added to the code since: it compares as its ModelConfig default, the behaviour of the
  code before it (a config that sets it otherwise, as configs/default.py's
  local_error_weight, is a change). Other keys only one side has (dropped since) are
  skipped, and so are the fields that neither side's model reads (`unread_fields`: the
  depth field its kind does not use, λ of a discrete kind, its stride where λ is 0).
  """
  diffs = []
  for section in ("model", "data", "resume"):
    a, b = old.get(section) or {}, new.get(section) or {}
    if section == "model":  # a run written before a rename compares under the new names
      a, b = migrate_model_fields(a, warn=False), migrate_model_fields(b, warn=False)
      a, b = {**_MODEL_DEFAULTS, **a}, {**_MODEL_DEFAULTS, **b}
      for unread in unread_fields(a) & unread_fields(b):  # as num_layers of an ODE
        a.pop(unread, None), b.pop(unread, None)
    for key in sorted(set(a) & set(b)):
      if section == "model" and key in RESUMABLE_MODEL_FIELDS:
        continue
      if key == "tokenizer_sample_bytes" and new.get("tokenizer_sha256"):
        continue
      if a.get(key) != b.get(key):
        diffs.append(f"{section}.{key} {a.get(key)!r} -> {b.get(key)!r}")
  a, b = old.get("tokenizer_sha256"), new.get("tokenizer_sha256")
  if a and b and a != b:
    diffs.append(f"tokenizer file sha256 {a[:12]}… -> {b[:12]}…")
  a, b = old.get("data_content_hash"), new.get("data_content_hash")
  if a and b and a != b:
    diffs.append(f"training data content {a[:40]!r} -> {b[:40]!r}")
  return diffs


def stored_fingerprint(workdir: str) -> tuple | None:
  """(step, fingerprint) of the newest checkpoint whose meta reads; None if none.

  Checkpoints written before fingerprints were recorded give one made from the config
  their meta holds (no tokenizer hash).
  """
  directory = checkpoint_dir(workdir)
  for step in reversed(finalized_steps(workdir)):
    meta = read_json(fileio.join(directory, str(step), "meta", "metadata"))
    if meta is None:
      continue
    if isinstance(meta.get("fingerprint"), dict):
      return step, meta["fingerprint"]
    if isinstance(meta.get("config"), dict):
      return step, fingerprint(meta["config"])
  return None


def tokenizer_sha256(path: str | None) -> str | None:
  return fileio.sha256(path) if path and fileio.isfile(path) else None


def check_resumable(record: dict, tokenizer_path: str, workdir: str, accept_changes: bool):
  """ConfigError when `workdir` holds checkpoints of another model, data or tokenizer,
  or of other batch settings (unless `accept_changes`: `resume_with_changes`).

  Compares the run's config (`record`, as `fingerprint` takes it) with the fingerprint
  the newest checkpoint records: model fields, data source and split, batch shape and
  seed, and — when `tokenizer_path` names a file — its hash; otherwise the settings that
  would train the tokenizer. Runs before anything is written (no tokenizer trained, no
  config.json rewritten), so a refused workdir stays exactly as it was. Returns the
  stored fingerprint (None: no checkpoint).
  """
  found = stored_fingerprint(workdir)
  if found is None:
    return None
  step, stored = found
  new = fingerprint(record, tokenizer_sha256(tokenizer_path))
  _refuse_if_different(accept_changes, workdir, step, stored, new)
  return stored


def check_tokenizer(
  record: dict,
  tokenizer_path: str,
  workdir: str,
  stored: dict | None,
  data_hash: str | None = None,
  accept_changes: bool = False,
) -> dict:
  """The run's fingerprint, with its tokenizer's hash and its training data's content
  hash (`Datasets.content_hash`); ConfigError when a resumed run's tokenizer file or
  data differ from the checkpoints' (before the tokenizer is copied into the workdir).
  """
  new = fingerprint(record, tokenizer_sha256(tokenizer_path), data_hash)
  if stored is not None:
    step = finalized_steps(workdir)[-1]
    diffs = _refuse_if_different(accept_changes, workdir, step, stored, new)
    if diffs:
      logging.warning(
        "resuming with changes (resume_with_changes=true): %s; the run no longer continues exactly",
        "; ".join(diffs),
      )
  return new


def _refuse_if_different(
  accept_changes: bool, workdir: str, step: int, stored: dict, new: dict
) -> list:
  """ConfigError naming the differences, unless there are none or all are accepted
  (`accept_changes`: `resume_with_changes`); returns the accepted ones."""
  diffs = fingerprint_diffs(stored, new)
  if not diffs:
    return []
  if any(d.startswith(ARRAY_MEANING_DIFFS) for d in diffs):
    raise ConfigError(
      f"{workdir} holds checkpoints (step {step}) of a different model, data or "
      f"tokenizer ({'; '.join(diffs)}); resume with the same settings, start a new "
      "--workdir, or fine-tune from this run with --config.init_from"
    )
  if not accept_changes:
    raise ConfigError(
      f"{workdir} holds checkpoints (step {step}) trained on other data or batch "
      f"settings ({'; '.join(diffs)}); resume with the same settings, pass "
      "--config.resume_with_changes=true to continue from them anyway (no longer an "
      "exact resume), or start a new --workdir"
    )
  return diffs


def save_tokenizer(src: str, workdir: str):
  """Copies the tokenizer to `<workdir>/tokenizer.model` (what the tools load), or to
  `<workdir>/tokenizer.json` when it is a Hugging Face one."""
  if jax.process_index() != 0 or not src:
    return
  path = fileio.join(workdir, tokenizer_file(fileio.read_bytes(src)))
  if fileio.same_file(src, path):
    return
  if fileio.isfile(path) and fileio.sha256(path) == fileio.sha256(src):
    return  # a resumed run's own tokenizer: left as it is
  fileio.copy(src, path)


def save_config(record, workdir: str):
  """Writes `<workdir>/config.json` (process 0 only): `record`, the run's config as a
  dict (`RunConfig.record`) or a ConfigDict."""
  if jax.process_index() != 0:
    return
  if not isinstance(record, ml_collections.ConfigDict):
    record = ml_collections.ConfigDict(record)
  fileio.makedirs(workdir)
  fileio.write_text_atomic(
    fileio.join(workdir, CONFIG_FILE), record.to_json_best_effort(indent=2, sort_keys=True)
  )


def load_config(workdir: str):
  """The ConfigDict a run in `workdir` was started with.

  From `<workdir>/config.json`; when that is gone, from the newest checkpoint's meta
  (which holds the same config), with a warning. FileNotFoundError when neither exists.
  A run written before a rename comes back under the new names (`migrate_config`).
  """
  path = fileio.join(workdir, CONFIG_FILE)
  if not fileio.exists(path):
    for step in reversed(finalized_steps(workdir)):
      meta = read_json(fileio.join(checkpoint_dir(workdir), str(step), "meta", "metadata"))
      if isinstance((meta or {}).get("config"), dict):
        logging.warning("%s is missing: using the config recorded in checkpoint %d", path, step)
        return migrate_config(ml_collections.ConfigDict(meta["config"]), warn=False)
  return migrate_config(ml_collections.ConfigDict(json.loads(fileio.read_text(path))), warn=False)
