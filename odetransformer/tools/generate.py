r"""Sampling from a trained model with a KV cache.

  python -m odetransformer.generate --workdir=W --prompt="def main(" \
      [--solver_steps=N] [--max_new_tokens=64] [--temperature=0.8] [--top_k=0] [--top_p=1.0] \
      [--seed=0] [--num_samples=1] [--step=S] [--mesh_shape=1,-1,1]

Loads the latest checkpoint of W, prepares it for cached decoding at N steps
(`decode.Decoder`: an Euler ODE is materialised into N layers with W(t_k) precomputed;
discrete models run their own layers) and samples in one jitted program: a prefill of
the (right-padded) prompts, then one `jax.lax.while_loop` over new tokens with a fixed
[slots, b, max_len, heads, head_dim] cache. Temperature, top-k and top-p are traced
values, so changing them does not recompile; temperature 0 is greedy decoding. The
model is restored sharded on the run's mesh (or `--mesh_shape`), the prompts replicated
on it; on several hosts it runs under `jax.distributed` like main.py and process 0
prints. Every flag is checked before anything is loaded.

Before the samples it says what to expect of a model of this size and training
(`what_to_expect`): configs/default.py's model, minutes on a CPU, writes locally
plausible but incoherent text.
"""

from collections.abc import Sequence
import functools
import math
import time

from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer import cli_flags
from odetransformer.errors import UserError
from odetransformer.model.decode import Decoder, KVCache
from odetransformer.model.materialize import MATERIALIZED_KIND
from odetransformer.runtime import host
from odetransformer.runtime.logs import quiet_tool_logs
from odetransformer.train import loading

PAD_ID = 0
# Below either, samples are locally plausible at best: the paper's smallest runs
# (configs/owt_small.py) train 124 M+ parameters on ~10 B tokens.
COHERENT_PARAMS = 100_000_000
COHERENT_TOKENS = 1_000_000_000


# --------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------
def filter_logits(logits_bv, top_k=0, top_p=1.0):
  """Logits with -inf outside the top-k / nucleus (top-p) set of each row.

  top-k keeps the k largest logits (ties broken by lower token id); top-p then keeps
  the smallest prefix of the remaining tokens, by decreasing probability, whose mass
  reaches `top_p` (the most likely token always stays). `top_k <= 0` and `top_p >= 1`
  switch a filter off. Both may be traced values.
  """
  logits = logits_bv.astype(jnp.promote_types(logits_bv.dtype, jnp.float32))
  vocab = logits.shape[-1]
  order = jnp.argsort(-logits, axis=-1, stable=True)  # rank r -> token id
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  rank = jnp.arange(vocab)
  keep = (top_k <= 0) | (rank < top_k)
  probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = keep & ((top_p >= 1.0) | (mass_before < top_p) | (rank == 0))
  keep_bv = jnp.take_along_axis(keep, jnp.argsort(order, axis=-1), axis=-1)
  return jnp.where(keep_bv, logits, -jnp.inf)


def sample_logits(logits_bv, rng, temperature=1.0, top_k=0, top_p=1.0):
  """One token per row: argmax when temperature == 0, else a filtered softmax sample."""
  logits = logits_bv.astype(jnp.promote_types(logits_bv.dtype, jnp.float32))
  greedy = jnp.argmax(logits, axis=-1)
  safe_t = jnp.where(temperature > 0, temperature, 1.0)
  filtered = filter_logits(logits / safe_t, top_k, top_p)
  sampled = jax.random.categorical(rng, filtered, axis=-1)
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


# --------------------------------------------------------------------------------------
# The decode loop
# --------------------------------------------------------------------------------------
class Sampler:
  """Batched sampling from a `Decoder`; the loop is compiled once per shape.

  Args:
    decoder: the prepared model.
    eos_id: generation of a row stops after it samples this token (None: never).
  """

  def __init__(self, decoder: Decoder, eos_id: int | None = None):
    self.decoder = decoder
    self.eos_id = -1 if eos_id is None else int(eos_id)

  def __call__(
    self,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    rng=None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    prompt_len: int | None = None,
  ):
    """Samples continuations of token prompts.

    Args:
      prompts: b non-empty lists of token ids.
      max_new_tokens: tokens to sample per row (fewer when every row hit eos).
      rng: PRNG key (default key 0).
      temperature, top_k, top_p: see `sample_logits`.
      prompt_len: pad prompts to this length (default: the longest prompt); a fixed
        value lets prompts of any length share one compiled program.
    Returns:
      int32 numpy [b, max_new_tokens]: sampled ids; after a row's eos, PAD_ID.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("every prompt needs at least one token (use [eos] to start a document)")
    if max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    longest = max(len(p) for p in prompts)
    prompt_len = longest if prompt_len is None else int(prompt_len)
    if longest > prompt_len:
      raise ValueError(f"a prompt has {longest} tokens, more than prompt_len={prompt_len}")
    cache_len = prompt_len + max_new_tokens
    limit = self.decoder.max_positions()
    if limit is not None and cache_len > limit:
      raise ValueError(
        f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) = {cache_len} "
        f"exceeds the model's {limit} learned positions (model.max_len)"
      )
    tokens = np.full((len(prompts), prompt_len), PAD_ID, np.int32)
    for i, p in enumerate(prompts):
      tokens[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    rng = jax.random.key(0) if rng is None else rng
    d = self.decoder
    args = (
      tokens,
      lengths,
      np.asarray(jax.random.key_data(rng)),
      np.float32(temperature),
      np.int32(top_k),
      np.float32(top_p),
      np.int32(self.eos_id),
    )
    mesh = loading.model_mesh(d.params)
    if mesh is not None:  # a sharded model: the (small) inputs replicated on its mesh
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      args = tuple(loading.global_array(x, replicated) for x in args)
    out = _sample_loop(
      d.step_fn(),
      d.num_slots,
      d.config,
      d.params,
      *args,
      max_new_tokens=int(max_new_tokens),
      cache_len=cache_len,
    )
    return loading.to_host(out)


@functools.partial(
  jax.jit, static_argnums=(0, 1, 2), static_argnames=("max_new_tokens", "cache_len")
)
def _sample_loop(
  step_fn,
  num_slots,
  cfg,
  params,
  prompt_bp,
  lengths_b,
  rng_data,
  temperature,
  top_k,
  top_p,
  eos_id,
  *,
  max_new_tokens: int,
  cache_len: int,
):
  """Prefill, then a while_loop sampling one token per row per iteration.

  Compiled once per decoder (`step_fn` is the decoder's own step function, static by
  identity) and shape; sampling settings and eos are traced. `rng_data` is the key's
  data (`jax.random.key_data`): a plain array, placed like the other inputs."""
  rng = jax.random.wrap_key_data(rng_data)
  b = prompt_bp.shape[0]
  dtype = jnp.dtype(cfg.dtype)
  shape = (num_slots, b, cache_len, cfg.num_heads, cfg.head_dim)
  cache = KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
  logits, cache = step_fn(params, prompt_bp, cache, jnp.zeros((b,), jnp.int32))
  last = jnp.take_along_axis(logits, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
  out = jnp.full((b, max_new_tokens), PAD_ID, jnp.int32)
  done = jnp.zeros((b,), bool)

  def cond(state):
    i, _, _, _, done = state
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, last, cache, out, done = state
    tok = sample_logits(last, jax.random.fold_in(rng, i), temperature, top_k, top_p)
    tok = jnp.where(done, PAD_ID, tok)
    out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
    done = done | (tok == eos_id)
    logits, cache = step_fn(params, tok[:, None], cache, lengths_b + i)
    return i + 1, logits[:, 0], cache, out, done

  _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), last, cache, out, done))
  return out


def _amount(n: float) -> str:
  for scale, unit in ((1e9, " B"), (1e6, " M"), (1e3, " k")):
    if n >= scale:
      return f"{n / scale:.1f}{unit}"
  return f"{n:.0f}"


def what_to_expect(num_params: int, steps: int, tokens: int | None = None) -> str:
  """One sentence on what samples of a model this size, trained this long, look like."""
  trained = f"{steps:,} steps" + (f" ({_amount(tokens)} tokens)" if tokens else "")
  model = f"a {_amount(num_params)}-parameter model trained for {trained}"
  small = num_params < COHERENT_PARAMS or (tokens or 0) < COHERENT_TOKENS
  if small:
    return (
      f"What to expect: {model} writes locally plausible but incoherent text; "
      "coherent text needs a paper-sized config (e.g. configs/owt_small.py, ~10 B "
      "tokens) and hours of GPU/TPU time."
    )
  return (
    f"What to expect: {model} is at the paper's scale; its samples are as good as "
    "its validation perplexity (python -m odetransformer.evaluate) says."
  )


def strip_after_eos(ids: Sequence[int], eos_id: int) -> list:
  """The ids before the first eos (and its padding)."""
  ids = [int(i) for i in ids]
  return ids[: ids.index(eos_id)] if eos_id in ids else ids


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
SEED_RANGE = (-(2**63), 2**63)  # what jax.random.key takes


def check_flags(f) -> None:
  """Every flag checked before any work (one-line UserErrors), the run's config.json
  included."""
  if f.max_new_tokens <= 0:
    raise UserError(
      f"--max_new_tokens={f.max_new_tokens} must be a positive number; pass "
      "how many tokens to sample, e.g. --max_new_tokens=64"
    )
  if f.num_samples <= 0:
    raise UserError(
      f"--num_samples={f.num_samples} must be >= 1; pass how many samples "
      "to draw, e.g. --num_samples=1"
    )
  if not SEED_RANGE[0] <= f.seed < SEED_RANGE[1]:
    raise UserError(
      f"--seed={f.seed} is out of range; pass an integer in [-2**63, 2**63), e.g. --seed=0"
    )
  if not 0 <= f.temperature < math.inf:  # also refuses nan
    raise UserError(
      f"--temperature={f.temperature} must be a finite number >= 0; pass e.g. "
      "--temperature=0.8, or 0 for greedy decoding"
    )
  if f.top_k < 0:
    raise UserError(f"--top_k={f.top_k} must be >= 0; pass e.g. --top_k=40, or 0 for all tokens")
  if not 0 < f.top_p <= 1:
    raise UserError(
      f"--top_p={f.top_p} must be in (0, 1]; pass e.g. --top_p=0.9, or 1 to turn it off"
    )
  if f.solver_steps is not None and f.solver_steps <= 0:
    raise UserError(
      f"--solver_steps={f.solver_steps} is not a step count; pass a positive "
      "integer, or leave it out for the training K"
    )
  if f.step is not None and f.step < 0:
    raise UserError(
      f"--step={f.step} is not a checkpoint step; pass a step >= 0, or leave "
      "--step out for the latest"
    )
  try:
    f.prompt.encode("utf-8")
  except UnicodeEncodeError as e:  # undecodable argv bytes arrive as lone surrogates
    raise UserError("--prompt is not valid UTF-8 text; pass the prompt in UTF-8") from e
  loading.parse_mesh_shape(f.mesh_shape)
  config = loading.load_run_config(f.workdir)
  cfg = config.model if f.solver_steps is not None else None
  if cfg is not None and not cfg.is_ode and f.solver_steps != cfg.depth:
    raise UserError(
      f"--solver_steps={f.solver_steps}: this run is a discrete {cfg.kind!r} "
      f"model of {cfg.depth} layers, which runs only at that depth; leave "
      "--solver_steps out"
    )


def main(argv, flag_values=None):
  """The command line (flags: `define_flags`); `flag_values` defaults to absl's FLAGS.

  Runs on the job's devices (several processes: `jax.distributed`, as main.py); the
  model is sharded as the run's mesh says (or --mesh_shape), the prompts replicated;
  only process 0 prints."""
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  flags_ = flags.FLAGS if flag_values is None else flag_values
  quiet_tool_logs(cli=True)
  # Every mistake in the flags is a UserError: one line and exit 2 (errors.run_cli).
  check_flags(flags_)
  host.initialize_distributed()
  loaded = loading.load_model(
    flags_.workdir,
    step=flags_.step,
    mesh_shape=flags_.mesh_shape,
    allow_unverified=flags_.checkpoint_allow_unverified,
  )
  print_ = print if jax.process_index() == 0 else lambda *_: None  # process 0 reports
  sp = loading.load_tokenizer(flags_.workdir, loaded.config)
  cfg = loaded.model_config
  t0 = time.perf_counter()
  try:
    decoder = Decoder(loaded.model, flags_.solver_steps)
  except ValueError as e:
    raise UserError(
      f"--solver_steps={flags_.solver_steps} cannot decode this model ({e}); "
      "pass another step count, or leave --solver_steps out"
    ) from e
  how = (
    f"materialised at N={decoder.num_steps} layers"
    if cfg.is_ode and cfg.solver in MATERIALIZED_KIND
    else f"{cfg.solver} solver at N={decoder.num_steps} steps"
    if cfg.is_ode
    else f"{decoder.num_steps} layers"
  )
  print_(
    f"checkpoint step {loaded.step} of {flags_.workdir}: {cfg.kind}/{cfg.family}, "
    f"trained at K={cfg.depth}; decoding {how} ({time.perf_counter() - t0:.1f}s)"
  )
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(loaded.model, nnx.Param)))
  batch = loaded.config.batch
  tokens = (loaded.step * batch.global_batch_size * batch.seq_len) or None
  print_(what_to_expect(num_params, loaded.step, tokens))

  prompt_ids = sp.encode(flags_.prompt) if flags_.prompt else []
  if not prompt_ids:
    prompt_ids = [sp.eos_id()]  # an empty prompt starts a new document
  max_new = flags_.max_new_tokens
  limit = decoder.max_positions()
  if limit is not None and len(prompt_ids) + max_new > limit:
    if len(prompt_ids) >= limit:
      raise UserError(
        f"the prompt has {len(prompt_ids)} tokens; the model embeds at most "
        f"{limit} positions; shorten --prompt"
      )
    max_new = limit - len(prompt_ids)
    print_(f"note: max_new_tokens lowered to {max_new} (model.max_len={limit})")

  sampler = Sampler(decoder, eos_id=sp.eos_id())
  prompts = [prompt_ids] * flags_.num_samples
  kwargs = dict(
    rng=jax.random.key(flags_.seed),
    temperature=flags_.temperature,
    top_k=flags_.top_k,
    top_p=flags_.top_p,
  )
  t0 = time.perf_counter()
  out = sampler(prompts, max_new, **kwargs)
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  out = sampler(prompts, max_new, **kwargs)  # compiled: the decode speed
  again = time.perf_counter() - t0
  n_new = sum(len(strip_after_eos(row, sp.eos_id())) for row in out)
  for i, row in enumerate(out):
    text = sp.decode(strip_after_eos(row, sp.eos_id()))
    print_(f"--- sample {i} ".ljust(60, "-") if flags_.num_samples > 1 else "-" * 60)
    print_(flags_.prompt + text)
  print_("-" * 60)
  print_(
    f"{n_new} new tokens in {again:.2f}s ({n_new / max(again, 1e-9):.1f} tokens/s; "
    f"first call incl. compilation {first:.1f}s)"
  )


def define_flags(flag_values=None):
  """Defines this command's flags in `flag_values` (default: absl's global FLAGS)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  define = cli_flags.definer(fv)
  define("string", "prompt", "", "Text to continue ('' = start a new document).")
  define("integer", "solver_steps", None, "Solver steps N (ODE kinds; default: the training K).")
  define("integer", "max_new_tokens", 64, "Tokens to sample (stops early at eos).")
  define("float", "temperature", 0.8, "Softmax temperature; 0 = greedy.")
  define("integer", "top_k", 0, "Sample from the k most likely tokens (0 = all).")
  define("float", "top_p", 1.0, "Nucleus sampling: smallest set of this much mass (1 = off).")
  define("integer", "seed", 0, "Sampling seed.")
  define("integer", "num_samples", 1, "Continuations of the prompt, sampled as one batch.")
  loading.define_load_flags(define)
  return fv


if __name__ == "__main__":
  cli_flags.run_absl_tool(main, define_flags)
