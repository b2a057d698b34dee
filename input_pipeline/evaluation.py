"""The eval pass: every token of the eval split scored exactly once.

Documents in their stored order, with one eos in front of the first (so its first
token is scored too), cut into windows that overlap by one token, so every token of the
split (each document plus its eos) is a target exactly once. The last batch is padded
(segment id 0, weight 0), never dropped. Rows follow the training batches' convention
(`input_pipeline.packing`).

Evaluation is bounded (`eval_max_batches`) and read whole by every process, which keeps
its rows `[p * local, (p + 1) * local)` of each eval batch, so every process yields the
same number of batches.
"""

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from input_pipeline.packing import TOKENS, Batch, tokenized_documents


def _eval_row(tokens: np.ndarray, docs: np.ndarray, seq_len: int) -> Batch:
  """One eval window (<= seq_len+1 tokens and each one's document index) -> a row.

  A short (last) window is padded with zeros to seq_len+1 first, so that, as in
  training, inputs = w[:-1] and targets = w[1:] of one window.
  """
  m = len(tokens)  # real tokens in the window; m - 1 of them are scored targets
  window = np.zeros(seq_len + 1, np.int32)
  window[:m] = tokens
  n_in = min(m, seq_len)  # real inputs
  d = docs[:n_in]
  starts = np.concatenate([[True], d[1:] != d[:-1]])
  segment_ids = np.zeros(seq_len, np.int32)
  segment_ids[:n_in] = np.cumsum(starts)
  positions = np.zeros(seq_len, np.int32)
  positions[:n_in] = np.arange(n_in) - np.maximum.accumulate(np.where(starts, np.arange(n_in), 0))
  weights = np.zeros(seq_len, np.float32)
  weights[: m - 1] = 1.0
  return {
    "inputs": window[:-1],
    "targets": window[1:],
    "segment_ids": segment_ids,
    "positions": positions,
    "weights": weights,
  }


def eval_rows(documents: Iterable[np.ndarray], seq_len: int, eos_id: int) -> Iterator[Batch]:
  """Cuts the token stream [eos] + doc_0 + doc_1 + ... into rows scoring each token once."""
  tok_buf = [np.asarray([eos_id], np.int32)]
  doc_buf = [np.asarray([-1], np.int64)]
  buffered = 1
  for i, tokens in enumerate(documents):
    tok_buf.append(tokens)
    doc_buf.append(np.full(len(tokens), i, np.int64))
    buffered += len(tokens)
    if buffered < seq_len + 1:
      continue
    toks, docs = np.concatenate(tok_buf), np.concatenate(doc_buf)
    start = 0
    while len(toks) - start >= seq_len + 1:
      yield _eval_row(toks[start : start + seq_len + 1], docs[start : start + seq_len + 1], seq_len)
      start += seq_len  # the last token is the next window's first input
    tok_buf, doc_buf, buffered = [toks[start:]], [docs[start:]], len(toks) - start
  toks, docs = np.concatenate(tok_buf), np.concatenate(doc_buf)
  if len(toks) > 1:
    yield _eval_row(toks, docs, seq_len)


def eval_batches(
  source: Sequence,
  model_proto: bytes,
  eos_id: int,
  *,
  seq_len: int,
  global_batch_size: int,
  process_index: int,
  process_count: int,
  text_key: str,
  max_batches: int = 0,
) -> Iterator[Batch]:
  """One deterministic pass over `source`: process-local batches, the last one padded."""
  local = global_batch_size // process_count
  docs = tokenized_documents(
    source, model_proto, text_key=text_key, seed=None, num_epochs=1, worker_count=0
  )
  rows: list[Batch] = []
  emitted = 0

  def make_batch() -> Batch:
    pad = {k: np.zeros_like(v) for k, v in rows[0].items()}
    full = rows + [pad] * (global_batch_size - len(rows))
    mine = full[process_index * local : (process_index + 1) * local]
    return {k: np.stack([r[k] for r in mine]) for k in rows[0]}

  for row in eval_rows((d[TOKENS] for d in docs), seq_len, eos_id):
    rows.append(row)
    if len(rows) == global_batch_size:
      yield make_batch()
      rows, emitted = [], emitted + 1
      if max_batches and emitted >= max_batches:
        return
  if rows:
    yield make_batch()
