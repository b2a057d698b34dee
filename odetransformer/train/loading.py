"""Load a trained model (and its tokenizer) from a training workdir.

For tools that need only the model — evaluation, generation, materialisation,
analysis, fine-tuning's `init_from` — this restores just the checkpoint's `model`
item, sharded: on the run's own mesh (`config.mesh.shape` and its logical-axis rules,
over every device of the job) unless a tool's `--mesh_shape` says otherwise, restored
straight into abstract targets carrying that mesh's NamedShardings (no process ever
holds the whole model unless the mesh replicates it). A run whose mesh does not fit the
devices at hand (trained on 256 chips, evaluated on 8) is loaded fully sharded
(fsdp over all devices) with a warning. Multi-process tools call
`host.initialize_distributed()` first, as main.py does.
"""

import dataclasses

from absl import logging
from flax import nnx
import jax
from jax.experimental import multihost_utils
import numpy as np

from odetransformer.errors import ConfigError, UserError
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import LanguageModel, create_model
from odetransformer.runtime import fileio
from odetransformer.train import sharding
from odetransformer.train.checkpoint.fingerprint import load_config
from odetransformer.train.checkpoint.integrity import UNVERIFIED_FLAG_HELP
from odetransformer.train.checkpoint.paths import CONFIG_FILE, TOKENIZER_FILES
from odetransformer.train.checkpoint.restore import restore_model_state
from odetransformer.train.run_config import MeshConfig, RunConfig

MESH_SHAPE_HELP = (
  "Device mesh (data,fsdp,tensor) to load the model on, e.g. 1,-1,1 "
  "(-1 = the remaining devices); '' = the run's config.mesh.shape."
)


@dataclasses.dataclass
class Loaded:
  model: LanguageModel
  model_config: ModelConfig
  config: RunConfig  # the run's settings (`load_run_config`)
  step: int
  mesh: jax.sharding.Mesh | None = None  # the model's arrays live on it
  rules: tuple = ()  # the logical-axis rules they follow


def define_load_flags(define) -> None:
  """The flags of every command that loads a run (evaluate, generate, export, spectra,
  lyapunov): --workdir (required), --step, --mesh_shape, --checkpoint_allow_unverified,
  --verbose. `define(kind, name, default, help, **kw)` defines one flag (`cli_flags.definer`)."""
  define(
    "string", "workdir", None, "Training run directory (config.json + checkpoints/).", required=True
  )
  define("integer", "step", None, "Checkpoint step (default: the latest).")
  define("string", "mesh_shape", "", MESH_SHAPE_HELP)
  define("bool", "checkpoint_allow_unverified", False, UNVERIFIED_FLAG_HELP)
  define("bool", "verbose", False, "Show the traceback of a user error as well.")


def parse_mesh_shape(text: str) -> tuple:
  """A `--mesh_shape` value: '2,-1,1', '(2,-1,1)' or '[2, -1, 1]' -> (2, -1, 1);
  '' -> () (the run's own). Raises a one-line UserError otherwise."""
  inner = text.strip().strip("()[]").strip()
  if not inner:
    return ()
  try:
    shape = tuple(int(v) for v in inner.split(","))
  except ValueError:
    shape = ()
  if len(shape) != len(sharding.MESH_AXES) or any(s == 0 or s < -1 for s in shape):
    raise UserError(
      f"--mesh_shape={text!r}: expected {len(sharding.MESH_AXES)} comma-separated "
      f"sizes for {sharding.MESH_AXES}, each positive or -1 (the rest), "
      "e.g. --mesh_shape=1,-1,1"
    )
  return shape


def run_mesh(config: RunConfig, mesh_shape: str = "", devices=None) -> jax.sharding.Mesh:
  """The mesh a tool loads run `config` on, over `devices` (default: all of the job's).

  `mesh_shape` (a `--mesh_shape` value) when given, else the run's `mesh.shape`; when
  the run's shape does not fit these devices, fsdp over all of them (with a warning).
  """
  devices = list(jax.devices() if devices is None else devices)
  override = parse_mesh_shape(mesh_shape)
  if override:
    try:
      return sharding.make_mesh(MeshConfig(shape=override), devices)
    except sharding.MeshError as e:
      raise UserError(f"--mesh_shape={mesh_shape}: {e}") from e
  run_shape = config.mesh.shape
  try:
    return sharding.make_mesh(config.mesh, devices)
  except sharding.MeshError as e:
    logging.warning(
      "the run's mesh.shape=%s does not fit these %d devices (%s): loading "
      "fully sharded, mesh (1, %d, 1); choose with --mesh_shape",
      run_shape,
      len(devices),
      e,
      len(devices),
    )
    return sharding.make_mesh(MeshConfig(shape=(1, -1, 1)), devices)


def load_run_config(workdir: str) -> RunConfig:
  """The settings of the run in `workdir` (its config.json), the model at the data's
  vocabulary size; a missing or unreadable one is a UserError. Cheap: tools validate
  their flags against it before loading anything."""
  fileio.check_encodable(workdir, "--workdir")
  try:
    config = RunConfig.from_config(load_config(workdir), recorded=True)
    return config.replace(
      model=dataclasses.replace(config.model, vocab_size=config.data.vocab_size)
    )
  except ConfigError as e:
    raise UserError(f"{fileio.join(workdir, CONFIG_FILE)}: {e}") from e
  except (FileNotFoundError, NotADirectoryError) as e:
    raise UserError(
      f"{workdir} holds no training run ({CONFIG_FILE} "
      "missing, no checkpoint); pass the --workdir of a main.py run"
    ) from e
  except (OSError, ValueError) as e:
    raise UserError(
      f"{fileio.join(workdir, CONFIG_FILE)} is unreadable "
      f"({type(e).__name__}: {e}); it describes the run's checkpoints: "
      "restore it, or resume the run with main.py to rewrite it"
    ) from e


def load_model(
  workdir: str,
  step: int | None = None,
  mesh=None,
  *,
  mesh_shape: str = "",
  rules=None,
  allow_unverified: bool = False,
) -> Loaded:
  """The model of the latest (or given) checkpoint in `workdir` that restores.

  Restored sharded on `mesh` (default: `run_mesh(config, mesh_shape)`) under `rules`
  (default: the run's logical-axis rules). Raises a one-line UserError when there is no
  run, no checkpoint or none restores (one without its integrity record only with
  `allow_unverified`).
  """
  config = load_run_config(workdir)
  cfg = config.model
  mesh = run_mesh(config, mesh_shape) if mesh is None else mesh
  rules = config.mesh.rules if rules is None else rules
  with nnx.logical_axis_rules(rules):
    graphdef, abstract = nnx.get_abstract_model(lambda: create_model(cfg), mesh)
  state, restored_step = restore_model_state(workdir, abstract, step, allow_unverified)
  return Loaded(
    model=nnx.merge(graphdef, state),
    model_config=cfg,
    config=config,
    step=int(restored_step),
    mesh=mesh,
    rules=tuple(rules),
  )


def model_mesh(tree) -> jax.sharding.Mesh | None:
  """The mesh a model's (or a state's) arrays live on; None when they are not placed by
  a NamedSharding (a model created outside a mesh)."""
  for leaf in jax.tree.leaves(tree):
    s = getattr(leaf, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
      return s.mesh
  return None


def global_array(x, sharding_: jax.sharding.Sharding) -> jax.Array:
  """A host value that every process holds in full, as a global array with `sharding_`
  (each process places its own devices' pieces; multi-process safe)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding_, lambda index: x[index])


def to_host(x, dtype=None) -> np.ndarray:
  """A (possibly multi-process) array as numpy on every process: its shards on other
  processes' devices are gathered (a collective: every process must call it)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x, dtype)


def workdir_tokenizer(workdir: str) -> str | None:
  """`<workdir>/tokenizer.model` or `<workdir>/tokenizer.json`, whichever it holds."""
  for name in TOKENIZER_FILES:
    if fileio.exists(path := fileio.join(workdir, name)):
      return path
  return None


def tokenizer_path(workdir: str, config: RunConfig | None = None) -> str:
  """The file of a run's tokenizer (a local copy of a remote one: SentencePiece reads
  local files).

  `<workdir>/tokenizer.model` or `tokenizer.json` (written by main.py at start, or by
  the import) if present, else `data.tokenizer_path`, else the tokenizer the run's data
  config trained and cached (found, or re-created deterministically, by
  `input_pipeline.create_datasets`).
  """
  path = workdir_tokenizer(workdir)
  if path:
    return fileio.local_copy(path)
  config = load_run_config(workdir) if config is None else config
  if config.data.tokenizer_path and fileio.exists(config.data.tokenizer_path):
    return fileio.local_copy(config.data.tokenizer_path)
  import input_pipeline  # lazy: grain and tensorflow_datasets (~2 s), only for this fallback

  ds = input_pipeline.create_datasets(
    config.data,
    seq_len=config.batch.seq_len,
    global_batch_size=1,
    eval_batch_size=1,
    seed=config.batch.seed,
    workdir=workdir,
    process_index=0,
    process_count=1,
  )
  logging.warning(
    "%s has no %s: using the tokenizer its data config caches (%s)",
    workdir,
    " or ".join(TOKENIZER_FILES),
    ds.tokenizer_path,
  )
  return ds.tokenizer_path


def load_tokenizer(workdir: str, config: RunConfig | None = None):
  """The run's tokenizer: a SentencePiece processor (pad=0, unk=1, bos=2, eos=3) or, for
  an imported model, its Hugging Face tokenizer (`input_pipeline.tokenizer.HFTokenizer`)."""
  # lazy: input_pipeline imports grain and tfds (~2 s), which model-only tools never need
  from input_pipeline import tokenizer as tokenizer_lib

  config = load_run_config(workdir) if config is None else config
  return tokenizer_lib.load(tokenizer_path(workdir, config), config.data.vocab_size)
