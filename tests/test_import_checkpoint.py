"""`python -m odetransformer.import_checkpoint`: a Hugging Face checkpoint becomes a workdir
that evaluate, export and fine-tuning restore like a trained run's, with the checkpoint's
own tokenizer; bad input is one line and leaves nothing."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from test_hf_import import _gpt2, _llama, _saved
from test_train import fast_compiles  # noqa: F401  (fixture: compile cache)

from odetransformer.errors import UserError
from odetransformer.model.materialize import materialize
from odetransformer.tools import export, hf_import, hf_verify, ode_fit
from odetransformer.tools import import_checkpoint as importer
from odetransformer.train import loading, loop
from odetransformer.train import metrics as metrics_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.matmul_precision("highest")

TEXT = (
  "The river rises in the hills north of the town and flows south through farmland, "
  "where it is joined by two streams before it reaches the sea. "
)
DOC = "The town grew around its mill, and the mill around the river that turned it."


def _tokenizer(vocab_size: int = 300):
  """A byte-level BPE (GPT-2's kind) with <|endoftext|>, trained on a few sentences."""
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator([TEXT * 20, DOC * 5], trainer)
  return tok


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  """A tiny grouped-query Llama with tied embeddings and its tokenizer.json."""
  path = tmp_path_factory.mktemp("llama")
  tok = _tokenizer()
  model = _saved(_llama(tie=True, vocab_size=tok.get_vocab_size(), num_key_value_heads=2), path)
  tok.save(str(path / "tokenizer.json"))
  return path, model, tok


@pytest.fixture(scope="module")
def imported(llama_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("imported") / "w"
  config = importer.main([f"--from={llama_dir[0]}", f"--workdir={workdir}"])
  return workdir, config


def _ids(tok, text):
  return tok.encode(text, add_special_tokens=False).ids


def test_the_workdir_restores_the_checkpoints_model_and_tokenizer(llama_dir, imported):
  _, hf_model, tok = llama_dir
  workdir, config = imported
  assert sorted(os.listdir(workdir)) == [
    "checkpoints",
    "config.json",
    "import.json",
    "tokenizer.json",
  ]
  assert config.model.num_kv_heads == 2 and config.model.tie_embeddings
  assert config.data.vocab_size == tok.get_vocab_size() == config.model.vocab_size
  assert json.loads((workdir / "import.json").read_text())["architecture"] == "LlamaForCausalLM"
  loaded = loading.load_model(str(workdir))
  assert loaded.step == 0 and loaded.model_config == config.model
  tokens = np.random.default_rng(0).integers(0, tok.get_vocab_size(), (2, 16))
  with torch.no_grad():
    expected = hf_model(torch.as_tensor(tokens)).logits.numpy()
  ours = np.asarray(loaded.model(jnp.asarray(tokens, jnp.int32)), np.float32)
  assert np.max(np.abs(ours - expected)) <= 1e-6 * np.max(np.abs(expected))
  ours_tok = loading.load_tokenizer(str(workdir), loaded.config)
  assert ours_tok.encode(TEXT + DOC) == _ids(tok, TEXT + DOC)
  assert ours_tok.decode(ours_tok.encode(DOC)) == DOC
  assert ours_tok.eos_id() == tok.token_to_id("<|endoftext|>")


def test_evaluate_scores_a_document_as_transformers_does(llama_dir, imported, tmp_path):
  """Tokenised by the imported tokenizer, packed with its separator, scored by the model:
  the loss of a one-document file equals the mean next-token loss transformers gives
  (each token of the document and the separator after it scored once)."""
  from odetransformer.tools import evaluate

  _, hf_model, tok = llama_dir
  workdir, _ = imported
  (tmp_path / "doc.txt").write_text(DOC)
  loaded = loading.load_model(str(workdir))
  data = evaluate.eval_data(
    str(workdir), loaded.config, data=f"local:{tmp_path}/doc.txt", batch_size=2
  )
  result = evaluate.evaluate_model(loaded.model, data.batches(), None)
  eos = tok.token_to_id("<|endoftext|>")
  doc = _ids(tok, DOC)
  # The first token is scored after the separator alone (a document of its own), the
  # rest and the closing separator within the document.
  with torch.no_grad():
    logits = torch.cat(
      [hf_model(torch.as_tensor([[eos]])).logits[0], hf_model(torch.as_tensor([doc])).logits[0]]
    )
  targets = torch.as_tensor(doc + [eos])
  expected = torch.nn.functional.cross_entropy(logits, targets).item()
  assert result.num_tokens == len(doc) + 1
  np.testing.assert_allclose(result.loss, expected, rtol=1e-5)


def test_export_of_the_import_is_the_checkpoint_again(llama_dir, imported, tmp_path):
  """export then transformers' load: the same weights and tokenizer file, logits and 32
  greedy tokens equal (export's own check)."""
  workdir, _ = imported
  e = export.export(str(workdir), str(tmp_path / "hf"))
  agreement = hf_verify.verify(e)
  assert agreement.ok and agreement.tokens_equal, agreement.describe()
  assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
    llama_dir[0] / "tokenizer.json"
  ).read_bytes()
  hf_back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
  for name, value in llama_dir[1].state_dict().items():
    assert torch.equal(hf_back.state_dict()[name], value), name


@pytest.fixture(scope="module")
def fitted(llama_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("fitted") / "w"
  importer.main([f"--from={llama_dir[0]}", f"--workdir={workdir}", "--fit=diffeqformer"])
  return workdir


@pytest.mark.parametrize(
  "source, method, n",
  [("imported", "full", None), ("fitted", "lora", 1), ("fitted", "continuous", 3)],
)
@pytest.mark.usefixtures("fast_compiles")
def test_finetuning_starts_from_the_imported_model(source, method, n, request, tmp_path):
  """configs/finetune_imported.py with the workdir as its argument: the first evaluation
  is the imported (or fitted, at N) model's loss on that data; training moves it."""
  from configs import finetune_imported
  from odetransformer.tools import evaluate

  workdir = request.getfixturevalue(source)
  workdir = workdir[0] if isinstance(workdir, tuple) else workdir
  c = finetune_imported.get_config(str(workdir))
  c.finetune.method, c.finetune.solver_steps = method, n
  c.num_train_steps, c.eval_every_steps, c.log_every_steps = 2, 2, 1
  c.global_batch_size = c.eval_batch_size = 2
  c.seq_len = 32
  c.data.eval_max_batches = 1
  c.data.cache_dir = str(tmp_path / "cache")
  loop.train_and_evaluate(c, str(tmp_path / "ft"))
  losses = dict(metrics_lib.read_scalars(str(tmp_path / "ft" / "tensorboard"))["eval/loss"])
  loaded = loading.load_model(str(workdir))
  data = evaluate.eval_data(
    str(workdir),
    loaded.config,
    data=f"local:{c.data.eval_files}",
    batch_size=2,
    seq_len=32,
    max_batches=1,
  )
  first = evaluate.evaluate_model(loaded.model, data.batches(), n)
  np.testing.assert_allclose(losses[0], first.loss, rtol=1e-5)
  assert losses[2] != losses[0]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
  """A tiny GPT-2 with an untied head and the slow tokenizer's files (vocab.json,
  merges.txt) instead of a tokenizer.json."""
  path = tmp_path_factory.mktemp("gpt2")
  tok = _tokenizer()
  tok.model.save(str(path))
  model = _saved(_gpt2(tie=False, vocab_size=tok.get_vocab_size()), path)
  return path, model, tok


def _equal_logits(ours, hf_model, vocab_size, rtol=1e-6):
  tokens = np.random.default_rng(1).integers(0, vocab_size, (2, 12))
  with torch.no_grad():
    expected = hf_model(torch.as_tensor(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)), np.float32)
  error = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
  assert error <= rtol, error
  return error


def test_gpt2_vocab_and_merges_become_a_tokenizer_json(gpt2_dir, tmp_path):
  path, model, tok = gpt2_dir
  config = importer.main([f"--from={path}", f"--workdir={tmp_path / 'w'}", "--seq_len=12"])
  assert config.model.family == "gpt2" and not config.model.tie_embeddings
  assert config.batch.seq_len == 12
  ours = loading.load_tokenizer(str(tmp_path / "w"))
  assert ours.encode(TEXT) == _ids(tok, TEXT)
  _equal_logits(loading.load_model(str(tmp_path / "w")).model, model, tok.get_vocab_size())


# ------------------------------------------------------------------- the DiffEqFormer fit
@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_the_fitted_diffeqformer_is_the_stack_at_n_equals_l(which, llama_dir, gpt2_dir):
  """split_euler at K = L: the pretrained function (float32 rounding), every layer's
  weights generated back; the parallel Euler field on the same weights is not it."""
  path, hf_model, tok = llama_dir if which == "llama" else gpt2_dir
  hf, weights = hf_import.read_hf_dir(str(path))
  base = hf_import.model_from_hf(hf_import.model_config_from_hf(hf), weights)
  ode, fit = ode_fit.fit_diffeqformer(base)
  depth = base.config.depth
  assert ode.config.kind == "diffeqformer" and ode.config.depth == depth
  assert fit.time_embed_dim == 8 >= depth and max(fit.errors.values()) <= 1e-6
  _equal_logits(ode, hf_model, tok.get_vocab_size())
  layers = materialize(ode, depth).layer_weights(jnp.float32)
  for name, w in base.layer_weights(jnp.float32).items():
    scale = float(jnp.max(jnp.abs(w)))
    assert float(jnp.max(jnp.abs(layers[name] - w))) <= 1e-6 * scale, name
  with pytest.raises(AssertionError):
    _equal_logits(ode_fit.parallel_field(ode), hf_model, tok.get_vocab_size(), rtol=1e-3)


def test_a_narrower_code_is_a_least_squares_fit(gpt2_dir):
  """d_t < L: not every layer can be reproduced; the reported error says by how much,
  and it is the error of the weights the model generates."""
  hf, weights = hf_import.read_hf_dir(str(gpt2_dir[0]))
  base = hf_import.model_from_hf(hf_import.model_config_from_hf(hf), weights)
  ode, fit = ode_fit.fit_diffeqformer(base, time_embed_dim=1)
  assert fit.time_embed_dim == 1 and max(fit.errors.values()) > 0.05  # not exact
  generated = ode.stack.step_weights(jnp.asarray(ode_fit.layer_times(2)), jnp.float32)["w1"]
  w1 = np.asarray(base.layer_weights(jnp.float32)["w1"])
  worst = max(np.linalg.norm(generated[k] - w1[k]) / np.linalg.norm(w1[k]) for k in range(2))
  np.testing.assert_allclose(fit.errors["w1"], worst, rtol=1e-5)


def test_the_fitted_workdir_exports_the_original_checkpoint(llama_dir, tmp_path):
  """--fit=diffeqformer, then export at N = L: transformers' LlamaForCausalLM computes the
  original checkpoint's logits; evaluate runs it at any N."""
  path, hf_model, tok = llama_dir
  workdir = tmp_path / "w"
  config = importer.main([f"--from={path}", f"--workdir={workdir}", "--fit=diffeqformer"])
  assert (config.model.kind, config.model.solver, config.model.depth) == (
    "diffeqformer",
    "split_euler",
    2,
  )
  fit = json.loads((workdir / "import.json").read_text())["fit"]
  assert fit["time_embed_dim"] == 8 and max(fit["relative_errors"].values()) <= 1e-6
  e = export.export(str(workdir), str(tmp_path / "hf"))
  assert e.architecture == "LlamaForCausalLM"
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  tokens = torch.as_tensor(np.random.default_rng(2).integers(0, tok.get_vocab_size(), (2, 12)))
  with torch.no_grad():
    expected, got = hf_model(tokens).logits.numpy(), back(tokens).logits.numpy()
  assert np.max(np.abs(got - expected)) <= 1e-5 * np.max(np.abs(expected))


# ------------------------------------------------------------------------- bad input
def _refused(tmp_path, source, match, workdir=None):
  workdir = workdir or tmp_path / "w"
  with pytest.raises(UserError, match=match) as e:
    importer.main([f"--from={source}", f"--workdir={workdir}"])
  assert "\n" not in str(e.value)
  assert not os.path.exists(workdir) or not os.listdir(workdir)
  assert not [n for n in os.listdir(os.path.dirname(workdir)) if ".importing-" in n]


def _copy(llama_dir, tmp_path, names):
  """A new model directory holding `names` of the tiny Llama's files."""
  src = tmp_path / "src"
  src.mkdir()
  for name in names:
    (src / name).write_bytes((llama_dir[0] / name).read_bytes())
  return src


def test_an_unsupported_architecture_names_the_supported_ones(llama_dir, tmp_path):
  src = _copy(llama_dir, tmp_path, ("model.safetensors", "tokenizer.json"))
  hf = json.loads((llama_dir[0] / "config.json").read_text())
  hf["architectures"] = ["MistralForCausalLM"]
  (src / "config.json").write_text(json.dumps(hf))
  _refused(tmp_path, src, "MistralForCausalLM.*GPT2LMHeadModel and LlamaForCausalLM")


def test_a_tokenizer_of_another_size_is_refused(llama_dir, tmp_path):
  src = _copy(llama_dir, tmp_path, ("model.safetensors", "config.json"))
  _tokenizer(280).save(str(src / "tokenizer.json"))
  _refused(tmp_path, src, "tokenizer has 280 tokens but its embeddings 300 rows")


def test_a_directory_without_a_tokenizer_is_refused(llama_dir, tmp_path):
  src = _copy(llama_dir, tmp_path, ("model.safetensors", "config.json"))
  _refused(tmp_path, src, "holds no tokenizer")


def test_a_file_that_is_not_gguf_and_a_missing_path_are_refused(tmp_path):
  (tmp_path / "x.bin").write_bytes(b"not a model")
  _refused(tmp_path, tmp_path / "x.bin", "neither a model directory nor a GGUF file")
  _refused(tmp_path, tmp_path / "nothing", "does not exist")


def test_a_run_is_never_replaced(llama_dir, imported, tmp_path):
  workdir, _ = imported
  before = sorted(p for p in os.listdir(workdir))
  with pytest.raises(UserError, match="is not empty"):
    importer.main([f"--from={llama_dir[0]}", f"--workdir={workdir}"])
  assert sorted(os.listdir(workdir)) == before


def test_a_failed_write_leaves_nothing(llama_dir, tmp_path, monkeypatch):
  def broken_save(self, *a, **kw):
    raise OSError("disk full")

  monkeypatch.setattr(importer.Checkpointer, "save", broken_save)
  with pytest.raises(OSError, match="disk full"):
    importer.main([f"--from={llama_dir[0]}", f"--workdir={tmp_path / 'w'}"])
  assert os.listdir(tmp_path) == []


def test_an_unknown_fit_is_refused(llama_dir, tmp_path):
  with pytest.raises(UserError, match="--fit"):
    importer.main([f"--from={llama_dir[0]}", f"--workdir={tmp_path / 'w'}", "--fit=mamba"])
  assert os.listdir(tmp_path) == []


def test_seq_len_beyond_the_context_is_refused(llama_dir, tmp_path):
  with pytest.raises(UserError, match=r"--seq_len=65 is outside the model's context \(1..64\)"):
    importer.main([f"--from={llama_dir[0]}", f"--workdir={tmp_path / 'w'}", "--seq_len=65"])
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_import_fit_benchmark_end_to_end(llama_dir, tmp_path, capsys):
  """benchmarks.import_fit at toy size: the fitted model at N = L scores the imported
  model's perplexity (the last line's ratio), the table holds every N, and a rerun reads
  every stage back instead of running it."""
  from benchmarks import import_fit

  (tmp_path / "text.txt").write_text((TEXT + DOC + "\n\n") * 4)
  argv = [
    f"--from={llama_dir[0]}",
    f"--eval_text={tmp_path / 'text.txt'}",
    f"--train_text={tmp_path / 'text.txt'}",
    f"--workdir={tmp_path / 'w'}",
    "--seq_len=32",
    "--batch_size=2",
    "--max_batches=1",
    "--finetune_steps=1",
    "--finetune_batch=2",
  ]
  import_fit.main(argv)
  out = capsys.readouterr().out
  results = json.loads((tmp_path / "w" / "results.json").read_text())
  base = results["ppl_imported"]["perplexity"]
  assert results["ppl_split_N2"]["perplexity"] == pytest.approx(base, rel=1e-5)
  assert {f"ppl_split_N{n}" for n in (1, 2, 4, 8)} <= results.keys()
  assert results["finetune_full_N1"]["ppl_before"] == pytest.approx(
    results["ppl_split_N1"]["perplexity"], rel=1e-4
  )
  assert out.strip().splitlines()[-1] == "import_fit: ppl(N=L) / ppl(imported) = 1.0000"
  import_fit.main(argv)
  again = capsys.readouterr().out
  assert again.count("(kept from an earlier run)") == len(results)
