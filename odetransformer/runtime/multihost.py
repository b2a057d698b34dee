"""What the processes of a multi-host job exchange outside the model's arrays: their
strings (`allgather_strings`) and a barrier (`sync`). On one process both are trivial."""

import jax
from jax.experimental import multihost_utils
import numpy as np


def allgather_strings(text: str) -> list:
  """Every process's `text`, in process order (collective; trivial on one host)."""
  if jax.process_count() == 1:
    return [text]
  data = np.frombuffer(text.encode("utf-8"), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([data.size], np.int32))
  padded = np.zeros(max(1, int(np.max(lengths))), np.uint8)  # never a 0-size array
  padded[: data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [
    bytes(gathered[i, : int(lengths[i][0])]).decode("utf-8") for i in range(gathered.shape[0])
  ]


def sync(name: str):
  """Waits until every process reached the barrier `name` (nothing on one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
