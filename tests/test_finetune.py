"""Fine-tuning through the real entry point (loop.train_and_evaluate with init_from),
and what a fine-tuning update of a materialised ODE means at each N."""

import dataclasses
import json

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_model import forward  # one jitted program per model structure
from test_train import fast_compiles, tiny_config  # noqa: F401  (fixture: compile cache)

from odetransformer.model.config import ModelConfig
from odetransformer.model.materialize import materialize
from odetransformer.model.solvers import stage_times
from odetransformer.model.transformer import create_model
from odetransformer.train import finetune, loading, loop
from odetransformer.train import metrics as metrics_lib
from odetransformer.train.run_config import RunConfig

pytestmark = pytest.mark.slow
# Under pytest-xdist the tests of each module fixture below run on one worker, so that
# it is made once (the two groups may run on two).
PRETRAINED_GROUP = pytest.mark.xdist_group("test_finetune")
ODE_GROUP = pytest.mark.xdist_group("test_finetune_ode")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A 6-step tiny run: the programs of test_train's runs (its init, train and eval
  steps compile once in the session, for whichever module runs first)."""
  base = tmp_path_factory.mktemp("pre")
  result = loop.train_and_evaluate(tiny_config(base / "cache", 6), str(base / "run"))
  return base, result


def ft_config(pretrained, method, num_steps, steps=2, **finetune_kw):
  base, _ = pretrained
  c = tiny_config(base / "cache", steps)
  c.init_from = str(base / "run")
  fields = dict(
    method=method,
    solver_steps=num_steps,
    lora_rank=2,
    lora_alpha=4.0,
    targets="wq,wo",
    train_embeddings=False,
    lora_init="zero_b",
  )
  fields.update(finetune_kw)
  c.finetune = ml_collections.ConfigDict(fields)
  return c


def eval_losses(workdir):
  return dict(metrics_lib.read_scalars(str(workdir / "tensorboard"))["eval/loss"])


@PRETRAINED_GROUP
def test_continuous_at_other_steps_runs_and_resumes(pretrained, tmp_path):
  """A 4-step run stopped at step 2 (as a preemption would), then resumed: one compiled
  train step for both (the schedule's length is a constant of it)."""
  config = ft_config(pretrained, "continuous", 5, steps=4)
  first = loop.train_and_evaluate(config, tmp_path, stop_at_step=2)
  assert (first["start_step"], first["step"]) == (0, 2)
  saved = json.loads((tmp_path / "config.json").read_text())["model"]
  assert saved["kind"] == "diffeqformer" and saved["solver_steps"] == 5
  again = loop.train_and_evaluate(ft_config(pretrained, "continuous", 5, steps=4), tmp_path)
  assert (again["start_step"], again["step"]) == (2, 4)
  assert np.isfinite(again["eval"]["loss"])


@PRETRAINED_GROUP
def test_full_at_training_k_starts_at_the_ode_loss(pretrained, tmp_path):
  """Materialised at N = K, step 0 evaluates the same function as the pre-trained ODE."""
  _, pre = pretrained
  loop.train_and_evaluate(ft_config(pretrained, "full", 0, steps=2), tmp_path)
  np.testing.assert_allclose(eval_losses(tmp_path)[0], pre["eval"]["loss"], rtol=1e-5)
  assert json.loads((tmp_path / "config.json").read_text())["model"]["kind"] == "parallel"


@PRETRAINED_GROUP
def test_lora_with_embeddings_changes_only_adapters_and_embeddings(pretrained, tmp_path, caplog):
  base, _ = pretrained
  c = ft_config(pretrained, "lora", 3, train_embeddings=True, lora_init="small")
  start = finetune.initial_model_state(
    RunConfig.from_config(c), finetune.finetune_model_config(RunConfig.from_config(c))
  )
  b0 = np.asarray(nnx.to_pure_dict(start)["stack"]["lora"]["wq"]["b"])
  assert b0.shape == (3, 2, 32) and 0 < np.abs(b0).max() < 1e-5  # 1e-6·N(0, 1)
  with caplog.at_level("WARNING"):
    loop.train_and_evaluate(c, tmp_path)
    tuned = loading.load_model(str(tmp_path)).model
  # The pre-trained K is no setting of the user's: neither the run nor a tool warns of it.
  assert "is not used by kind" not in caplog.text, caplog.text
  assert tuned.config.kind == "parallel" and tuned.config.depth == 3
  assert tuned.config.out_proj_scale == pytest.approx(1 / 3)
  reference = materialize(loading.load_model(str(base / "run")).model, 3, fold_dt=False)
  for name, w in reference.stack.params.items():  # frozen layers: bit for bit
    np.testing.assert_array_equal(np.asarray(tuned.stack.params[name][...]), np.asarray(w[...]))
  assert not np.array_equal(np.asarray(tuned.embed[...]), np.asarray(reference.embed[...]))
  # That the adapters train (and help): test_lora_steps_lower_the_held_out_loss.


@PRETRAINED_GROUP
def test_lora_steps_lower_the_held_out_loss(pretrained, tmp_path):
  """Four LoRA steps (rank 2 on every layer matrix, B = 0 at the start, lr 3e-2) lower
  the eval split's loss by at least 0.03 nats from step 0's (the pre-trained model's
  function), while the layers and embeddings stay bit for bit: the gain is the
  adapters'. (0.069 nats measured; held-out: the eval split is not trained on.)"""
  base, _ = pretrained
  c = ft_config(pretrained, "lora", 4, steps=4, targets="wq,wk,wv,wo,w1,w2")
  c.optim.learning_rate = 3e-2
  c.eval_every_steps = 4
  loop.train_and_evaluate(c, tmp_path)
  losses = eval_losses(tmp_path)
  assert sorted(losses) == [0, 4]
  assert losses[4] <= losses[0] - 0.03, losses
  tuned = loading.load_model(str(tmp_path)).model
  reference = materialize(loading.load_model(str(base / "run")).model, 4, fold_dt=False)
  for name, w in reference.stack.params.items():
    np.testing.assert_array_equal(np.asarray(tuned.stack.params[name][...]), np.asarray(w[...]))
  np.testing.assert_array_equal(np.asarray(tuned.embed[...]), np.asarray(reference.embed[...]))


ODE = ModelConfig(
  vocab_size=61,
  d_model=16,
  num_heads=2,
  mlp_dim=32,
  solver_steps=4,
  num_layers=4,
  max_len=16,
  time_embed_dim=4,
  time_sinusoids=4,
  remat_policy="none",
)


def _ode_and_tokens(seed=0):
  model = create_model(ODE, seed=seed)
  # The reference init makes W(t) tiny; give P0 unit-scale values so that every layer,
  # and a wrong factor of N on one of its updates, shows in the logits.
  for name, gen in model.stack.gens.items():
    gen.base[...] = 0.3 * jax.random.normal(jax.random.key(len(name)), gen.base.shape)
  toks = jax.random.randint(jax.random.key(seed + 1), (2, 12), 0, ODE.vocab_size)
  return model, toks


@pytest.fixture(scope="module")
def ode():
  """`_ode_and_tokens()`, made once for the tests below (none of them changes it)."""
  return _ode_and_tokens()


@ODE_GROUP
def test_unfolded_materialisation_stores_w_of_t_and_keeps_dt_as_a_scale(ode):
  """fold_dt=False stores W(t_k) itself (what full fine-tuning updates, as the authors'
  evaluate_at does) and computes the same function as the folded model and the ODE."""
  model, toks = ode
  for n in (2, 5):
    unfolded, folded = materialize(model, n, fold_dt=False), materialize(model, n)
    assert (unfolded.config.out_proj_scale, folded.config.out_proj_scale) == (1 / n, 1.0)
    w_t = {
      k: w[:, 0] for k, w in model.stack.step_weights(stage_times(n, "euler"), jnp.float32).items()
    }
    for name, w in unfolded.stack.params.items():
      np.testing.assert_array_equal(np.asarray(w[...]), np.asarray(w_t[name]))
    np.testing.assert_allclose(
      np.asarray(folded.stack.params["wo"][...]), np.asarray(w_t["wo"]) / n, rtol=1e-6
    )
    solved = np.asarray(forward(model, toks, num_steps=n))
    np.testing.assert_allclose(np.asarray(forward(unfolded, toks)), solved, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(forward(folded, toks)), solved, atol=2e-5, rtol=2e-5)


@ODE_GROUP
@pytest.mark.parametrize("target", ["wo", "w2", "wq"])
def test_lora_update_means_the_same_at_every_n(ode, target):
  """A LoRA update ΔW at every layer of the N-layer model equals the ODE with ΔW added
  to W(t) at every t, solved with N steps: ΔW lies under dt like W (the authors' code
  multiplies each materialised layer's output by dt). Adding ΔW after dt was folded into
  W_O / W_2 (scale 1 instead of dt) fails this for the output projections."""
  model, toks = ode
  spec = model.stack.specs[target]
  n_in = int(np.prod(spec.shape[: spec.n_in]))
  n_out = int(np.prod(spec.shape[spec.n_in :]))
  rank, alpha = 3, 6.0
  a = 0.5 * jax.random.normal(jax.random.key(7), (n_in, rank))
  b = 0.5 * jax.random.normal(jax.random.key(8), (rank, n_out))
  delta = ((alpha / rank) * a @ b).reshape(spec.shape)
  shifted = nnx.clone(model)  # `model` with its own variables: the shift stays in it
  shifted.stack.gens[target].base[...] = model.stack.gens[target].base[...] + delta

  def with_adapter(base, n):
    cfg = dataclasses.replace(base.config, lora_rank=rank, lora_alpha=alpha, lora_targets=(target,))
    # Its structure only (no initial values): every array is set below, by `base` or
    # to the adapter (a value left unset would fail the call).
    lora = nnx.eval_shape(lambda: create_model(cfg, seed=1))
    nnx.update(lora, nnx.state(base))
    lora.stack.lora[target]["a"].value = jnp.broadcast_to(a, (n, n_in, rank))
    lora.stack.lora[target]["b"].value = jnp.broadcast_to(b, (n, rank, n_out))
    return np.asarray(forward(lora, toks))

  for n in (2, 5):  # the N of the test above: its ODE solves serve this test
    expected = np.asarray(forward(shifted, toks, num_steps=n))
    np.testing.assert_allclose(
      with_adapter(materialize(model, n, fold_dt=False), n), expected, atol=2e-5, rtol=2e-5
    )
    # The same adapter on the dt-folded model is off by a factor N on W_O / W_2 only.
    folded = with_adapter(materialize(model, n), n)
    if target == "wq":
      np.testing.assert_allclose(folded, expected, atol=2e-5, rtol=2e-5)
    else:
      assert np.abs(folded - expected).max() > 1e-2


@ODE_GROUP
def test_full_finetuning_updates_w_not_dt_times_w(ode):
  """The gradient full fine-tuning takes w.r.t. a stored W_O is dt × the gradient w.r.t.
  the effective dt·W_O (chain rule), i.e. the authors' parameterisation; the folded
  model's gradient is w.r.t. dt·W_O itself, N times larger relative to its weight."""
  model, toks = ode
  n = 4
  unfolded, folded = materialize(model, n, fold_dt=False), materialize(model, n)

  def grad_wo(m):
    loss = lambda m: jnp.mean(m(toks) ** 2)
    return np.asarray(nnx.jit(nnx.grad(loss))(m).stack.params["wo"][...])

  np.testing.assert_allclose(grad_wo(unfolded), grad_wo(folded) / n, rtol=1e-4, atol=1e-9)


@PRETRAINED_GROUP
def test_mismatched_width_is_a_clear_error(pretrained, tmp_path):
  c = ft_config(pretrained, "full", 0)
  c.model.d_model = 64
  with pytest.raises(ValueError, match=r"model.d_model=64 differs from the pre-trained"):
    loop.train_and_evaluate(c, tmp_path / "ft")
  assert not (tmp_path / "ft").exists()


@PRETRAINED_GROUP
def test_continuous_needs_an_ode_pretrained_model(pretrained, tmp_path):
  base, _ = pretrained
  pre = json.loads((base / "run" / "config.json").read_text())
  pre["model"]["kind"] = "transformer"  # the same run's config, as if it were a GPT baseline
  (tmp_path / "config.json").write_text(json.dumps(pre))
  c = ft_config(pretrained, "continuous", 3)
  c.init_from = str(tmp_path)
  with pytest.raises(finetune.FinetuneError, match="'continuous' needs an ODE model"):
    finetune.finetune_model_config(RunConfig.from_config(c))


@PRETRAINED_GROUP
@pytest.mark.parametrize("solver", ["midpoint", "rk4"])
def test_full_and_lora_refuse_a_higher_order_ode(pretrained, tmp_path, solver):
  """Materialised Euler layers are not the function a midpoint/rk4 model computes (the
  one `generate` decodes): 'full' and 'lora' refuse such a model before any work,
  'continuous' (which keeps its solver) accepts it."""
  base, _ = pretrained
  pre = json.loads((base / "run" / "config.json").read_text())
  pre["model"]["solver"] = solver  # the same run's config, as if trained with `solver`
  (tmp_path / "config.json").write_text(json.dumps(pre))
  for method in ("full", "lora"):
    c = ft_config(pretrained, method, 3)
    c.init_from = str(tmp_path)
    with pytest.raises(
      finetune.FinetuneError, match=f"different function from this '{solver}'-solved model"
    ):
      finetune.finetune_model_config(RunConfig.from_config(c))
  c = ft_config(pretrained, "continuous", 3)
  c.init_from = str(tmp_path)
  assert finetune.finetune_model_config(RunConfig.from_config(c)).solver == solver
