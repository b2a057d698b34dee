"""Export to a Hugging Face directory: transformers (torch, CPU) loads each model kind and
gives our logits and greedy generations; the tokenizer gives SentencePiece's ids on real
text; a split_euler ODE exports as standard sequential blocks; higher-order ODEs are
refused; the command line's --verify passes on a trained run."""

import atexit
import json
import os
import pathlib
import shutil
import tempfile

from absl import flags
from conftest import shared_data_path
from flax import nnx
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import sentencepiece as spm

from odetransformer.errors import UserError
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import LanguageModel
from odetransformer.runtime import fileio
from odetransformer.tools import export, hf_verify
from odetransformer.train import loading, loop
from odetransformer.train.checkpoint.fingerprint import save_config

from tiny import tiny_config

# transformers copies a directory's modeling file into this cache (default: ~/.cache).
_MODULES = tempfile.mkdtemp(prefix="odet_hf_modules_")
atexit.register(shutil.rmtree, _MODULES, ignore_errors=True)
os.environ.setdefault("HF_MODULES_CACHE", _MODULES)
# torch and transformers are imported when the first test here runs, not when the suite is
# collected (every pytest worker collects every module: seconds each).
torch = transformers = safe_open = None


@pytest.fixture(scope="module", autouse=True)
def _torch_and_transformers():
  global torch, transformers, safe_open
  torch = pytest.importorskip(
    "torch",
    reason="export's --verify and these tests need torch "
    "and transformers (pip install -r requirements-export.txt)",
  )
  transformers = pytest.importorskip("transformers")
  # Tiny models: one thread per op is faster than two on a shared 2-core machine.
  torch.set_num_threads(1)
  from safetensors import safe_open  # comes with transformers: after its importorskip


pytestmark = [pytest.mark.xdist_group("test_export"), pytest.mark.slow]
MAX_LEN = 48  # room for a prompt and 32 generated tokens (learned positions)


def train_one_step(cache, workdir, init_from=None, finetune=None, **model_fields):
  """A 1-step run of `model_fields` on the embedded corpus (or a 1-step fine-tune of
  `init_from`), at a constant learning rate of 0.05 from the first step: Adam moves every
  trained parameter by about that much, so none is left at its initial value (zero
  biases, unit norm scales) and a misplaced one shows in the logits."""
  c = tiny_config(cache, num_train_steps=1)
  c.global_batch_size = c.eval_batch_size = 2
  c.data.eval_max_batches = 1
  c.model.max_len = MAX_LEN
  c.optim.learning_rate, c.optim.schedule, c.optim.warmup_frac = 0.05, "constant", 0.0
  for key, value in model_fields.items():
    c.model[key] = value
  if init_from:
    c.init_from = init_from
    c.finetune = ml_collections.ConfigDict(finetune)
  loop.train_and_evaluate(c, str(workdir))
  return str(workdir)


@pytest.fixture(scope="module")
def cache(shared_data_cache):
  return shared_data_cache


@pytest.fixture(scope="module")
def run(cache, tmp_path_factory):
  """A 1-step DiffEqFormer run (gpt family, K=2)."""
  return train_one_step(cache, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def sp_model(run):
  return pathlib.Path(loading.tokenizer_path(run)).read_bytes()


def model_of(kind, family, **options):
  """A tiny model of `kind` in memory, for the checks that need no trained run: random
  weights, none at its initial value (biases, norm shifts non-zero, norm scales 1 ±
  noise). Filled from numpy: no op-by-op compilation."""
  cfg = ModelConfig(
    kind=kind,
    family=family,
    vocab_size=512,
    d_model=32,
    num_heads=2,
    mlp_dim=64,
    solver_steps=2,
    num_layers=2,
    max_len=MAX_LEN,
    time_embed_dim=8,
    time_sinusoids=8,
    remat_policy="none",
    **options,
  )
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(3)
  flat = []
  for path, v in nnx.to_flat_state(state):
    x = rng.normal(size=v.shape) * 0.5 / np.sqrt(v.shape[-1])
    if any("scale" in str(p) for p in path) and path[-1] not in ("proj", "kernel"):
      x = x + 1.0
    flat.append((path, v.replace(jnp.asarray(x, jnp.float32))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def assert_agrees(e):
  a = hf_verify.verify(e)
  print(
    f"{e.architecture} ({e.source.config.kind}/{e.source.config.family}, {e.dtype}): {a.describe()}"
  )
  assert a.max_error <= hf_verify.TOLERANCE * a.scale, a.describe()
  assert a.ours == a.theirs and len(a.ours[1]) > 0
  assert a.tokens_equal
  return a


# Norm epsilon and RoPE base away from their defaults: the export must carry them.
_ODD = {"norm_eps": 1e-4, "rope_base": 500.0}


@pytest.mark.parametrize(
  "kind,family,options,dtype,architecture",
  [
    ("transformer", "gpt2", _ODD, "float32", "GPT2LMHeadModel"),
    ("transformer", "llama", {"tie_embeddings": False, **_ODD}, "bfloat16", "LlamaForCausalLM"),
    (
      "diffeqformer",
      "llama",
      {"llama_block": "reference", "step_time": "end", "tie_embeddings": False, **_ODD},
      "float32",
      "OdeTransformerForCausalLM",
    ),
    ("shared", "llama", _ODD, "float32", "OdeTransformerForCausalLM"),
    # LoRA fine-tuning of the DiffEqFormer run materialised at N = K: dt as the
    # out_proj_scale of parallel layers, adapters merged.
    (
      "parallel",
      "gpt2",
      {
        "finetune": dict(
          method="lora",
          solver_steps=2,
          lora_rank=2,
          lora_alpha=4.0,
          targets="wq,w2",
          lora_init="small",
          train_embeddings=False,
        )
      },
      "float32",
      "OdeTransformerForCausalLM",
    ),
  ],
)
def test_each_kind_loads_in_transformers_with_our_logits(
  kind, family, options, dtype, architecture, cache, run, sp_model, tmp_path
):
  """Each kind from a short trained run (the GPT-family DiffEqFormer:
  test_command_line_verify_on_a_trained_run)."""
  if "finetune" in options:
    workdir = train_one_step(cache, tmp_path / "run", init_from=run, **options)
  else:
    workdir = train_one_step(cache, tmp_path / "run", kind=kind, family=family, **options)
  loaded = loading.load_model(workdir)
  model = loaded.model
  assert (model.config.kind, model.config.family) == (kind, family)
  num_steps = 3 if model.config.is_ode else None  # N != K: a materialisation
  out = tmp_path / "hf"
  e = export.export_model(
    model,
    sp_model,
    str(out),
    context=loaded.config.batch.seq_len,
    num_steps=num_steps,
    dtype=dtype,
    shard_bytes=40_000,
  )
  assert e.architecture == architecture and e.num_steps == (num_steps or 2)
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == [architecture] and config["dtype"] == dtype
  assert ("auto_map" in config) == (architecture == "OdeTransformerForCausalLM")
  assert (out / export.MODELING_FILE).exists() == ("auto_map" in config)
  index = json.loads((out / "model.safetensors.index.json").read_text())  # sharded
  assert len(set(index["weight_map"].values())) > 1
  with safe_open(str(out / sorted(set(index["weight_map"].values()))[0]), "pt") as f:
    assert f.get_tensor(next(iter(f.keys()))).dtype == getattr(torch, dtype)
  assert_agrees(e)


def test_verify_fails_on_a_wrong_export(sp_model, tmp_path):
  """The check can fail: a directory whose config says another norm epsilon."""
  e = export.export_model(model_of("transformer", "gpt2"), sp_model, str(tmp_path), context=32)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(dict(config, layer_norm_epsilon=1e-2)))
  a = hf_verify.verify(e)
  assert not a.ok and a.max_error > hf_verify.TOLERANCE * a.scale and "NO" in a.describe()


def test_gcs_run_exports_to_gcs_as_it_does_locally(run, gcs_bucket, tmp_path):
  """A gs:// workdir exported to a gs:// directory: the same files as from local paths."""
  gs_run, gs_out = f"{gcs_bucket}/export-run", f"{gcs_bucket}/export-hf"
  fileio.copy_tree(run, gs_run)
  export.export(gs_run, gs_out, dtype="bfloat16")
  export.export(run, str(tmp_path / "hf"), dtype="bfloat16")
  names = sorted(os.listdir(tmp_path / "hf"))
  assert sorted(fileio.listdir(gs_out)) == names and "model.safetensors" in names
  for name in names:
    local = (tmp_path / "hf" / name).read_bytes()
    remote = fileio.read_bytes(fileio.join(gs_out, name))
    if name == "README.md":  # names the source run
      local = local.replace(run.encode(), gs_run.encode())
    assert remote == local, name


@pytest.mark.parametrize(
  "family,options,architecture",
  [
    ("llama", {"num_kv_heads": 1}, "LlamaForCausalLM"),  # grouped-query attention kept
    ("gpt2", {"step_time": "end"}, "GPT2LMHeadModel"),
  ],
)
def test_split_euler_ode_exports_as_standard_sequential_blocks(
  family, options, architecture, sp_model, tmp_path
):
  """A split_euler ODE materialised at N = 3 (K = 2) is 3 sequential GPT-2 / Llama
  blocks: a standard transformers class, no modeling file, whose logits and greedy
  tokens are those of our 3-step split_euler solve."""
  model = model_of("diffeqformer", family, solver="split_euler", **options)
  out = tmp_path / "hf"
  e = export.export_model(model, sp_model, str(out), context=32, num_steps=3)
  assert e.architecture == architecture and e.num_steps == 3
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == [architecture] and "auto_map" not in config
  assert config.get("num_key_value_heads", 2) == options.get("num_kv_heads", 2)
  assert not (out / export.MODELING_FILE).exists()
  assert_agrees(e)


@pytest.mark.parametrize("solver", ["midpoint", "rk4"])
def test_higher_order_ode_is_refused(solver, tmp_path):
  model = model_of("diffeqformer", "gpt2", solver=solver)
  with pytest.raises(UserError, match=f"solver is '{solver}'") as info:
    export.export_model(model, b"", str(tmp_path / "hf"), context=32)
  assert "\n" not in str(info.value) and "only an Euler ODE" in str(info.value)
  assert not (tmp_path / "hf").exists()


def test_command_line_refuses_rk4_before_loading(tmp_path):
  """A run's config.json alone (no checkpoint): the refusal comes before any loading."""
  c = tiny_config(tmp_path / "cache")
  c.model.solver = "rk4"
  save_config(c, str(tmp_path))
  fv = export.define_flags(flags.FlagValues())
  fv(["export", f"--workdir={tmp_path}", f"--out={tmp_path / 'hf'}"])
  with pytest.raises(UserError, match="solver is 'rk4'") as info:
    export.main(["export"], fv)
  assert "\n" not in str(info.value) and not (tmp_path / "hf").exists()


def test_discrete_model_keeps_its_depth(sp_model, tmp_path):
  with pytest.raises(UserError, match="has 2 layers; leave --solver_steps out"):
    export.export_model(
      model_of("transformer", "gpt2"), sp_model, str(tmp_path), context=32, num_steps=4
    )


def test_out_is_never_merged_into_nor_left_half_written(sp_model, tmp_path, monkeypatch):
  """A non-empty --out is refused as it was; --overwrite replaces it whole; an export
  that fails midway leaves --out as it was (or absent) and no staging directory."""
  model = model_of("transformer", "gpt2")
  out = tmp_path / "hf"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  with pytest.raises(UserError) as info:
    export.export_model(model, sp_model, str(out), context=32)
  assert str(info.value) == (
    f"--out={out} is not empty; pass a new or empty directory, "
    "or --overwrite to replace what it holds"
  )
  assert sorted(os.listdir(out)) == ["notes.txt"]
  written = []
  write_bytes = export.fileio.write_bytes_atomic

  def fail_on_the_weights(path, data):
    if str(path).endswith(".safetensors"):
      raise OSError(28, "No space left on device")
    written.append(path)
    write_bytes(path, data)

  monkeypatch.setattr(export.fileio, "write_bytes_atomic", fail_on_the_weights)
  for target, overwrite in ((out, True), (tmp_path / "new", False)):
    with pytest.raises(OSError, match="No space left"):
      export.export_model(model, sp_model, str(target), context=32, overwrite=overwrite)
  assert written and sorted(os.listdir(out)) == ["notes.txt"]
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # no staging, no "new"
  monkeypatch.undo()
  export.export_model(model, sp_model, str(out), context=32, overwrite=True)
  assert "notes.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
  assert sorted(os.listdir(tmp_path)) == ["hf"]
  (tmp_path / "empty").mkdir()  # an empty --out is fine
  export.export_model(model, sp_model, str(tmp_path / "empty"), context=32)
  assert sorted(os.listdir(tmp_path / "empty")) == sorted(os.listdir(out))


def test_tokenizer_gives_sentencepiece_ids_on_real_text(sp_model, tmp_path):
  page = shared_data_path("wikitext-2", "test.txt").read_text(encoding="utf-8")[:6000]
  text = (
    page + "\n\n   three  spaces,\ttab, 2026-11-25 3.14159 \u00e9t\u00e9 na\u00efve "
    "\u6771\u4eac \U0001f680 <unk> </s> <s>\n"
  )
  files = export.hf_tokenizer.tokenizer_files(sp_model, 32)
  for name, data in files.items():
    (tmp_path / name).write_text(data, encoding="utf-8")
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  sp = spm.SentencePieceProcessor(model_proto=sp_model)
  ids = tok.encode(text, add_special_tokens=False)
  assert ids == sp.encode(text)
  assert len(ids) > 1000 and any(i in range(4, 260) for i in ids)  # byte fallback ran
  # bos = eos: a document follows an eos in training, never SentencePiece's <s>
  assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (
    sp.eos_id(),
    sp.pad_id(),
    sp.eos_id(),
  )
  assert tok.decode(ids) == sp.decode(ids) == text
  assert tok.decode(ids + [sp.eos_id()], skip_special_tokens=True) == text
  assert tok.convert_ids_to_tokens(sp.eos_id()) == sp.id_to_piece(sp.eos_id())


def test_command_line_verify_on_a_trained_run(run, tmp_path, capsys):
  """The command line's flags, parsed and run in this process (as `python -m
  odetransformer.tools.export` runs them: test_flags checks that entry point; a failed
  --verify is its exit status 1, SystemExit here)."""
  out = tmp_path / "hf"
  fv = export.define_flags(flags.FlagValues())
  fv(["export", f"--workdir={run}", f"--out={out}", "--solver_steps=3", "--verify"])
  export.main(["export"], fv)
  line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("verify:"))
  print(line)
  assert "identical" in line and "yes" in line
  card = (out / "README.md").read_text()
  assert run in card and "step 1" in card and "N = 3" in card
  assert line[len("verify: ") :] in card
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
  assert model.config.num_hidden_layers == 3
  assert sorted(os.listdir(out)) == sorted(
    [
      "README.md",
      "config.json",
      "generation_config.json",
      "model.safetensors",
      export.MODELING_FILE,
      "tokenizer.json",
      "tokenizer_config.json",
    ]
  )
