"""Parameter and FLOP counts without allocating a model (`nnx.eval_shape`).

`python -m odetransformer.model.param_count` prints, as a Markdown table, the parameters
of the paper's shapes (Table 3) at d_t = 96, S = 128: each DiffEqFormer beside its GPT
or Llama baseline and their ratio (the figures: benchmarks/README.md, "Parameter counts").
A DiffEqFormer holds about d_t × one layer's parameters in its projections P, plus as
many again in P0, whatever K it is run at.
"""

from flax import nnx
import jax

from odetransformer.model import solvers
from odetransformer.model.blocks import layer_param_specs
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import LanguageModel

PAPER_SHAPES = {
  # name: (family, layers, d_model, heads, mlp_dim, vocab)
  "gpt-small": ("gpt2", 12, 768, 12, 3072, 50304),
  "gpt-medium": ("gpt2", 24, 1024, 16, 4096, 50304),
  "gpt-large": ("gpt2", 36, 1280, 20, 5120, 50304),
  "llama-1b": ("llama", 16, 2048, 16, 8192, 32000),
}


def paper_config(
  name: str, kind: str = "diffeqformer", time_embed_dim: int = 96, time_sinusoids: int = 128
) -> ModelConfig:
  family, layers, d, heads, mlp, vocab = PAPER_SHAPES[name]
  return ModelConfig(
    kind=kind,
    family=family,
    vocab_size=vocab,
    d_model=d,
    num_heads=heads,
    mlp_dim=mlp,
    solver_steps=layers,
    num_layers=layers,
    max_len=1024,
    time_embed_dim=time_embed_dim,
    time_sinusoids=time_sinusoids,
  )


def count_params(cfg: ModelConfig) -> int:
  """Number of trainable parameters, from shapes only."""
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def layer_params(cfg: ModelConfig) -> int:
  """Parameters of one transformer layer of this shape (what a solver step uses)."""
  total = 0
  for spec in layer_param_specs(cfg).values():
    n = 1
    for s in spec.shape:
      n *= s
    total += n
  return total


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, num_steps: int | None = None):
  """The attention scores' share of `flops_per_token`: 6·K·seq·d (causal)."""
  evals = solvers.field_cost(cfg.solver) if cfg.is_ode else 1  # whole-field evaluations
  return 6.0 * (num_steps or cfg.depth) * evals * seq_len * cfg.d_model


def flops_per_token(
  cfg: ModelConfig, seq_len: int, num_steps: int | None = None, tokens_per_batch: int | None = None
) -> float:
  """Training FLOPs (forward + backward) per token, for MFU.

  6·(K·layer params + head) + 6·K·seq·d for attention scores (causal, halved from 12);
  for DiffEqFormer also the weight generation, 6·K·d_t·layer params per batch,
  amortised over `tokens_per_batch` when given.
  """
  k = num_steps or cfg.depth
  evals = solvers.field_cost(cfg.solver) if cfg.is_ode else 1  # split_euler: 1 a step
  lp = layer_params(cfg)
  flops = 6.0 * (k * evals * lp + cfg.d_model * cfg.vocab_size)
  flops += attention_flops_per_token(cfg, seq_len, num_steps)
  if cfg.kind == "diffeqformer" and tokens_per_batch:
    stages = len(solvers.STAGE_NODES[cfg.solver])  # distinct stage times (rk4: 3)
    flops += 6.0 * k * stages * cfg.time_embed_dim * lp / tokens_per_batch
  return flops


def table() -> str:
  rows = [
    "| shape | layers/K | d | heads | GPT params | DiffEqFormer params (d_t 96) | ratio |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, (_family, layers, d, heads, _, _) in PAPER_SHAPES.items():
    ode = count_params(paper_config(name))
    gpt = count_params(paper_config(name, kind="transformer"))
    rows.append(
      f"| {name} | {layers} | {d} | {heads} | {gpt / 1e6:,.1f} M | "
      f"{ode / 1e6:,.1f} M | {ode / gpt:.1f}× |"
    )
  return "\n".join(rows)


if __name__ == "__main__":
  print(table())
