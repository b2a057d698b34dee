r"""A trained model as a Hugging Face model directory, and a check that its logits agree.

  python -m odetransformer.export --workdir=W --out=DIR [--step=S] [--solver_steps=N] \
      [--dtype=float32|bfloat16] [--verify] [--overwrite] [--mesh_shape=1,-1,1]

One process restores the checkpoint sharded over its devices (the run's mesh, or
`--mesh_shape`) and gathers each weight to host memory as it writes it.

DIR then loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)`:

- the GPT baseline (kind 'transformer', family 'gpt2') as the standard `GPT2LMHeadModel`, the
  Llama baseline (kind 'transformer', family 'llama') as the standard `LlamaForCausalLM`;
- a DiffEqFormer or weight-sharing ODE, materialised at N Euler steps (default: the
  training K; `materialize.py`), and a discrete parallel-block model as
  `OdeTransformerForCausalLM`, the small parallel-block model of `hf_modeling.py`,
  shipped in DIR (`from_pretrained(DIR, trust_remote_code=True)`): no standard class
  has two norms feeding attention and MLP in parallel. dt is folded into the output
  projections. A midpoint or RK4 ODE is not one layer per step: it is refused;
- the run's SentencePiece tokenizer as `tokenizer.json` with the same ids
  (`hf_tokenizer.py`);
- `model.safetensors` (in shards with an index above `SHARD_BYTES`) and `config.json`
  (`hf_convert.py`), `generation_config.json` and a README.md card naming the run,
  step and N.

Weights are float32, or bfloat16 with `--dtype=bfloat16`. Only safetensors is needed
to export; `--verify` loads DIR with transformers and compares its logits and greedy
generations with this repository's model (`hf_verify.py`); it prints the error, writes
it into the card and exits 1 when they differ. A non-empty DIR is refused unless
`--overwrite`; DIR appears whole or not at all (`write_directory`). W and DIR may be
local paths or URLs (gs://...).
"""

import dataclasses
import json
import os
import shutil
import sys

from absl import flags
from flax import nnx
import jax
import ml_dtypes
import numpy as np

from odetransformer import cli_flags
from odetransformer.errors import UserError
from odetransformer.model.transformer import LanguageModel
from odetransformer.runtime import fileio
from odetransformer.runtime.logs import quiet_tool_logs
from odetransformer.tools import hf_tokenizer
from odetransformer.tools.hf_convert import (
  MODELING_FILE,
  SHARD_BYTES,
  check_exportable,
  discrete_model,
  hf_architecture,
  hf_config,
  hf_state_dict,
  safetensors_files,
)
from odetransformer.tools.hf_verify import verify
from odetransformer.train import loading

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


# --------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Exported:
  out: str
  model: LanguageModel  # the discrete model whose weights were written (float32)
  source: LanguageModel  # the run's model
  num_steps: int  # N
  dtype: str
  step: int
  workdir: str
  architecture: str
  sp_model: bytes  # the run's tokenizer: a SentencePiece model or a tokenizer.json
  context: int


def export(
  workdir: str,
  out: str,
  *,
  step: int | None = None,
  num_steps: int | None = None,
  dtype: str = "float32",
  allow_unverified: bool = False,
  mesh_shape: str = "",
  overwrite: bool = False,
) -> Exported:
  """Writes the Hugging Face directory `out` for checkpoint `step` (default: the
  latest) of run `workdir`, restored sharded on the run's mesh over this process's
  devices (or `mesh_shape`); see the module docstring."""
  if dtype not in DTYPES:
    raise UserError(f"--dtype={dtype!r} is unknown; choose one of {sorted(DTYPES)}")
  check_out(out, overwrite)
  if jax.process_count() > 1:
    raise UserError(
      "export runs as one process (its devices may be several); start it "
      "without JAX_COORDINATOR_ADDRESS or a multi-host launcher"
    )
  loaded = loading.load_model(
    workdir, step=step, mesh_shape=mesh_shape, allow_unverified=allow_unverified
  )
  sp_model = fileio.read_bytes(loading.tokenizer_path(workdir, loaded.config))
  return export_model(
    loaded.model,
    sp_model,
    out,
    context=loaded.config.batch.seq_len,
    num_steps=num_steps,
    dtype=dtype,
    workdir=workdir,
    step=loaded.step,
    overwrite=overwrite,
  )


def export_model(
  model: LanguageModel,
  sp_model: bytes,
  out: str,
  *,
  context: int,
  num_steps: int | None = None,
  dtype: str = "float32",
  workdir: str = "",
  step: int = 0,
  shard_bytes: int = SHARD_BYTES,
  overwrite: bool = False,
) -> Exported:
  """Writes `model` (its tokenizer: the SentencePiece `sp_model` or a tokenizer.json;
  `context`: its training sequence length) as the Hugging Face directory `out`
  (`write_directory`)."""
  check_out(out, overwrite)
  disc = nnx.jit(discrete_model, static_argnums=1)(model, num_steps)  # not op by op
  cfg = disc.config
  state = {k: v.astype(DTYPES[dtype]) for k, v in hf_state_dict(disc).items()}
  files = hf_tokenizer.tokenizer_files(
    sp_model, cfg.max_len if cfg.family == "gpt2" else context, where=f"of {workdir}"
  )
  special = hf_tokenizer.special_ids(sp_model)
  files["config.json"] = json.dumps(hf_config(cfg, context, dtype, special), indent=2)
  files["generation_config.json"] = json.dumps(special, indent=2)
  if hf_architecture(cfg) == "OdeTransformerForCausalLM":
    with open(os.path.join(os.path.dirname(__file__), "hf_modeling.py"), encoding="utf-8") as f:
      files[MODELING_FILE] = f.read()
  exported = Exported(
    out=out,
    model=disc,
    source=model,
    num_steps=cfg.depth,
    dtype=dtype,
    step=step,
    workdir=workdir,
    architecture=hf_architecture(cfg),
    sp_model=sp_model,
    context=context,
  )
  files["README.md"] = model_card(exported)
  files.update(safetensors_files(state, shard_bytes))
  write_directory(out, files, overwrite=overwrite)
  return exported


def check_out(out: str, overwrite: bool) -> None:
  """A one-line UserError when `out` is a file, or a non-empty directory and not
  `overwrite`: an export never merges into other files."""
  fileio.check_encodable(out, "--out")
  if fileio.exists(out) and not fileio.isdir(out):
    raise UserError(f"--out={out} is a file; pass a directory path")
  if not overwrite and fileio.isdir(out) and fileio.listdir(out):
    raise UserError(
      f"--out={out} is not empty; pass a new or empty directory, or "
      "--overwrite to replace what it holds"
    )


def write_directory(out: str, files: dict, overwrite: bool = False) -> None:
  """Writes `files` ({name: str or bytes}) as the directory `out`, never half of them:
  locally into a sibling staging directory renamed to `out` once complete (an old `out`
  moved aside first, deleted after). An object store (gs://) has no directory rename:
  `out` is emptied, then written with config.json last, so an interrupted export does
  not load (and a rerun with --overwrite replaces it)."""
  check_out(out, overwrite)
  names = sorted(files, key=lambda name: name == "config.json")  # config.json last

  def write(directory):
    for name in names:
      data = files[name]
      if isinstance(data, str):
        fileio.write_text_atomic(fileio.join(directory, name), data)
      else:
        fileio.write_bytes_atomic(fileio.join(directory, name), data)

  if not fileio.is_local(out):
    if fileio.isdir(out):
      fileio.rmtree(out)
    write(out)
    return
  target = os.path.abspath(out)
  parent, name = os.path.split(target)
  staging, old = (
    os.path.join(parent, f".{name}.{what}-{os.getpid()}") for what in ("partial", "old")
  )
  for leftover in (staging, old):  # of a killed export that had this process id
    shutil.rmtree(leftover, ignore_errors=True)
  os.makedirs(staging)
  try:
    write(staging)
    if os.path.isdir(target):
      os.rename(target, old)  # empty, or replaced (--overwrite): deleted below
    os.rename(staging, target)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    if os.path.isdir(old) and not os.path.exists(target):
      os.rename(old, target)  # put back what was there
    raise
  shutil.rmtree(old, ignore_errors=True)


def model_card(e: Exported, agreement: str = "") -> str:
  """README.md of the exported directory."""
  source_cfg = e.source.config
  what = (
    f"{source_cfg.kind} ODE ({source_cfg.family} family) materialised at "
    f"N={e.num_steps} {source_cfg.solver} steps (trained at K={source_cfg.depth})"
    if source_cfg.is_ode
    else f"discrete {source_cfg.kind} model ({source_cfg.family} family), {e.num_steps} layers"
  )
  remote = e.architecture == "OdeTransformerForCausalLM"
  trust = ", trust_remote_code=True" if remote else ""
  return "\n".join(
    [
      f"# {e.architecture} exported from odetransformer",
      "",
      f"- source run: `{e.workdir}`, checkpoint step {e.step}",
      f"- model: {what}; N = {e.num_steps}",
      f"- weights: {e.dtype}; class `{e.architecture}`"
      + (f" (`{MODELING_FILE}`, shipped here)" if remote else ""),
      "- tokenizer: the run's SentencePiece BPE as `tokenizer.json`, the same ids",
      f"- logit agreement: {agreement or 'not measured; run the export with --verify'}",
      "",
      "```python",
      "from transformers import AutoModelForCausalLM, AutoTokenizer",
      f"model = AutoModelForCausalLM.from_pretrained(DIR{trust})",
      f"tokenizer = AutoTokenizer.from_pretrained(DIR{trust})",
      "```",
      "",
    ]
  )


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def main(argv, flag_values=None):
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  f = flags.FLAGS if flag_values is None else flag_values
  quiet_tool_logs(cli=True)
  if f.step is not None and f.step < 0:
    raise UserError(
      f"--step={f.step} is not a checkpoint step; pass a step >= 0, or leave "
      "--step out for the latest"
    )
  if f.solver_steps is not None and f.solver_steps <= 0:
    raise UserError(
      f"--solver_steps={f.solver_steps} is not a step count; pass a positive "
      "integer, or leave it out for the training K"
    )
  check_out(f.out, f.overwrite)
  config = loading.load_run_config(f.workdir)  # refusals before loading anything
  check_exportable(config.model, f.solver_steps)
  if f.verify:
    try:
      import torch  # noqa: F401  lazy: optional deps, checked only for --verify
      import transformers  # noqa: F401
    except ModuleNotFoundError as e:
      raise UserError(
        f"--verify needs {e.name}; pip install -r requirements-export.txt, "
        "or export without --verify"
      ) from e
  loading.parse_mesh_shape(f.mesh_shape)
  e = export(
    f.workdir,
    f.out,
    step=f.step,
    num_steps=f.solver_steps,
    dtype=f.dtype,
    allow_unverified=f.checkpoint_allow_unverified,
    mesh_shape=f.mesh_shape,
    overwrite=f.overwrite,
  )
  print(
    f"exported step {e.step} of {f.workdir} to {f.out}: {e.architecture}, "
    f"N={e.num_steps}, {e.dtype}"
  )
  if f.verify:
    agreement = verify(e)
    print(f"verify: {agreement.describe()}")
    fileio.write_text_atomic(fileio.join(f.out, "README.md"), model_card(e, agreement.describe()))
    if not agreement.ok:
      print("verify FAILED: the export does not reproduce this model", file=sys.stderr)
      sys.exit(1)


def define_flags(flag_values=None):
  fv = flags.FLAGS if flag_values is None else flag_values
  define = cli_flags.definer(fv)
  define("string", "out", None, "Directory to write the Hugging Face model into.", required=True)
  define(
    "integer",
    "solver_steps",
    None,
    "Euler steps N an ODE is materialised at "
    "(default: the training K); discrete models: their own depth.",
  )
  define(
    "enum", "dtype", "float32", "Weights' dtype (float32 or bfloat16).", enum_values=sorted(DTYPES)
  )
  define(
    "bool",
    "overwrite",
    False,
    "Replace what --out holds (without it, a non-empty --out is refused).",
  )
  define(
    "bool",
    "verify",
    False,
    "Load the export with transformers (CPU) and compare "
    "logits and greedy generation with this model; exit 1 if they differ.",
  )
  loading.define_load_flags(define)
  return fv


if __name__ == "__main__":
  cli_flags.run_absl_tool(main, define_flags)
