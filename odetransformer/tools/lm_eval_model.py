"""An lm-evaluation-harness (lm_eval 0.4.x) model: `--model odetransformer`.

Importing this module registers `ODETransformerLM` under the name 'odetransformer'
(it needs `lm_eval`, an optional dependency: requirements-eval.txt). The plain
`lm_eval` CLI cannot import project models, so run the harness through
`python -m odetransformer.lm_eval` (odetransformer/tools/lm_eval.py), which imports this
module first.

model_args (comma-separated key=value):
  workdir       training run directory (required)
  solver_steps  solver steps N for ODE kinds (default: the training K); the old name
                num_steps still works for one release, with a warning
  step          checkpoint step (default: the latest)
  max_length    context window in tokens (default: the run's seq_len; for the gpt
                family at most model.max_len)
  max_gen_toks  default generation budget of generate_until (default 256, capped so
                that a prompt keeps at least a quarter of max_length)
  seed          sampling seed for generate_until with do_sample (default 0)
  mesh_shape    device mesh (data;fsdp;tensor) to load the model on, e.g. 1;-1;1
                (default: the run's config.mesh.shape over all devices); under
                several processes (`jax.distributed`) every process scores the same
                requests and only process 0 writes results
`batch_size` (the harness passes it as a string; 'auto' means the default, 8) sets
the rows of every scoring batch; `device` and `max_batch_size` are ignored (JAX
places the computation).

Scoring runs the model's own N-step forward pass on fixed-shape [batch_size,
max_length] batches (padded rows and positions carry weight 0), so the jitted scorer
compiles once. Generation uses the KV-cache decoder (`decode.Decoder`) with a fixed
prompt length, so it compiles once per `max_gen_toks`.
"""

import functools
import logging

from flax import nnx
import jax
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
import numpy as np
from tqdm import tqdm

from odetransformer.model.decode import Decoder
from odetransformer.runtime.logs import quiet_tool_logs
from odetransformer.tools.generate import Sampler, strip_after_eos
from odetransformer.train import evaluation, loading, sharding

_log = logging.getLogger(__name__)
DEFAULT_BATCH_SIZE = 8


def _score(graphdef, num_steps, rules, state, batch):
  """Per row, by the one scorer (`evaluation.score_rows`): (sum of weighted target
  log-probs, all weighted targets are the argmax)."""
  scores = evaluation.score_rows(nnx.merge(graphdef, state), batch, rules, num_steps)
  return -scores["nll"], scores["greedy"]


@register_model("odetransformer")
class ODETransformerLM(TemplateLM):
  """A trained odetransformer checkpoint (any kind) as an lm_eval `TemplateLM`."""

  def __init__(
    self,
    workdir: str | None = None,
    solver_steps=None,
    step=None,
    batch_size=DEFAULT_BATCH_SIZE,
    max_length=None,
    max_gen_toks=256,
    seed=0,
    device=None,
    max_batch_size=None,
    mesh_shape="",
    *,
    model=None,
    tokenizer=None,
    **kwargs,
  ):
    super().__init__()
    del device, max_batch_size  # JAX places the computation; no adaptive batch size
    if "num_steps" in kwargs:  # its name before solver_steps, for one release
      _log.warning(
        "odetransformer: model_args num_steps is deprecated and will be "
        "removed in the next release: use solver_steps"
      )
      solver_steps = kwargs.pop("num_steps")
    if kwargs:
      _log.warning("odetransformer: ignoring unknown model_args %s", sorted(kwargs))
    rules = None
    if model is None:
      if not workdir:
        raise ValueError("odetransformer needs model_args workdir=<training run directory>")
      quiet_tool_logs()
      loaded = loading.load_model(
        str(workdir),
        step=None if step in (None, "") else int(step),
        mesh_shape=str(mesh_shape or "").replace(";", ","),
      )
      model, rules = loaded.model, loaded.rules
      tokenizer = loading.load_tokenizer(str(workdir), loaded.config)
      default_len = loaded.config.batch.seq_len
    else:
      if tokenizer is None:
        raise ValueError("pass tokenizer= with model=")
      default_len = model.config.max_len
    cfg = model.config
    self.model = model
    self.tokenizer_sp = tokenizer
    self.num_steps = model.resolve_num_steps(
      None if solver_steps in (None, "") else int(solver_steps)
    )
    self._max_length = int(max_length) if max_length not in (None, "") else default_len
    if cfg.family == "gpt2" and self._max_length > cfg.max_len:
      raise ValueError(
        f"max_length={self._max_length} exceeds the model's {cfg.max_len} "
        "learned positions (model.max_len)"
      )
    if isinstance(batch_size, str) and not batch_size.strip().isdigit():
      if not batch_size.startswith("auto"):
        raise ValueError(f"batch_size={batch_size!r}: expected an integer or 'auto'")
      batch_size = DEFAULT_BATCH_SIZE
    self.batch_size = max(1, int(batch_size))
    self.max_gen_toks = int(max_gen_toks)
    self.seed = int(seed)
    graphdef, self._state = nnx.split(model)
    self._mesh = loading.model_mesh(self._state)
    self._rules = tuple(rules) if rules else sharding.logical_axis_rules(None)
    self._scorer = jax.jit(functools.partial(_score, graphdef, self.num_steps, self._rules))
    self._sampler = None  # built on the first generate_until

  # --- what TemplateLM needs -----------------------------------------------------------
  @property
  def eot_token_id(self) -> int:
    return self.tokenizer_sp.eos_id()

  @property
  def max_length(self) -> int:
    return self._max_length

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list:
    del add_special_tokens, kwargs  # no BOS: documents start right after an eos
    return list(self.tokenizer_sp.encode(string))

  def tok_decode(self, tokens, skip_special_tokens=True) -> str:
    del skip_special_tokens
    return self.tokenizer_sp.decode([int(t) for t in tokens])

  # --- scoring -------------------------------------------------------------------------
  def score_token_pairs(self, pairs):
    """[(context_ids, continuation_ids)] -> [(log P(continuation | context), is_greedy)].

    Each pair becomes one row: context + continuation, left-truncated to the last
    max_length + 1 tokens; only the continuation's tokens are scored.
    """
    length = self.max_length
    results = []
    for start in range(0, len(pairs), self.batch_size):
      chunk = pairs[start : start + self.batch_size]
      inputs = np.zeros((self.batch_size, length), np.int32)
      targets = np.zeros((self.batch_size, length), np.int32)
      weights = np.zeros((self.batch_size, length), np.float32)
      for i, (ctx, cont) in enumerate(chunk):
        if not cont:
          continue
        if len(cont) > length:
          raise ValueError(
            f"a continuation of {len(cont)} tokens does not fit in max_length={length}"
          )
        if not ctx:
          raise ValueError("an empty context: lm_eval passes the prefix token instead")
        full = (list(ctx) + list(cont))[-(length + 1) :]
        n = len(full) - 1
        inputs[i, :n] = full[:-1]
        targets[i, :n] = full[1:]
        weights[i, n - len(cont) : n] = 1.0
      logp, greedy = self._score_rows(inputs, targets, weights)
      results.extend((float(logp[i]), bool(greedy[i])) for i in range(len(chunk)))
    return results

  def _score_rows(self, inputs, targets, weights) -> tuple:
    """The scorer on one batch: numpy (log-probs, greedy) per row. On a mesh the batch
    goes in as global arrays split by the 'batch' rule (padded to its shards) and the
    rows come back from every process."""
    batch = {"inputs": inputs, "targets": targets, "weights": weights}
    if self._mesh is None:
      return jax.device_get(self._scorer(self._state, batch))
    batch = evaluation.global_batch_from_full(batch, self._mesh, self._rules)
    with evaluation.mesh_context(self._mesh, self._rules):
      out = self._scorer(self._state, batch)
    return tuple(loading.to_host(x)[: len(inputs)] for x in out)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    pairs = [(ctx, cont) for _, ctx, cont in requests]
    results = []
    for start in tqdm(
      range(0, len(pairs), self.batch_size),
      disable=disable_tqdm,
      desc="odetransformer loglikelihood",
    ):
      results.extend(self.score_token_pairs(pairs[start : start + self.batch_size]))
    for (key, _, _), answer in zip(requests, results):
      if key is not None and key[0] is not None:
        self.cache_hook.add_partial("loglikelihood", key, answer)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    """Log-likelihood of whole strings, scored in disjoint rolling windows of
    max_length tokens (the first token conditioned on the prefix token, eos)."""
    windows, owner = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for ctx, cont in map(
        lm_utils.make_disjoint_window,
        lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string),
          prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length,
          context_len=1,
        ),
      ):
        windows.append((None, ctx, cont))
        owner.append(i)
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
    totals = [0.0] * len(requests)
    for i, (logp, _) in zip(owner, scores):
      totals[i] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # --- generation ----------------------------------------------------------------------
  def generate_until(self, requests, disable_tqdm: bool = False):
    """Greedy (or sampled, with do_sample) continuations, cut at the first stop string."""
    if self._sampler is None:
      self._sampler = Sampler(
        Decoder(self.model, self.num_steps), eos_id=self.tokenizer_sp.eos_id()
      )
    default_gen = min(self.max_gen_toks, max(1, (3 * self.max_length) // 4))
    groups = {}
    for idx, req in enumerate(requests):
      context, gen_kwargs = req.args
      groups.setdefault(repr(sorted(gen_kwargs.items())), []).append((idx, context, gen_kwargs))
    out = [None] * len(requests)
    pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="odetransformer generate_until")
    for batch_no, items in enumerate(groups.values()):
      kwargs = normalize_gen_kwargs(items[0][2], default_gen)
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = int(kwargs.pop("max_gen_toks"))
      if max_new >= self.max_length:
        raise ValueError(
          f"max_gen_toks={max_new} leaves no room for a prompt in max_length={self.max_length}"
        )
      temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
      prompt_len = self.max_length - max_new
      for start in range(0, len(items), self.batch_size):
        chunk = items[start : start + self.batch_size]
        prompts = [
          (self.tok_encode(c) or [self.prefix_token_id])[-prompt_len:] for _, c, _ in chunk
        ]
        prompts += [prompts[0]] * (self.batch_size - len(prompts))  # fixed batch shape
        rng = jax.random.fold_in(jax.random.key(self.seed), batch_no * 100003 + start)
        tokens = self._sampler(
          prompts,
          max_new,
          rng=rng,
          temperature=temperature,
          top_k=int(kwargs.get("top_k", 0) or 0),
          top_p=float(kwargs.get("top_p", 1.0) or 1.0),
          prompt_len=prompt_len,
        )
        for row, (idx, context, gen_kwargs) in zip(tokens, chunk):
          text = self.tok_decode(strip_after_eos(row, self.eot_token_id))
          for stop in until:
            if stop:
              text = text.split(stop)[0]
          out[idx] = text
          self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        pbar.update(len(chunk))
    pbar.close()
    return out
