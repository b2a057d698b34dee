"""End to end: train_and_evaluate, checkpoints, exact resume, sharding, WikiText-2."""

import contextlib
import json
import logging
import math
import pathlib
import re

from conftest import shared_data_path
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import default
from odetransformer.errors import UserError
from odetransformer.model import config as config_lib
from odetransformer.model.transformer import create_model
from odetransformer.train import loop, setup, steps
from odetransformer.train import metrics as metrics_lib
from odetransformer.train import optimizer as optimizer_lib
from odetransformer.train import sharding as sharding_lib
from odetransformer.train.checkpoint.fingerprint import stored_fingerprint
from odetransformer.train.checkpoint.manager import Checkpointer
from odetransformer.train.checkpoint.restore import restore_model_state

# tiny_config is also re-exported for other test modules.
from tiny import config_flags, reused_compiled_steps, tiny_config

pytestmark = pytest.mark.slow
# Under pytest-xdist the tests of the module fixture `runs` run on one worker, so that
# it is made once; the other tests are spread over the workers one by one.
RUNS_GROUP = pytest.mark.xdist_group("test_train")

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def fast_compiles():
  """The 'rbg' PRNG for this module and those that import this fixture; the runs they
  launch get it too (test_reliability.subprocess_env), so both draw the same numbers.
  At XLA:CPU's default optimisation it compiles the tiny init 1.8× faster than threefry
  (2.3 vs 4.1 s); under the tests' -O0 (tiny.TEST_XLA_FLAGS) the two take the same
  (1.4 s). The loop under test does not care which; the 8-device equivalence test runs
  in its own process with the default. And the module's runs of one config share their
  compiled steps (tiny.reused_compiled_steps)."""
  old = jax.config.jax_default_prng_impl
  jax.config.update("jax_default_prng_impl", "rbg")
  with reused_compiled_steps():
    yield
  jax.config.update("jax_default_prng_impl", old)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """6-step runs: A preempted at step 4, A again (resumes), B uninterrupted, C stopped at
  step 3 (`stop_at_step`) then continued."""
  base = tmp_path_factory.mktemp("train")
  cache = base / "cache"
  wd_a, wd_b = base / "a", base / "b"
  with pytest.MonkeyPatch.context() as mp:  # a SIGTERM arriving during step 4
    mp.setattr(Checkpointer, "reached_preemption", lambda self, step: step == 4)
    first = loop.train_and_evaluate(tiny_config(cache, 6), str(wd_a))
  with compiled_functions() as resume_compiles:
    resumed = loop.train_and_evaluate(tiny_config(cache, 6), str(wd_a))
  fresh = loop.train_and_evaluate(tiny_config(cache, 6), str(wd_b))
  wd_c = base / "c"
  stopped = loop.train_and_evaluate(tiny_config(cache, 6), str(wd_c), stop_at_step=3)
  continued = loop.train_and_evaluate(tiny_config(cache, 6), str(wd_c))
  return dict(
    first=first,
    resumed=resumed,
    fresh=fresh,
    wd_a=wd_a,
    wd_b=wd_b,
    resume_compiles=resume_compiles,
    stopped=stopped,
    continued=continued,
    wd_c=wd_c,
  )


@contextlib.contextmanager
def compiled_functions():
  """The names of the functions jax compiles (or loads from its cache) inside the block."""
  names = []

  class Record(logging.Handler):
    def emit(self, record):
      m = re.match(r"Finished XLA compilation of jit\((\w+)\)", record.getMessage())
      if m:
        names.append(m.group(1))

  logger, handler = logging.getLogger("jax._src.dispatch"), Record(logging.WARNING)
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield names
  finally:
    logger.removeHandler(handler)


@RUNS_GROUP
def test_first_run_writes_checkpoints_events_and_config(runs):
  r, wd = runs["first"], runs["wd_a"]
  assert (r["start_step"], r["step"]) == (0, 4)  # stopped by the "preemption"
  assert math.isfinite(r["eval"]["perplexity"]) and r["eval"]["perplexity"] > 1
  assert r["eval"]["num_tokens"] > 0
  assert (wd / "checkpoints" / "2").is_dir()  # periodic
  assert (wd / "checkpoints" / "4").is_dir()  # on preemption
  saved = json.loads((wd / "config.json").read_text())  # the latest run's config
  assert saved["model"]["vocab_size"] == 512 and saved["seq_len"] == 32
  scalars = metrics_lib.read_scalars(str(wd / "tensorboard"))
  assert [s for s, _ in scalars["train/loss"]][:4] == [1, 2, 3, 4]
  for tag in (
    "train/perplexity",
    "train/learning_rate",
    "train/grad_norm",
    "train/tokens_per_sec",
    "train/mfu",
    "eval/loss",
    "eval/perplexity",
  ):
    assert tag in scalars, tag


@RUNS_GROUP
def test_second_run_resumes_and_continues(runs):
  r, wd = runs["resumed"], runs["wd_a"]
  assert (r["start_step"], r["step"]) == (4, 6)
  assert [s for s, _ in r["loss_history"]] == [5, 6]
  steps = sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit())
  assert steps[-1] == 6 and len(steps) <= 3  # keep-last-k (3)


@RUNS_GROUP
def test_resumed_run_compiles_its_train_step_once(runs):
  """The restored state has the pytree of a created one: the resumed run's steps run the
  train step the first run compiled (the module's runs share a config's compiled steps,
  fast_compiles); a restored state of another pytree would trace and compile it again."""
  assert "train_step" not in runs["resume_compiles"], runs["resume_compiles"]


def _final_params(workdir):
  cfg = config_lib.model_config(tiny_config("/unused"), 512)
  mesh = sharding_lib.make_mesh(default.get_config().mesh)
  with nnx.logical_axis_rules(sharding_lib.logical_axis_rules()):
    _, abstract = nnx.get_abstract_model(lambda: create_model(cfg, seed=0), mesh)
  state, step = restore_model_state(str(workdir), abstract)
  return step, jax.tree.map(np.asarray, nnx.to_pure_dict(state))


@RUNS_GROUP
def test_logged_param_norm_is_the_checkpointed_parameters_norm(runs):
  step, params = _final_params(runs["wd_a"])
  norm = math.sqrt(
    sum(float(np.sum(np.square(x.astype(np.float64)))) for x in jax.tree.leaves(params))
  )
  logged = dict(metrics_lib.read_scalars(str(runs["wd_a"] / "tensorboard"))["train/param_norm"])
  assert logged[step] == pytest.approx(norm, rel=1e-5)


@RUNS_GROUP
def test_resume_is_exact(runs):
  """Interrupted at 4 + resumed to 6 == 6 straight: model, optimizer, RNG and data."""
  step_a, params_a = _final_params(runs["wd_a"])
  step_b, params_b = _final_params(runs["wd_b"])
  assert step_a == step_b == 6
  hist_b = dict(runs["fresh"]["loss_history"])
  for step, loss in runs["resumed"]["loss_history"]:
    np.testing.assert_allclose(loss, hist_b[step], rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), params_a, params_b
  )


@RUNS_GROUP
def test_stop_at_step_saves_there_and_the_next_call_continues_exactly(runs):
  """Stopped at 3 (the schedule still 6 steps') + continued == 6 straight."""
  stopped, continued = runs["stopped"], runs["continued"]
  assert (stopped["start_step"], stopped["step"]) == (0, 3)
  assert (runs["wd_c"] / "checkpoints" / "3").is_dir()  # saved at the stop
  assert stopped["data_state"]["num_shards"] == 1  # the iterator's state
  assert (continued["start_step"], continued["step"]) == (3, 6)
  hist_b = dict(runs["fresh"]["loss_history"])
  for step, loss in stopped["loss_history"] + continued["loss_history"]:
    np.testing.assert_allclose(loss, hist_b[step], rtol=1e-6)
  _, params_c = _final_params(runs["wd_c"])
  _, params_b = _final_params(runs["wd_b"])
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), params_c, params_b
  )


@RUNS_GROUP
def test_finetune_lora_starts_at_the_pretrained_model(runs, tmp_path):
  """main.py fine-tuning (init_from): materialise N = K layers + LoRA (B = 0), so the
  step-0 evaluation equals the pre-trained run's final one; then only adapters train."""
  c = tiny_config(runs["wd_b"].parent / "cache", 2)
  c.init_from = str(runs["wd_b"])
  c.finetune = ml_collections.ConfigDict(
    dict(
      method="lora",
      solver_steps=None,
      lora_rank=4,
      lora_alpha=8.0,
      targets="wq,wv",
      train_embeddings=False,
    )
  )
  r = loop.train_and_evaluate(c, str(tmp_path))
  evals = dict(metrics_lib.read_scalars(str(tmp_path / "tensorboard"))["eval/loss"])
  np.testing.assert_allclose(evals[0], runs["fresh"]["eval"]["loss"], rtol=1e-5)
  assert r["step"] == 2 and (tmp_path / "tokenizer.model").exists()
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["model"]["lora_rank"] == 4 and saved["model"]["kind"] == "parallel"


def _flat(tree, dtype=None):
  """A pytree as {keystr: numpy array}."""
  return {
    jax.tree_util.keystr(k): np.asarray(v, dtype)
    for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _host_copy(state):
  """`state` (a TrainState) with numpy leaves: `jax.device_put(copy, layout.shardings)`
  gives a fresh device copy, as `create_train_state` would, for each step that donates
  its input."""
  leaves, tree = jax.tree.flatten(state)
  return jax.tree.unflatten(tree, [np.asarray(x) for x in leaves])


def _direct_gradients(cfg, params, batch):
  """(loss, {keystr: gradient}) of the token-weighted mean cross-entropy of `batch`,
  taken with plain `nnx.value_and_grad` on a model holding `params` (a pure dict): the
  independent reference for the train step (jitted: op by op it compiles each op)."""

  def mean_loss(model):
    logits = model(jnp.asarray(batch["inputs"]))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, jnp.asarray(batch["targets"])[..., None], -1)[..., 0]
    w = jnp.asarray(batch["weights"])
    return jnp.sum(nll * w) / jnp.sum(w)

  # The model's structure only: `params` gives every value (one left out would fail).
  graphdef, model_state = nnx.split(nnx.eval_shape(lambda: create_model(cfg, seed=0)))
  nnx.replace_by_pure_dict(model_state, params)
  loss, grads = nnx.jit(nnx.value_and_grad(mean_loss))(nnx.merge(graphdef, model_state))
  return loss, _flat(nnx.to_pure_dict(nnx.state(grads, nnx.Param)))


@pytest.mark.parametrize(
  "overrides, accums",
  [
    ({}, (1, 2)),  # Euler, K = 2: the whole batch, and 2 microbatches (clipped)
    ({"solver": "rk4", "solver_steps": 3}, (1,)),  # 12 solver times in one GEMM
    ({"family": "llama", "shared_time_mlp": True}, (1,)),
    ({"kind": "transformer"}, (1,)),
  ],
)
def test_step_loss_grad_norm_and_clipping_use_the_true_gradient(overrides, accums):
  """The step's loss and gradient norm equal those of the token-weighted mean loss of the
  whole batch taken directly (also when the gradient is accumulated over microbatches of
  unequal token counts: sums, then one divide), and the optimizer's clipping
  (optax.clip_by_global_norm in the chain) uses that norm: with SGD at rate lr behind a
  clip c well below ‖g‖, the parameters move by exactly -lr·g·c/‖g‖ (lr = 100 makes that
  move large against float32's spacing of the parameters). Accumulated over 2
  microbatches, the step's loss, norm and whole new state equal the 1-batch step's."""
  c = tiny_config("/unused")
  # The reference is the cross-entropy's gradient alone: configs/default.py's local error
  # penalty (its gradient: test_time_grid's test_the_train_loss_adds_the_weighted_penalty)
  # is off, not left to be small at init.
  c.model.local_error_weight = 0.0
  for key, value in overrides.items():
    c.model[key] = value
  cfg = config_lib.model_config(c, 64)
  max_norm = 1e-3
  lr = 100.0
  tx = optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(lr))
  mesh = sharding_lib.make_mesh(c.mesh)
  rules = sharding_lib.logical_axis_rules(c.mesh.rules)
  rng = np.random.default_rng(1)
  batch = {
    "inputs": rng.integers(0, 64, (4, 16)).astype(np.int32),
    "targets": rng.integers(0, 64, (4, 16)).astype(np.int32),
    "weights": (rng.random((4, 16)) > 0.3).astype(np.float32),
  }
  out = {}
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    layout = steps.state_layout(cfg, tx, 0, mesh)
    created = steps.create_train_state(layout, cfg, tx, 0, mesh)
    start = _host_copy(created)  # each accumulation's step starts from these values
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(created["model"]))
    for accum in accums:
      state = jax.device_put(start, layout.shardings)
      step = steps.make_train_step(layout, lambda step: 1.0, rules, grad_accum_steps=accum)
      state, m = step(state, batch, jax.random.key(0))
      out[accum] = (
        float(m.loss.compute()),
        float(m.grad_norm.compute()),
        _flat(nnx.to_pure_dict(state)),
      )

  loss, grads = _direct_gradients(cfg, before, batch)
  grads = {key: g.astype(np.float64) for key, g in grads.items()}
  norm = math.sqrt(sum(np.sum(g**2) for g in grads.values()))
  assert len(grads) > 10
  assert any(key.endswith("['proj']") for key in grads) == (cfg.kind != "transformer")
  assert norm > 10 * max_norm
  before = _flat(before, np.float64)
  scale = lr * max_norm / norm
  largest = max(np.max(np.abs(g)) for g in grads.values()) * scale
  for step_loss, grad_norm, state in out.values():
    np.testing.assert_allclose(step_loss, float(loss), rtol=1e-5)
    np.testing.assert_allclose(grad_norm, norm, rtol=1e-4)
    for key, g in grads.items():  # f32 gradients, and the rounding of `after` to f32
      after = state[f"['model']{key}"].astype(np.float64)
      moved, want = before[key] - after, g * scale
      bound = 1e-3 * np.abs(want) + 1e-6 * largest + np.spacing(np.abs(after).astype(np.float32))
      assert np.all(np.abs(moved - want) <= bound), (key, np.max(np.abs(moved - want) - bound))
  if len(out) > 1:
    (loss1, norm1, state1), (loss2, norm2, state2) = out.values()
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    np.testing.assert_allclose(norm2, norm1, rtol=1e-5)
    assert state2.keys() == state1.keys()
    for key in state1:
      np.testing.assert_allclose(state2[key], state1[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_skipped_nonfinite_step_leaves_the_state_exactly_as_it_was():
  """With skipping on, batches [a, bad, b] end in exactly the state of [a, b] (parameters,
  Adam moments, every step counter), the bad step is counted and left out of the loss;
  and skipping changes nothing on finite steps: the same two steps without it agree."""
  c = tiny_config("/unused")
  c.optim.schedule, c.optim.warmup_frac = "constant", 0.0
  cfg = config_lib.model_config(c, 64)
  tx = optimizer_lib.create_optimizer(c.optim, 10)
  sched = optimizer_lib.learning_rate_schedule(c.optim, 10)
  mesh = sharding_lib.make_mesh(c.mesh)
  rules = sharding_lib.logical_axis_rules(c.mesh.rules)
  rng = np.random.default_rng(0)
  a, b = (
    {
      "inputs": rng.integers(0, 64, (4, 16)).astype(np.int32),
      "targets": rng.integers(0, 64, (4, 16)).astype(np.int32),
      "weights": np.ones((4, 16), np.float32),
    }
    for _ in range(2)
  )
  bad = dict(b, weights=b["weights"].copy())
  bad["weights"][1, 3] = np.nan  # a stand-in for a batch that overflows

  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    layout = steps.state_layout(cfg, tx, 0, mesh)
    start = _host_copy(steps.create_train_state(layout, cfg, tx, 0, mesh))  # every run's
    train_step = {
      skip: steps.make_train_step(layout, sched, rules, skip_nonfinite=skip)
      for skip in (True, False)
    }  # each compiled once, run twice

  def run(batches, skip):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
      state = jax.device_put(start, layout.shardings)
      step = train_step[skip]
      merged = None
      for i, batch in enumerate(batches):
        state, m = step(state, batch, jax.random.key(i))
        merged = m if merged is None else merged.merge(m)
    return _flat(state), metrics_lib.summarize(merged.compute())

  clean, clean_m = run([a, b], skip=True)
  skipped, skipped_m = run([a, bad, b], skip=True)
  plain, plain_m = run([a, b], skip=False)
  applied, applied_m = run([a, bad], skip=False)
  assert any("count" in k for k in clean) and any("step" in k for k in clean)
  assert clean.keys() == skipped.keys() == plain.keys()
  lr = float(c.optim.learning_rate)
  for key in clean:
    np.testing.assert_array_equal(skipped[key], clean[key], err_msg=key)
    # Another compiled program (the update inside a lax.cond): equal up to rounding. Not
    # so the key bias: its gradient is zero in exact arithmetic (softmax ignores a shift
    # along the keys), so its Adam moments and steps are rounding noise normalised by
    # Adam, different in any other program. Its parameters can only be bounded: two
    # steps of at most ~lr each.
    if "['bk']" in key:
      if "opt_state" not in key:
        assert np.max(np.abs(plain[key] - clean[key])) <= 4 * lr, key
      continue
    # The absolute floor is a few float32 ulps of the array's largest element: an element
    # that is a cancellation of larger terms (a moment near zero) carries their rounding.
    floor = 1e-6 * float(np.max(np.abs(clean[key]), initial=0.0))
    np.testing.assert_allclose(plain[key], clean[key], rtol=1e-5, atol=floor, err_msg=key)
  assert (skipped_m["skipped_steps"], clean_m["skipped_steps"]) == (1, 0)
  assert skipped_m["loss"] == clean_m["loss"]
  np.testing.assert_allclose(plain_m["loss"], clean_m["loss"], rtol=1e-6)
  assert skipped_m["grad_norm"] == clean_m["grad_norm"]
  # Without skipping the same bad batch is applied: its NaN reaches the parameters.
  assert math.isnan(applied_m["loss"]) and applied_m["skipped_steps"] == 0
  assert not all(np.isfinite(v).all() for v in applied.values())


@pytest.mark.xdist_group("test_train_wikitext2")  # one worker: one tokenizer and data cache
@pytest.mark.parametrize("kind", ["diffeqformer", "transformer"])
def test_default_model_learns_wikitext2(kind, tmp_path_factory):
  """The default config's model (DiffEqFormer, and GPT via kind=gpt) on real text."""
  valid = shared_data_path("wikitext-2", "valid.txt")
  cache = tmp_path_factory.getbasetemp() / "wt2_cache"
  c = default.get_config()
  c.model.kind = kind
  c.num_train_steps = 25
  c.log_every_steps = 1
  c.eval_every_steps = 0
  c.checkpoint_every_steps = 0
  c.seq_len = 64
  c.global_batch_size = 8
  c.eval_batch_size = 8
  c.data.source = "local"
  c.data.train_files = str(valid)
  c.data.eval_files = str(valid)
  c.data.tokenizer_sample_bytes = 400_000
  c.data.eval_max_batches = 2
  c.data.cache_dir = str(cache)
  r = loop.train_and_evaluate(c, str(tmp_path_factory.mktemp(f"wt2_{kind}")))
  losses = [loss for _, loss in r["loss_history"]]
  assert losses[0] > math.log(2048) - 0.5  # starts near uniform
  assert np.mean(losses[-5:]) < losses[0] - 1.0  # and clearly learns
  assert r["eval"]["loss"] < losses[0] - 1.0


TINY_FLAGS = config_flags(tiny_config(None, num_train_steps=2))  # for main.py subprocesses


@pytest.mark.parametrize(
  "overrides,kind",
  [
    ({"model.num_heads": 5}, "ConfigError"),
    ({"mesh.shape": (2, 1, 1)}, "ConfigError"),  # 2 devices on a 1-CPU host
    ({"optim.skip_nonfinite_steps": -1}, "ConfigError"),
    ({"data.source": "local", "data.train_files": "/nonexistent/*.txt"}, "DataError"),
  ],
)
def test_bad_input_is_one_line_before_anything_is_written(tmp_path, overrides, kind):
  """A one-line UserError of its kind, raised before the workdir is made (main.py prints
  any UserError as one `error:` line and exits 2: test_reliability runs it)."""
  c = tiny_config(tmp_path / "cache")
  for key, value in overrides.items():
    node, last = c, key.split(".")
    for part in last[:-1]:
      node = node[part]
    node[last[-1]] = value
  wd = tmp_path / "wd"
  with pytest.raises(UserError) as err:
    loop.train_and_evaluate(c, str(wd))
  assert type(err.value).__name__ == kind and "\n" not in str(err.value), err.value
  assert not wd.exists()


def _override(config, overrides):
  for key, value in overrides.items():
    node, path = config, key.split(".")
    for part in path[:-1]:
      node = node[part]
    node[path[-1]] = value


def _files(directory):
  """{relative path: (size, mtime_ns)} of every file under `directory`."""
  return {
    str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
    for p in sorted(directory.rglob("*"))
    if p.is_file()
  }


# One setting that fails each of setup.check_run's checks, in its docstring's order, and
# a phrase of the error it gives.
_CHECK_RUN_BREAKS = [
  ("1 paths", "data.cache_dir", "\udcff", "--config.data.cache_dir="),
  ("2 schedule", "num_train_steps", 0, "num_train_steps=0"),
  ("2 checkpoints kept", "checkpoint_max_to_keep", 0, "checkpoint_max_to_keep=0"),
  ("2 optimizer", "optim.b1", 1.5, "optim.b1=1.5"),
  ("2 model", "model.num_heads", 5, "model.num_heads=5"),
  ("3 init_from", "init_from", "/nonexistent/pretrained", "init_from='/nonexistent/pretrained'"),
  ("4 mesh", "mesh.shape", (1, 1, 0), "mesh.shape=(1, 1, 0)"),
  ("5 check_config", "seq_len", 1024, "seq_len=1024 exceeds model.max_len"),
  ("6 resumable", "seed", 1, "holds checkpoints (step 6)"),
]


@RUNS_GROUP
def test_check_run_reports_its_checks_in_docstring_order_and_writes_nothing(runs, tmp_path):
  """Every check of `setup.check_run` failing at once, then mended one by one: each
  error is the next check its docstring lists (the first failing one wins), one line
  and a UserError, and the workdir (holding checkpoints) stays as it was. The mended
  config gives the checked run: the workdir's checkpoints as the resume decision."""
  wd = runs["wd_b"]
  before = _files(wd)
  base = tiny_config(wd.parent / "cache", 6)
  for i, (name, _, _, phrase) in enumerate(_CHECK_RUN_BREAKS):
    c = ml_collections.ConfigDict(base.to_dict())
    for _, key, value, _ in _CHECK_RUN_BREAKS[i:]:
      _override(
        c, {key: str(base.data.cache_dir) + value} if key == "data.cache_dir" else {key: value}
      )
    with pytest.raises(UserError) as err:
      setup.check_run(c, str(wd))
    assert phrase in str(err.value) and "\n" not in str(err.value), (name, err.value)
  assert _files(wd) == before

  run = setup.check_run(ml_collections.ConfigDict(base.to_dict()), wd)
  assert run.resume_from == stored_fingerprint(str(wd))[1]
  assert run.workdir == str(wd) and dict(run.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  assert run.config.model == config_lib.model_config(base)
  assert float(run.lr_schedule(0)) > 0 and run.tx is not None and run.config.mesh.rules
  fresh = tmp_path / "fresh"
  assert setup.check_run(ml_collections.ConfigDict(base.to_dict()), fresh).resume_from is None
  assert not fresh.exists() and _files(wd) == before


def test_short_eval_batch_padding_rows_have_weight_zero():
  """A short last eval batch without weights: its real tokens weigh 1, the rows padded
  up to the local batch size 0 (they must not count in the eval loss)."""
  batch = {"inputs": np.ones((3, 5), np.int32), "targets": np.ones((3, 5), np.int32)}
  out = steps.local_batch(batch, local_batch_size=4)
  assert {k: v.shape for k, v in out.items()} == {
    k: (4, 5) for k in ("inputs", "targets", "weights")
  }
  np.testing.assert_array_equal(out["weights"], np.repeat([[1.0], [1.0], [1.0], [0.0]], 5, 1))
