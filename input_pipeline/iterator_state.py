"""Training-iterator state: JSON round trips and worker-count changes (grain 0.2.18).

The training code saves `iter(datasets.train).get_state()` as JSON in each checkpoint
(one state per process, each naming the input shards it reads) and hands it back to
`restore_iterator_state`, which repairs what JSON changed, picks this process's shards
(from every process's states when the process count changed) and, since the stream does
not depend on `data.worker_count`, rewrites the document position for the current
worker count. Both rely on grain 0.2.18's state layout;
tests/test_input_pipeline.py pins the behaviour.
"""

from typing import Any

from absl import logging
import grain

from input_pipeline.errors import DataError


def fix_grain_state(state: Any) -> Any:
  """Undoes what JSON does to grain 0.2.18 iterator states.

  ConcatThenSplitIterDataset keeps `remainder_slices` as tuples and compares them with
  the sentinel `(-1, -1)`; after JSON they are lists, the comparison fails and the
  restored iterator resumes from the wrong place. The
  interleave behind worker processes keys `future_states` by int; JSON makes them str.
  """
  if isinstance(state, dict):
    out = {}
    for k, v in state.items():
      if k == "remainder_slices":
        out[k] = {kk: tuple(vv) for kk, vv in v.items()}
      elif k == "future_states":
        out[k] = {int(kk): fix_grain_state(vv) for kk, vv in v.items()}
      else:
        out[k] = fix_grain_state(v)
    return out
  if isinstance(state, list):
    return [fix_grain_state(x) for x in state]
  return state


def _documents_read(doc_state: dict[str, Any]) -> int | None:
  """Documents consumed, from a tokenized-document stream's state (None: not one)."""
  if set(doc_state) == {"next_index"}:
    return doc_state["next_index"]
  inner = doc_state.get("iterators_in_use_states")
  if (
    isinstance(inner, list)
    and not doc_state.get("future_states")
    and not any(doc_state.get("exhausted", []))
    and doc_state.get("iterators_in_use_indices") == list(range(len(inner)))
    and all(isinstance(x, dict) and set(x) == {"next_index"} for x in inner)
  ):
    return sum(x["next_index"] for x in inner)  # round-robin over strided worker slices
  return None


def _documents_state(read: int, num_workers: int) -> dict[str, Any]:
  """The state of a tokenized-document stream that has consumed `read` documents."""
  if num_workers == 0:
    return {"next_index": read}
  n = num_workers
  return {
    "next_index_in_cycle": read % n,
    "next_index_in_datasets": n,
    "iterators_in_use_indices": list(range(n)),
    "iterators_in_use_states": [{"next_index": (read - i + n - 1) // n} for i in range(n)],
    "exhausted": [0] * n,
    "future_states": {},
  }


def _num_workers(state: Any) -> int | None:
  """Worker count of the document stream inside a training iterator state."""
  if isinstance(state, dict):
    doc = state.get("parent_state")  # ConcatThenSplit's parent: the document stream
    if isinstance(doc, dict) and _documents_read(doc) is not None:
      inner = doc.get("iterators_in_use_states")
      return 0 if inner is None else len(inner)
    for v in state.values():
      if (n := _num_workers(v)) is not None:
        return n
  return None


def _with_workers(state: Any, num_workers: int, read: int | None = None) -> Any:
  """Rewrites the document-stream states inside `state` for `num_workers` workers (and,
  given `read`, for that many documents read)."""
  if not isinstance(state, dict):
    return state
  out = {}
  for k, v in state.items():
    if k == "parent_state" and isinstance(v, dict) and (n := _documents_read(v)) is not None:
      out[k] = _documents_state(n if read is None else read, num_workers)
    else:
      out[k] = _with_workers(v, num_workers, read)
  return out


def _next_epoch_state(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
  """`now` (a fresh state) moved to the start of the epoch after the furthest one that
  `saved` (every shard of a stream of another shard count) had reached."""
  old_n, new_n, docs = saved["num_shards"], now["num_shards"], now["num_documents"]
  reached = []
  for shard, state in saved["shards"].items():
    read = _documents_read(_find_documents_state(state))
    reached.append(0 if read == 0 else (int(shard) + (read - 1) * old_n) // docs)
  start = (max(reached) + 1) * docs  # global position of the next epoch's start
  logging.warning(
    "the checkpoint's data stream has %d input shards, this run %d: the stream continues "
    "at the start of epoch %d (document position %d), the rest of epoch %d is skipped; no "
    "token is repeated. Set data.input_shards=%d to continue exactly.",
    old_n,
    new_n,
    max(reached) + 1,
    start,
    max(reached),
    old_n,
  )
  shards = {}
  for shard, state in now["shards"].items():
    read = -(-(start - int(shard)) // new_n)  # this shard's positions below `start`
    shards[shard] = _with_workers(state, _num_workers(state) or 0, read)
  return {**now, "shards": shards}


def _find_documents_state(state: Any) -> Any:
  """The document stream's state inside one shard's state."""
  if isinstance(state, dict):
    doc = state.get("parent_state")
    if isinstance(doc, dict) and _documents_read(doc) is not None:
      return doc
    for v in state.values():
      if (found := _find_documents_state(v)) is not None:
        return found
  return None


def _merged(states: Any) -> dict[str, Any]:
  """One state holding every shard: `states` is one process's state, or the list of
  every process's states (as a checkpoint keeps them)."""
  if isinstance(states, dict):
    states = [states]
  # Written before input shards: every process held the state of the one global stream,
  # which is shard 0 of 1 (the same documents, packing and row order).
  states = [x if "num_shards" in x else {"num_shards": 1, "shards": {"0": x}} for x in states]
  counts = {x["num_shards"] for x in states}
  if len(counts) != 1:
    raise DataError(
      f"the checkpoint's data-iterator states disagree on the input shard "
      f"count ({sorted(counts)}); fix: start a new --workdir"
    )
  return {
    "num_shards": counts.pop(),
    "shards": {k: v for x in states for k, v in x["shards"].items()},
  }


def restore_iterator_state(iterator: grain.DatasetIterator, state: Any) -> None:
  """Restores `iterator` (from `iter(datasets.train)`) to JSON-loaded saved state.

  `state` is this process's `get_state()`, or the list of every process's states of a
  run with another process count: each input shard continues exactly where it was,
  whichever process reads it now, as long as `data.input_shards` is the same. With
  another shard count (another stream) every shard starts at the beginning of the epoch
  after the furthest one reached, skipping the rest of that epoch, so that no token is
  seen twice in an epoch; a warning says so. Besides undoing JSON's changes
  (`fix_grain_state`), this accepts a state saved with another `data.worker_count`: the
  stream does not depend on it, so the position (documents read) carries over exactly.
  """
  saved = _merged(fix_grain_state(state))
  now = iterator.get_state()
  if saved["num_shards"] != now["num_shards"]:
    iterator.set_state(_next_epoch_state(saved, now))
    return
  state = {**now, "shards": {k: saved["shards"][k] for k in now["shards"]}}
  workers_now = _num_workers(now)
  if workers_now is not None and _num_workers(state) not in (None, workers_now):
    state = _with_workers(state, workers_now)
  iterator.set_state(state)
