"""A resume holds one TrainState: restored into the abstract (sharded) targets, with no
created state beside it (`loop._restore_or_init`)."""

import gc
import threading

import jax
import pytest

from odetransformer.train import loop
from odetransformer.train.checkpoint.manager import Checkpointer

from tiny import tiny_config

pytestmark = pytest.mark.slow  # runs training end to end


def _live_bytes() -> int:
  return sum(x.nbytes for x in jax.live_arrays())


def test_resume_peak_live_device_bytes_are_one_state(tmp_path, monkeypatch, shared_data_cache):
  """Peak live device bytes while a run resumes ≤ 1.15 × the state's bytes.

  Live arrays (`jax.live_arrays()`) are summed at the restore's start and end, when
  `_restore_or_init` returns, and every millisecond in between from a thread; the
  arrays alive before the resume (other tests') are subtracted. Creating the state and
  then restoring a second copy beside it would count two states at the restore's end."""
  config = tiny_config(shared_data_cache, num_train_steps=2)
  config.eval_every_steps = 0
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(config, workdir)  # leaves a checkpoint at step 2

  samples, states = [], []
  sample = lambda: samples.append(_live_bytes())
  restore_latest = Checkpointer.restore_latest
  restore_or_init = loop._restore_or_init

  def measured_restore(self, *args):
    sample()
    out = restore_latest(self, *args)
    sample()
    return out

  def measured_restore_or_init(*args):
    done = threading.Event()

    def poll():
      while not done.wait(0.001):
        sample()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
      out = restore_or_init(*args)
    finally:
      done.set()
      poller.join()
    sample()
    states.append(out[1])
    return out

  monkeypatch.setattr(Checkpointer, "restore_latest", measured_restore)
  monkeypatch.setattr(loop, "_restore_or_init", measured_restore_or_init)
  gc.collect()  # the baseline holds no garbage that the resume would free
  before = _live_bytes()
  resumed = loop.train_and_evaluate(config, workdir)  # at step 2 already: restore, eval
  assert resumed["start_step"] == 2 and len(states) == 1
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(states[0]))
  assert len(samples) >= 3 and state_bytes > 0
  peak = max(samples) - before
  assert peak >= state_bytes  # the restored state is counted
  assert peak <= 1.15 * state_bytes, (peak / state_bytes, peak, state_bytes)
