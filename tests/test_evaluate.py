"""Perplexity evaluation (and the generate command line) on a tiny trained checkpoint:
every token of a split is scored once, and the loss equals a direct sum of the
model's token log-probabilities."""

import dataclasses
import os
import pathlib
import subprocess
import sys

from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from input_pipeline import local_text
from odetransformer import errors
from odetransformer.model.config import ModelConfig
from odetransformer.model.materialize import materialize
from odetransformer.model.transformer import create_model
from odetransformer.tools import evaluate, generate
from odetransformer.train import evaluation, loading, loop
from odetransformer.train.loading import load_model
from odetransformer.train.losses import token_cross_entropy, token_scores

from tiny import tiny_run_config

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = [pytest.mark.xdist_group("test_evaluate"), pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[1]
EVAL_TEXT = '''def read_config(path):
    """Reads a JSON config file and returns it as a dict."""
    with open(path) as f:
        return json.load(f)


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1


for name in sorted(names):
    print(name, len(name))
'''


def tiny_config(cache_dir):
  c = tiny_run_config(cache_dir)
  c.model.max_len = 64
  return c


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_data_cache):
  """(workdir, train_and_evaluate's result) of a 2-step DiffEqFormer run (K=3)."""
  workdir = tmp_path_factory.mktemp("run")
  result = loop.train_and_evaluate(tiny_config(shared_data_cache), str(workdir))
  return str(workdir), result


@pytest.fixture(scope="module")
def loaded(run):
  return load_model(run[0])


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "eval.txt"
  path.write_text(EVAL_TEXT)
  return str(path)


def direct_nll(model, batches, num_steps):
  """Reference: the model's full forward pass, log-softmax in float64 on the host."""
  graphdef, state = nnx.split(model)
  fwd = jax.jit(
    lambda st, b: nnx.merge(graphdef, st)(
      b["inputs"], segment_ids_bl=b["segment_ids"], positions_bl=b["positions"], num_steps=num_steps
    )
  )
  nll, count = 0.0, 0.0
  for batch in batches:
    logits = np.asarray(fwd(state, batch), np.float64)
    logp = (
      logits
      - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True))
      - logits.max(-1, keepdims=True)
    )
    picked = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    nll -= float(np.sum(picked * batch["weights"]))
    count += float(np.sum(batch["weights"]))
  return nll, count


@pytest.fixture(scope="module")
def local_data(run, loaded, eval_file):
  return evaluate.eval_data(run[0], loaded.config, data=f"local:{eval_file}", batch_size=4)


@pytest.fixture(scope="module")
def local_results(loaded, local_data):
  """N -> evaluate_model's Result on the local file."""
  return {n: evaluate.evaluate_model(loaded.model, local_data.batches(), n) for n in (2, 3)}


def test_perplexity_matches_direct_log_probs_and_scores_every_token(
  run, loaded, local_data, local_results
):
  sp = loading.load_tokenizer(run[0], loaded.config)
  # Every token of every document, plus its eos, is a target exactly once.
  docs = local_text.split_documents(EVAL_TEXT)
  expected_tokens = sum(len(sp.encode(d)) + 1 for d in docs)
  assert expected_tokens > 4 * 32  # more than one batch: the padded tail is exercised
  for n, result in local_results.items():
    nll, count = direct_nll(loaded.model, local_data.batches(), n)
    assert result.num_tokens == count == expected_tokens
    np.testing.assert_allclose(result.loss, nll / count, rtol=1e-6)
    # Perplexity is exp(loss) of that loss (comparing it to exp(nll / count) instead
    # would scale the loss's rounding by the loss, ~6 here).
    np.testing.assert_allclose(result.perplexity, np.exp(result.loss), rtol=1e-12)


def test_a_model_scored_again_is_not_traced_again(run, loaded, local_data, local_results):
  """Scoring a model again (another pass over the data, or the run loaded anew) reuses
  the jitted scorer of its structure and step count: no trace, the same results; another
  structure gets its own."""
  traced = []
  score_sums = evaluation.score_sums

  def counting(model, batch, rules, num_steps):
    traced.append((model.config.kind, num_steps))
    return score_sums(model, batch, rules, num_steps)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(evaluation, "score_sums", counting)
    again = load_model(run[0]).model  # another object of the same structure
    for model, n in ((loaded.model, 2), (again, 2), (again, 3)):
      r = evaluate.evaluate_model(model, local_data.batches(), n)
      assert (r.loss, r.num_tokens) == (local_results[n].loss, local_results[n].num_tokens)
    assert traced == []  # local_results traced N = 2 and 3
    discrete = materialize(loaded.model, 2)
    evaluate.evaluate_model(discrete, local_data.batches())
    evaluate.evaluate_model(discrete, local_data.batches())
  assert traced == [("parallel", 2)]


def test_default_data_is_the_runs_eval_split(run):
  workdir, trained = run
  (result,) = evaluate.evaluate(workdir, [None], max_batches=1)  # as the run's own eval
  assert result.num_steps == 3
  assert result.num_tokens == trained["eval"]["num_tokens"]
  np.testing.assert_allclose(result.loss, trained["eval"]["loss"], rtol=1e-5)


def test_a_tool_restore_prints_no_orbax_notice(run, caplog):
  """A tool restores read-only on purpose: orbax's notices of it (WARNINGs) are not shown."""
  with caplog.at_level("INFO"):
    load_model(run[0])
  assert not [
    r.getMessage()
    for r in caplog.records
    if "read only" in r.getMessage() or "read_only" in r.getMessage()
  ]


def test_discrete_models_only_at_their_own_depth():
  cfg = ModelConfig(
    kind="transformer", vocab_size=64, d_model=16, num_heads=2, mlp_dim=32, num_layers=2, max_len=16
  )
  model = nnx.eval_shape(lambda: create_model(cfg))  # the check needs no weights
  with pytest.raises(ValueError, match="layers"):
    evaluate.evaluate_model(model, [], num_steps=4)
  assert evaluate.parse_num_steps("6, 9,12") == [6, 9, 12]
  assert evaluate.parse_num_steps("") == [None]


def test_evaluate_command_line(run, eval_file, local_results, capsys):
  fv = evaluate.define_flags(flags.FlagValues())
  fv(
    [
      "evaluate",
      f"--workdir={run[0]}",
      "--solver_steps=2,3",
      f"--data=local:{eval_file}",
      "--batch_size=4",
    ]
  )
  evaluate.main([], fv)
  out = capsys.readouterr().out
  rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
  assert [r[0] for r in rows] == ["2", "3"] and out.count("(training K)") == 1
  assert (
    "solve: euler, N uniform steps t_k = k/N, the field of step k at its start, t_k "
    "(step_time='start'); trained at K=3 on the 'fixed' grid\n" in out
  )
  for row, n in zip(rows, (2, 3)):
    assert int(row[1].replace(",", "")) == local_results[n].num_tokens
    assert float(row[2]) == pytest.approx(local_results[n].loss, abs=1e-4)


def test_generate_command_line(run, capsys):
  fv = generate.define_flags(flags.FlagValues())
  fv(
    [
      "generate",
      f"--workdir={run[0]}",
      "--prompt=def main(",
      "--solver_steps=5",
      "--max_new_tokens=8",
      "--temperature=0",
    ]
  )
  generate.main([], fv)
  out = capsys.readouterr().out
  assert "decoding materialised at N=5 layers" in out
  lines = out.splitlines()
  assert lines[lines.index("-" * 60) + 1].startswith("def main(")
  assert "new tokens in" in lines[-1]


@pytest.mark.parametrize("module", ["evaluate", "generate"])
def test_command_lines_report_a_missing_run(module, tmp_path):
  r = subprocess.run(
    [sys.executable, "-m", f"odetransformer.{module}", f"--workdir={tmp_path / 'nothing'}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 2, r.stderr[-2000:]
  assert "holds no training run" in r.stderr.splitlines()[-1]


def test_evaluate_command_line_plots_the_printed_table(
  run, eval_file, tmp_path, capsys, monkeypatch
):
  """--plot writes a PNG whose one curve is the printed perplexities against N, and says
  where in one line: a relative path as the absolute one it wrote (here, the current
  directory's)."""
  figures = []
  plot_table = evaluate.plot_table
  monkeypatch.setattr(
    evaluate, "plot_table", lambda *a, **k: figures.append(plot_table(*a, **k)) or figures[-1]
  )
  path = tmp_path / "ppl.png"
  monkeypatch.chdir(tmp_path)
  fv = evaluate.define_flags(flags.FlagValues())
  fv(
    [
      "evaluate",
      f"--workdir={run[0]}",
      "--solver_steps=1,3,6",
      f"--data=local:{eval_file}",
      "--batch_size=4",
      "--plot=ppl.png",
    ]
  )
  evaluate.main([], fv)
  out = capsys.readouterr().out
  rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert [l for l in out.splitlines() if "ppl.png" in l] == [f"plot written to {path}"]
  (curve,) = [line for line in figures[0].axes[0].lines if line.get_marker() == "o"]
  assert list(curve.get_xdata()) == [int(r[0]) for r in rows] == [1, 3, 6]
  np.testing.assert_allclose(curve.get_ydata(), [float(r[3]) for r in rows], atol=5e-4)
  fv(["evaluate", f"--workdir={run[0]}", f"--plot={tmp_path / 'missing' / 'ppl.png'}"])
  with pytest.raises(errors.UserError, match="directory does not exist"):
    evaluate.main([], fv)


def test_token_scores_equal_a_numpy_reference():
  """The one scorer (train-loop eval, evaluate, lm-eval) against float64 numpy, with a
  masked token, a bf16 input and a tie-free argmax."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (3, 5)).astype(np.int32)
  targets[1] = logits[1].argmax(-1)  # row 1: every target is the argmax
  weights = np.ones((3, 5), np.float32)
  weights[0, 2] = 0.0
  targets[2, :4] = logits[2, :4].argmax(-1)  # row 2: greedy except the masked-in last token
  targets[2, 4] = (logits[2, 4].argmax() + 1) % 7
  lp = logits.astype(np.float64)
  lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
  hit = logits.argmax(-1) == targets
  got = jax.device_get(
    token_scores(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  )
  np.testing.assert_allclose(got["nll"], (nll * weights).sum(-1), rtol=1e-6)
  np.testing.assert_array_equal(got["weight"], weights.sum(-1))
  np.testing.assert_array_equal(got["correct"], (hit * weights).sum(-1))
  np.testing.assert_array_equal(got["greedy"], [bool(hit[0][weights[0] > 0].all()), True, False])
  s, w = token_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  np.testing.assert_allclose(float(s), (nll * weights).sum(), rtol=1e-6)
  assert float(w) == weights.sum()
  half = token_scores(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets))
  assert half["nll"].dtype == jnp.float32


def test_evaluate_says_how_it_solves_and_how_the_model_was_trained():
  base = ModelConfig(vocab_size=64, d_model=16, num_heads=2, mlp_dim=32, solver_steps=4)
  mixed = dataclasses.replace(
    base,
    solver="split_euler",
    step_time="end",
    train_time_grid="random_shift",
    train_time_grid_fraction=0.25,
    time_scale=10.0,
  )
  assert evaluate.describe_solve(mixed) == (
    "solve: split_euler, N uniform steps t_k = k/N, the field of step k at its end, "
    "t_(k+1) (step_time='end'); trained at K=4 on the 'random_shift' grid on 0.25 of the "
    "batches, else 'fixed', time_scale 10"
  )
  gpt = dataclasses.replace(base, kind="transformer", solver_steps=None, num_layers=3)
  assert evaluate.describe_solve(gpt) == "solve: the 3 layers (a discrete model has no other N)"
