"""Fine-tuning through the real entry point (train.train_and_evaluate with init_from)."""
import json

import ml_collections
import numpy as np
import pytest

from odetransformer import finetune, loading, metrics as metrics_lib, train
from odetransformer.materialize import materialize
from test_train import fast_compiles, tiny_config  # noqa: F401  (fixture: compile cache)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  base = tmp_path_factory.mktemp("pre")
  result = train.train_and_evaluate(tiny_config(base / "cache", 4), str(base / "run"))
  return base, result


def ft_config(pretrained, method, num_steps, steps=2, **finetune_kw):
  base, _ = pretrained
  c = tiny_config(base / "cache", steps)
  c.init_from = str(base / "run")
  fields = dict(method=method, num_steps=num_steps, lora_rank=2, lora_alpha=4.0,
                targets="wq,wo", train_embeddings=False)
  fields.update(finetune_kw)
  c.finetune = ml_collections.ConfigDict(fields)
  return c


def eval_losses(workdir):
  return dict(metrics_lib.read_scalars(str(workdir / "tensorboard"))["eval/loss"])


def test_continuous_at_other_steps_runs_and_resumes(pretrained, tmp_path):
  first = train.train_and_evaluate(ft_config(pretrained, "continuous", 5, steps=2), tmp_path)
  assert (first["start_step"], first["step"]) == (0, 2)
  saved = json.loads((tmp_path / "config.json").read_text())["model"]
  assert saved["kind"] == "diffeqformer" and saved["num_steps"] == 5
  again = train.train_and_evaluate(ft_config(pretrained, "continuous", 5, steps=4), tmp_path)
  assert (again["start_step"], again["step"]) == (2, 4)
  assert np.isfinite(again["eval"]["loss"])


def test_full_at_training_k_starts_at_the_ode_loss(pretrained, tmp_path):
  """Materialised at N = K, step 0 evaluates the same function as the pre-trained ODE."""
  _, pre = pretrained
  train.train_and_evaluate(ft_config(pretrained, "full", 0, steps=2), tmp_path)
  np.testing.assert_allclose(eval_losses(tmp_path)[0], pre["eval"]["loss"], rtol=1e-5)
  assert json.loads((tmp_path / "config.json").read_text())["model"]["kind"] == "parallel"


def test_lora_with_embeddings_changes_only_adapters_and_embeddings(pretrained, tmp_path):
  base, _ = pretrained
  train.train_and_evaluate(ft_config(pretrained, "lora", 3, train_embeddings=True), tmp_path)
  tuned = loading.load_model(str(tmp_path)).model
  reference = materialize(loading.load_model(str(base / "run")).model, 3)
  for name, w in reference.stack.params.items():   # frozen layers: bit for bit
    np.testing.assert_array_equal(np.asarray(tuned.stack.params[name][...]), np.asarray(w[...]))
  assert not np.array_equal(np.asarray(tuned.embed[...]), np.asarray(reference.embed[...]))
  b = np.asarray(tuned.stack.lora["wq"]["b"][...])
  assert np.abs(b).max() > 0   # adapters moved away from B = 0


def test_mismatched_width_is_a_clear_error(pretrained, tmp_path):
  c = ft_config(pretrained, "full", 0)
  c.model.d_model = 64
  with pytest.raises(ValueError, match=r"model.d_model=64 differs from the pre-trained"):
    train.train_and_evaluate(c, tmp_path / "ft")
  assert not (tmp_path / "ft").exists()


def test_continuous_needs_an_ode_pretrained_model(pretrained, tmp_path):
  base, _ = pretrained
  pre = json.loads((base / "run" / "config.json").read_text())
  pre["model"]["kind"] = "gpt"      # the same run's config, as if it were a GPT baseline
  (tmp_path / "config.json").write_text(json.dumps(pre))
  c = ft_config(pretrained, "continuous", 3)
  c.init_from = str(tmp_path)
  with pytest.raises(finetune.FinetuneError, match="'continuous' needs an ODE model"):
    finetune.finetune_model_config(c)
