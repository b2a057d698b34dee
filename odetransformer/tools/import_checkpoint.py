r"""A pretrained GPT-2 or Llama checkpoint as a run's workdir, restored like any other.

  python -m odetransformer.import_checkpoint --from=PATH --workdir=W [--seq_len=S]

PATH is a Hugging Face model directory (config.json with model.safetensors, its sharded
index or pytorch_model.bin, and its tokenizer: tokenizer.json, or GPT-2's vocab.json and
merges.txt) or a llama GGUF file (its weights dequantised, its BPE tokenizer inside).
`GPT2LMHeadModel` becomes the gpt2 baseline and `LlamaForCausalLM` the llama baseline
(`hf_import.py`: grouped-query attention, the RoPE base, norm eps and tied or untied
embeddings from its config). W then holds what a training run's workdir holds:

  config.json          the run config (model: the baseline; data: the tokenizer's
                       vocabulary; seq_len: --seq_len)
  tokenizer.json       the checkpoint's own tokenizer (same ids)
  checkpoints/0/       the weights as step 0 (with their integrity record)
  import.json          where they came from

so `evaluate`, `generate`, `export`, `lm_eval` and the analysis tools take `--workdir=W`,
and `python main.py --config=... --config.init_from=W` fine-tunes it (full or LoRA) or
trains it on. W must not exist (or be empty); it is written beside itself and renamed
into place once complete, so a failed import leaves nothing.
"""

import dataclasses
import json
import os
import time

from absl import logging
from flax import nnx
import jax
import ml_collections
import numpy as np

from odetransformer import cli_flags, errors
from odetransformer.errors import UserError
from odetransformer.runtime import fileio, logs
from odetransformer.tools import hf_import, ode_fit
from odetransformer.train.checkpoint import fingerprint as fingerprint_lib
from odetransformer.train.checkpoint.manager import Checkpointer
from odetransformer.train.checkpoint.paths import HF_TOKENIZER_FILE
from odetransformer.train.run_config import RunConfig, model_record

IMPORT_FILE = "import.json"
# The checkpoint's optimizer item: an imported model has no optimizer state (orbax refuses
# an empty item). Training from it starts a new optimizer (`--config.init_from=W`).
NO_OPTIMIZER = nnx.State({"imported": np.zeros((), np.int32)})
DEFAULT_SEQ_LEN = 2048  # the recorded context when --seq_len is not given (at most the model's)


@dataclasses.dataclass(frozen=True)
class Source:
  """A checkpoint read into memory.

  Attributes:
    hf: its config.json as a dict (a GGUF file's, rebuilt from its metadata).
    weights: {transformers parameter name: float32 array}.
    tokenizer: the tokenizer.json bytes.
    format: 'safetensors', 'pytorch' or 'gguf'.
  """

  hf: dict
  weights: dict
  tokenizer: bytes
  format: str


def read_source(path: str) -> Source:
  """Reads a model directory or a GGUF file (module docstring)."""
  if os.path.isdir(path):
    hf, weights = hf_import.read_hf_dir(path)
    names = os.listdir(path)
    fmt = "safetensors" if any(n.endswith(".safetensors") for n in names) else "pytorch"
    return Source(hf, weights, _dir_tokenizer(path), fmt)
  if os.path.isfile(path):
    with open(path, "rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise UserError(
        f"--from={path} is neither a model directory nor a GGUF file; pass a Hugging Face "
        "model directory (config.json and weights) or a .gguf file"
      )
    hf, weights = hf_import.read_gguf(path)
    return Source(hf, weights, _gguf_tokenizer(path), "gguf")
  raise UserError(f"--from={path} does not exist; pass a model directory or a .gguf file")


def _transformers():
  try:
    import transformers  # lazy: optional (requirements-export.txt)
  except ModuleNotFoundError as e:
    raise UserError(
      "converting this checkpoint's tokenizer needs transformers; pip install -r "
      "requirements-export.txt"
    ) from e
  transformers.logging.set_verbosity_error()
  return transformers


def _dir_tokenizer(path: str) -> bytes:
  """The directory's tokenizer.json, or one transformers converts from vocab.json and
  merges.txt (GPT-2's slow-tokenizer files)."""
  file = os.path.join(path, HF_TOKENIZER_FILE)
  if os.path.isfile(file):
    with open(file, "rb") as f:
      return f.read()
  if not os.path.isfile(os.path.join(path, "vocab.json")):
    raise UserError(
      f"{path} holds no tokenizer (tokenizer.json, or vocab.json and merges.txt); copy the "
      "model's tokenizer files into it"
    )
  tok = _transformers().AutoTokenizer.from_pretrained(path, use_fast=True)
  return tok.backend_tokenizer.to_str().encode("utf-8")


def _gguf_tokenizer(path: str) -> bytes:
  """The GGUF file's BPE tokenizer as a tokenizer.json (transformers' conversion, the
  one its own GGUF load uses)."""
  try:
    tok = _transformers().AutoTokenizer.from_pretrained(
      os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
    )
  except (ValueError, KeyError, NotImplementedError) as e:
    raise UserError(
      f"the tokenizer in {path} cannot be read ({str(e).splitlines()[0]}); the import reads "
      "llama GGUF files with a BPE ('gpt2') or SentencePiece ('llama') tokenizer"
    ) from e
  return tok.backend_tokenizer.to_str().encode("utf-8")


def run_config(cfg, vocab_size: int, seq_len: int) -> RunConfig:
  """The run config recorded for an imported model of config `cfg`."""
  record = ml_collections.ConfigDict(
    {
      "model": model_record(cfg),
      "data": {"vocab_size": vocab_size, "tokenizer_path": ""},
      "seq_len": seq_len,
    }
  )
  return RunConfig.from_config(record, recorded=True)


def check_tokenizer(blob: bytes, cfg) -> None:
  """UserError unless the tokenizer reads (`HFTokenizer`) and has one id per embedding row."""
  from input_pipeline import tokenizer as tokenizer_lib  # lazy: grain and tfds (~2 s)

  try:
    tok = tokenizer_lib.HFTokenizer(blob, "the checkpoint's tokenizer")
  except tokenizer_lib.DataError as e:
    raise UserError(str(e)) from e
  if tok.get_piece_size() != cfg.vocab_size:
    raise UserError(
      f"the checkpoint's tokenizer has {tok.get_piece_size()} tokens but its embeddings "
      f"{cfg.vocab_size} rows; the import needs one row per token (vocab_size in config.json "
      "equal to the tokenizer's)"
    )


def check_workdir(workdir: str) -> None:
  """UserError when `workdir` exists and is not empty."""
  if fileio.isdir(workdir) and fileio.listdir(workdir):
    raise UserError(
      f"--workdir={workdir} is not empty; import into a new directory (an import never "
      "replaces a run)"
    )
  if fileio.exists(workdir) and not fileio.isdir(workdir):
    raise UserError(f"--workdir={workdir} is a file; pass a directory path")


def write_workdir(workdir: str, model, config: RunConfig, tokenizer: bytes, provenance: dict):
  """Writes the workdir (module docstring) beside `workdir` and renames it into place
  once complete; nothing is left when a step fails."""
  check_workdir(workdir)
  stage = f"{workdir.rstrip('/')}.importing-{os.getpid()}"
  fileio.rmtree(stage)
  try:
    fileio.makedirs(stage)
    fileio.write_bytes_atomic(fileio.join(stage, HF_TOKENIZER_FILE), tokenizer)
    data = dataclasses.replace(
      config.data, tokenizer_path=fileio.absolute(fileio.join(workdir, HF_TOKENIZER_FILE))
    )
    config = config.replace(data=data)
    fingerprint_lib.save_config(config.record, stage)
    sha = fingerprint_lib.tokenizer_sha256(fileio.join(stage, HF_TOKENIZER_FILE))
    ckpt = Checkpointer(
      stage,
      max_to_keep=1,
      async_save=False,
      fingerprint=fingerprint_lib.fingerprint(config.record, sha),
    )
    try:
      meta = {"imported": provenance}
      ckpt.save(0, model, NO_OPTIMIZER, meta=meta, data_state=None, force=True)
    finally:
      ckpt.close()
    fileio.write_text_atomic(fileio.join(stage, IMPORT_FILE), json.dumps(provenance, indent=1))
    if fileio.isdir(workdir):  # empty (check_workdir)
      fileio.rmtree(workdir)
    fileio.move(stage, workdir)
  finally:
    try:
      fileio.rmtree(stage)
    except OSError as e:  # an error on its way out is the one to report
      logging.warning("could not remove %s (%s); delete it by hand", stage, e)
  return config


FITS = ("", "diffeqformer")


def import_checkpoint(
  path: str, workdir: str, seq_len: int | None = None, fit: str = "", fit_time_embed_dim: int = 0
) -> RunConfig:
  """Reads `path`, builds the matching baseline (or, with `fit='diffeqformer'`, the
  DiffEqFormer fitted to it: `ode_fit.py`) and writes `workdir`; returns its config."""
  if fit not in FITS:
    raise UserError(f"--fit={fit!r} is unknown; pass --fit=diffeqformer or leave it out")
  check_workdir(workdir)
  started = time.time()
  src = read_source(path)
  cfg = hf_import.model_config_from_hf(src.hf)
  check_tokenizer(src.tokenizer, cfg)
  if fit:
    ode_fit.fit_config(cfg, fit_time_embed_dim or None)  # refusals before the weights load
  context = cfg.max_len
  seq_len = min(context, DEFAULT_SEQ_LEN) if seq_len is None else seq_len
  if not 0 < seq_len <= context:
    raise UserError(
      f"--seq_len={seq_len} is outside the model's context (1..{context}); pass a length within it"
    )
  model = hf_import.model_from_hf(cfg, src.weights)
  read_seconds = time.time() - started
  fitted = None
  if fit:
    started = time.time()
    model, fitted = ode_fit.fit_diffeqformer(model, fit_time_embed_dim or None)
    print(f"fitted a DiffEqFormer in {time.time() - started:.1f}s: {fitted.describe()}")
  config = run_config(model.config, cfg.vocab_size, seq_len)
  provenance = {
    "from": os.path.abspath(path),
    "format": src.format,
    "architecture": src.hf.get("architectures", [""])[0],
    "parameters": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
    "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "read_seconds": round(read_seconds, 1),
  }
  if fitted is not None:
    provenance["fit"] = {
      "kind": "diffeqformer",
      "solver": "split_euler",
      "time_embed_dim": fitted.time_embed_dim,
      "sinusoids": fitted.sinusoids,
      "condition": fitted.condition,
      "relative_errors": fitted.errors,
      "seconds": round(time.time() - started, 1),
    }
  return write_workdir(workdir, model, config, src.tokenizer, provenance)


def define_flags(define) -> None:
  define(
    "string", "from", None, "A Hugging Face model directory or a llama .gguf file.", required=True
  )
  define(
    "string", "workdir", None, "The new run directory to write (must not exist).", required=True
  )
  define(
    "enum",
    "fit",
    "",
    "diffeqformer: write the DiffEqFormer fitted to the checkpoint (split_euler at K = L "
    "reproduces it; odetransformer/tools/ode_fit.py) instead of the baseline.",
    enum_values=list(FITS),
  )
  define(
    "integer",
    "fit_time_embed_dim",
    0,
    "--fit's code width d_t (0: the layer count rounded up to a multiple of 8, the "
    "smallest exact fit; fewer gives a least-squares fit).",
  )
  define(
    "integer",
    "seq_len",
    None,
    f"Context length recorded for fine-tuning and export (default: the model's, at most "
    f"{DEFAULT_SEQ_LEN}).",
  )


def main(argv=None) -> RunConfig:
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  logs.quiet_tool_logs(cli=True)
  config = import_checkpoint(
    getattr(args, "from"), args.workdir, args.seq_len, args.fit, args.fit_time_embed_dim
  )
  m = config.model
  what = (
    f"DiffEqFormer ({m.family}, split_euler at K={m.depth}, d_t {m.time_embed_dim})"
    if m.is_ode
    else f"{m.family} baseline, {m.depth} layers"
  )
  print(
    f"imported {getattr(args, 'from')} into {args.workdir}: {what}, d {m.d_model}, "
    f"{m.num_heads} heads "
    f"({m.kv_heads} key/value), vocabulary {m.vocab_size}, seq_len {config.batch.seq_len}"
  )
  return config


if __name__ == "__main__":
  errors.run_cli(main)
