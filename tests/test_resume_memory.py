"""A resume holds one TrainState: restored into the abstract (sharded) targets, with no
created state beside it (`loop.Trainer._restore_or_init`).

`jax.live_arrays()` counts every array of the process, whoever made it, so the measurement
runs in a process of its own: in pytest's worker, what earlier tests left running there
would count as the resume's."""

import pytest

from tiny import run_script

pytestmark = pytest.mark.slow  # runs training end to end

_MEASURE = r"""
import gc, json, sys, threading

import jax

from odetransformer.train import loop
from odetransformer.train.checkpoint.manager import Checkpointer
from tiny import tiny_config


def live_bytes():
  return sum(x.nbytes for x in jax.live_arrays())


config = tiny_config(sys.argv[1], num_train_steps=2)
config.eval_every_steps = 0
loop.train_and_evaluate(config, sys.argv[2])  # leaves a checkpoint at step 2

samples, states = [], []
sample = lambda: samples.append(live_bytes())
restore_latest, restore_or_init = Checkpointer.restore_latest, loop.Trainer._restore_or_init


def measured_restore(self, *args):
  sample()
  out = restore_latest(self, *args)
  sample()
  return out


def measured_restore_or_init(trainer, *args):
  done = threading.Event()

  def poll():
    while not done.wait(0.001):
      sample()

  poller = threading.Thread(target=poll, daemon=True)
  poller.start()
  try:
    out = restore_or_init(trainer, *args)
  finally:
    done.set()
    poller.join()
  sample()
  states.append(trainer.state)
  return out


Checkpointer.restore_latest = measured_restore
loop.Trainer._restore_or_init = measured_restore_or_init
gc.collect()  # the baseline holds no garbage that the resume would free
before = live_bytes()
resumed = loop.train_and_evaluate(config, sys.argv[2])  # at step 2 already: restore, eval
print(json.dumps(dict(
  start_step=resumed["start_step"],
  restores=len(states),
  samples=len(samples),
  peak=max(samples) - before,
  state_bytes=sum(x.nbytes for x in jax.tree.leaves(states[0])),
)))
"""


def test_resume_peak_live_device_bytes_are_one_state(tmp_path, shared_data_cache):
  """Peak live device bytes while a run resumes ≤ 1.15 × the state's bytes.

  Live arrays are summed at the restore's start and end, when `_restore_or_init`
  returns, and every millisecond in between from a thread; the arrays alive before the
  resume (the first run's leftovers) are subtracted. Creating the state and then
  restoring a second copy beside it would count two states at the restore's end."""
  m, _ = run_script(_MEASURE, tmp_path, shared_data_cache, tmp_path / "run", timeout=300)
  assert m["start_step"] == 2 and m["restores"] == 1
  assert m["samples"] >= 3 and m["state_bytes"] > 0
  assert m["peak"] >= m["state_bytes"]  # the restored state is counted
  assert m["peak"] <= 1.15 * m["state_bytes"], m
