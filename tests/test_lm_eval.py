"""The lm-evaluation-harness adapter on a tiny trained checkpoint: log-likelihoods equal
direct model scoring, is_greedy equals an argmax check, rolling windows and greedy
generation equal plain loops, and a local LAMBADA-format task runs offline, in process
and through `python -m odetransformer.lm_eval`."""

import glob
import json
import math
import os
import pathlib
import subprocess
import sys

from flax import nnx
import jax
import numpy as np
import pytest

from odetransformer.train import loop

from tiny import tiny_run_config

lm_eval = pytest.importorskip(
  "lm_eval",
  reason="lm-evaluation-harness is an optional dependency (pip install -r requirements-eval.txt)",
)

# These import the harness: after its importorskip (hence the noqa).
from lm_eval.api.instance import Instance  # noqa: E402

from odetransformer.tools.lm_eval_model import ODETransformerLM  # noqa: E402

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = [pytest.mark.xdist_group("test_lm_eval"), pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "examples" / "lm_eval_tasks"
MAX_LENGTH = 24  # short, so LAMBADA passages are left-truncated and strings need windows
NUM_STEPS = 2  # not the training K (3): the ODE is evaluated at another step count


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, shared_data_cache):
  """A 2-step DiffEqFormer run (K=3) on the embedded corpus (the config of test_evaluate's
  and test_analysis's runs: their programs come from the compilation cache)."""
  c = tiny_run_config(shared_data_cache)
  c.model.max_len = 64
  w = tmp_path_factory.mktemp("run")
  loop.train_and_evaluate(c, str(w))
  return str(w)


@pytest.fixture(scope="module")
def lm(workdir):
  # As the harness builds it: model_args parsed from a string, batch_size as a string.
  return ODETransformerLM.create_from_arg_string(
    f"workdir={workdir},solver_steps={NUM_STEPS},max_length={MAX_LENGTH}",
    {"batch_size": "3", "max_batch_size": None, "device": "cpu"},
  )


@pytest.fixture(scope="module")
def reference(lm):
  """Direct model scoring: the full forward pass on one row, log-softmax in float64."""
  graphdef, state = nnx.split(lm.model)
  fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, num_steps=NUM_STEPS))

  def log_probs(ids):
    """[len(ids), vocab] float64 log-probabilities of the next token after each prefix."""
    assert 0 < len(ids) <= MAX_LENGTH
    row = np.zeros((1, MAX_LENGTH), np.int32)  # right padding: causal, so it is ignored
    row[0, : len(ids)] = ids
    logits = np.asarray(fwd(state, row)[0, : len(ids)], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

  def score(ctx, cont):
    full = (list(ctx) + list(cont))[-(MAX_LENGTH + 1) :]
    logp = log_probs(full[:-1])
    rows = range(len(full) - 1 - len(cont), len(full) - 1)
    total = sum(logp[i, full[i + 1]] for i in rows)
    greedy = all(int(np.argmax(logp[i])) == full[i + 1] for i in rows)
    return total, greedy

  return log_probs, score


def lambada_docs():
  with open(TASK_DIR / "lambada_local.jsonl") as f:
    return [json.loads(line)["text"] for line in f]


def lambada_requests():
  """(context, continuation) as the task YAML builds them."""
  return [(" ".join(t.split(" ")[:-1]), " " + t.split(" ")[-1]) for t in lambada_docs()]


def instances(kind, args_list):
  return [
    Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(args_list)
  ]


def test_loglikelihood_equals_direct_scoring(lm, reference):
  _, score = reference
  reqs = lambada_requests()
  got = lm.loglikelihood(instances("loglikelihood", reqs), disable_tqdm=True)
  assert len(got) == len(reqs)
  for (ctx, cont), (logp, greedy) in zip(reqs, got):
    ctx_ids = lm.tok_encode(ctx)
    cont_ids = lm.tok_encode(ctx + cont)[len(ctx_ids) :]
    want, want_greedy = score(ctx_ids, cont_ids)
    assert logp == pytest.approx(want, abs=1e-4)
    assert greedy == want_greedy
  assert any(len(lm.tok_encode(c + t)) > MAX_LENGTH + 1 for c, t in reqs)  # truncation ran


def test_is_greedy_matches_argmax(lm, reference):
  log_probs, score = reference
  ctx = lm.tok_encode("def main(args):\n    return")
  greedy = []
  for _ in range(3):  # the model's own greedy continuation, by a plain argmax loop
    greedy.append(int(np.argmax(log_probs(ctx + greedy)[-1])))
  other = greedy[:2] + [(greedy[2] + 1) % lm.model.config.vocab_size]
  got = lm._loglikelihood_tokens(
    [(("a", "b"), ctx, greedy), (("a", "c"), ctx, other)], disable_tqdm=True
  )
  assert got[0][1] is True and got[1][1] is False
  assert got[0][0] == pytest.approx(score(ctx, greedy)[0], abs=1e-4)
  assert got[1][0] == pytest.approx(score(ctx, other)[0], abs=1e-4)
  assert got[0][0] > got[1][0]


def test_loglikelihood_rolling_scores_every_token_once(lm, reference):
  log_probs, _ = reference
  text = " ".join(lambada_docs()[:3])
  (got,) = lm.loglikelihood_rolling(
    instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True
  )
  ids = lm.tok_encode(text)
  assert len(ids) > 2 * MAX_LENGTH  # at least three windows
  stream = [lm.eot_token_id] + ids  # token i of `ids` is stream[i + 1]
  want = 0.0
  for start in range(0, len(ids), MAX_LENGTH):  # predict ids[start:end] ...
    end = min(start + MAX_LENGTH, len(ids))
    lo = max(0, end - MAX_LENGTH)  # ... from the MAX_LENGTH stream tokens before ids[end-1]
    logp = log_probs(stream[lo:end])
    want += sum(logp[q - lo, stream[q + 1]] for q in range(start, end))
  assert got == pytest.approx(want, abs=1e-3)


def test_generate_until_equals_a_greedy_loop(lm, reference):
  log_probs, _ = reference
  contexts = ["import os\n", "class Counter:", "for name in names:\n    print("]
  gen = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
  got = lm.generate_until(
    instances("generate_until", [(c, gen) for c in contexts]), disable_tqdm=True
  )
  for ctx, text in zip(contexts, got):
    ids = lm.tok_encode(ctx)[-(MAX_LENGTH - 6) :]
    new = []
    for _ in range(6):
      tok = int(np.argmax(log_probs(ids + new)[-1]))
      new.append(tok)
      if tok == lm.eot_token_id:
        break
    want = lm.tok_decode([t for t in new if t != lm.eot_token_id]).split("\n\n")[0]
    assert text == want


def local_task(tmp_path):
  """The example task, its data file given by absolute path (as for any task run
  outside the repository root), with a private datasets cache."""
  text = (TASK_DIR / "lambada_local.yaml").read_text()
  text = text.replace(
    "test: examples/lm_eval_tasks/lambada_local.jsonl",
    f"test: {TASK_DIR / 'lambada_local.jsonl'}\n  cache_dir: {tmp_path / 'hf_cache'}",
  )
  assert str(TASK_DIR) in text
  (tmp_path / "tasks").mkdir()
  (tmp_path / "tasks" / "lambada_local.yaml").write_text(text)
  return tmp_path / "tasks"


def expected_metrics(lm, reference):
  _, score = reference
  scores = []
  for ctx, cont in lambada_requests():
    ctx_ids = lm.tok_encode(ctx)
    scores.append(score(ctx_ids, lm.tok_encode(ctx + cont)[len(ctx_ids) :]))
  return (math.exp(-np.mean([s for s, _ in scores])), np.mean([g for _, g in scores]))


# `python -m odetransformer.tools.lm_eval` (runpy runs the module as `-m` does), its task
# index built from --include_path alone: the harness's CLI otherwise indexes its ~15,000
# built-in task configs first (most of this test's time), none of which this task uses.
_RUN_WITH_THE_INCLUDED_TASKS_ONLY = """
import runpy
from lm_eval.tasks import TaskManager
init = TaskManager.__init__
def included_only(self, *args, include_defaults=True, **kwargs):
  init(self, *args, include_defaults=False, **kwargs)
TaskManager.__init__ = included_only
runpy.run_module("odetransformer.tools.lm_eval", run_name="__main__", alter_sys=True)
"""


def test_command_line_runs_a_local_lambada_task(workdir, lm, reference, tmp_path):
  """`python -m odetransformer.lm_eval` registers the model and runs the example task
  offline (its jsonl given by absolute path) through the harness's own CLI; the
  task's perplexity and accuracy equal those of direct scoring."""
  tasks = local_task(tmp_path)
  out = tmp_path / "out"
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    HF_DATASETS_CACHE=str(tmp_path / "hf_cache"),
  )
  cmd = [
    sys.executable,
    "-c",
    _RUN_WITH_THE_INCLUDED_TASKS_ONLY,
    "--model",
    "odetransformer",
    "--model_args",
    f"workdir={workdir},solver_steps={NUM_STEPS},max_length={MAX_LENGTH}",
    "--include_path",
    str(tasks),
    "--tasks",
    "lambada_local",
    "--batch_size",
    "3",
    "--output_path",
    str(out),
  ]
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "lambada_local" in r.stdout
  (path,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
  with open(path) as f:
    metrics = json.load(f)["results"]["lambada_local"]
  ppl, acc = expected_metrics(lm, reference)
  assert metrics["perplexity,none"] == pytest.approx(ppl, rel=1e-4)
  assert metrics["acc,none"] == pytest.approx(acc)
