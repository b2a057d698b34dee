"""A discrete model in Hugging Face's terms: which transformers class it is, its weights
under that class's parameter names, its config.json, and the safetensors files.

`export.py` writes these into a model directory. The model exported is the discrete one
(`discrete_model`): an Euler ODE materialised at N steps, or a discrete model's own
layers, with plain float32 weights. The GPT and Llama baselines, and a 'split_euler'
ODE (materialised as sequential blocks), map onto the standard `GPT2LMHeadModel` and
`LlamaForCausalLM`; every parallel-block model onto
`OdeTransformerForCausalLM` (`hf_modeling.py`, shipped as `MODELING_FILE`).
"""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from odetransformer.errors import UserError
from odetransformer.model.blocks import REFERENCE_LLAMA_NORM_EPS
from odetransformer.model.materialize import MATERIALIZED_KIND, materialize, materialized_config
from odetransformer.model.transformer import LanguageModel

SHARD_BYTES = 5 * 2**30  # a larger model is written in shards of at most this
MODELING_FILE = "modeling_odetransformer.py"


# --------------------------------------------------------------------------------------
# The model as discrete layers
# --------------------------------------------------------------------------------------
def check_exportable(cfg, num_steps: int | None) -> None:
  """A one-line UserError unless a model of config `cfg` exports at `num_steps`."""
  if cfg.is_ode and cfg.solver not in MATERIALIZED_KIND:
    raise UserError(
      f"cannot export this {cfg.kind} model: only an Euler ODE ('euler' or "
      f"'split_euler') is N plain layers and its solver is {cfg.solver!r}; export a "
      "run trained with model.solver='euler' (evaluate and generate run this one as it is)"
    )
  if num_steps is not None and num_steps <= 0:
    raise UserError(f"--solver_steps={num_steps} is not a step count; pass a positive integer")
  # What is exported: an ODE's materialised layers (a split-Euler ODE's are sequential
  # blocks, GPT2LMHeadModel or LlamaForCausalLM), or the discrete model itself.
  exported = (
    materialized_config(cfg, cfg.depth if num_steps is None else num_steps) if cfg.is_ode else cfg
  )
  if cfg.kv_heads != cfg.num_heads and hf_architecture(exported) != "LlamaForCausalLM":
    raise UserError(
      f"model.num_kv_heads={cfg.kv_heads} (grouped-query attention) exports only as a "
      f"LlamaForCausalLM (a llama-family baseline or split-Euler ODE); "
      f"{hf_architecture(exported)} has as many key/value heads as query heads"
    )
  if not cfg.is_ode and num_steps is not None and num_steps != cfg.depth:
    raise UserError(
      f"--solver_steps={num_steps}: a discrete '{cfg.kind}' model has "
      f"{cfg.depth} layers; leave --solver_steps out"
    )


def discrete_model(model: LanguageModel, num_steps: int | None = None) -> LanguageModel:
  """The function that is exported, as a discrete model with plain stored weights:
  an ODE materialised at `num_steps` (split-)Euler steps (default: its K, dt folded into the
  output projections); a discrete model's own layers, LoRA merged and out_proj_scale
  folded in. Float32 compute. A one-line UserError when there is no such model."""
  cfg = model.config
  check_exportable(cfg, num_steps)
  disc = materialize(model, cfg.depth if num_steps is None else num_steps) if cfg.is_ode else model
  cfg = dataclasses.replace(
    disc.config,
    lora_rank=0,
    out_proj_scale=1.0,
    dtype="float32",
    param_dtype="float32",
    dropout_rate=0.0,
  )
  return disc.with_layers(cfg, disc.layer_weights(jnp.float32))


def hf_architecture(cfg) -> str:
  """The transformers class a discrete model of config `cfg` is exported as."""
  if cfg.block == "sequential":
    return "GPT2LMHeadModel" if cfg.family == "gpt2" else "LlamaForCausalLM"
  return "OdeTransformerForCausalLM"


# --------------------------------------------------------------------------------------
# Weights and configs
# --------------------------------------------------------------------------------------
# A llama-family layer's weights under LlamaForCausalLM's names within
# `model.layers.{i}.` (linear weights: + '.weight'); the import reads the same map.
LLAMA_LAYER_NAMES = {
  "wq": "self_attn.q_proj",
  "wk": "self_attn.k_proj",
  "wv": "self_attn.v_proj",
  "wo": "self_attn.o_proj",
  "w1": "mlp.gate_proj",
  "w3": "mlp.up_proj",
  "w2": "mlp.down_proj",
  "norm1_scale": "input_layernorm.weight",
  "norm2_scale": "post_attention_layernorm.weight",
}


def _top_level(model: LanguageModel) -> dict:
  cfg = model.config
  out = {"embed": model.embed[...], "final_norm_scale": model.final_norm_scale[...]}
  if cfg.family == "gpt2":
    out["pos_embed"] = model.pos_embed[...]
    out["final_norm_shift"] = model.final_norm_shift[...]
  if not cfg.tie_embeddings:
    out["head"] = model.head[...]
  return {k: np.asarray(v, np.float32) for k, v in out.items()}


def hf_state_dict(model: LanguageModel) -> dict:
  """{transformers parameter name: float32 array} of a discrete model."""
  cfg = model.config
  d = cfg.d_model
  top = _top_level(model)
  layers = {n: np.asarray(w, np.float32) for n, w in model.layer_weights(jnp.float32).items()}
  linear = lambda w: w.reshape(d, -1).T  # [d, n, h] / [d, f] -> torch [out, in]
  out_linear = lambda w: w.reshape(-1, d).T  # [n, h, d] / [f, d] -> torch [d, in]
  sd = {}
  if hf_architecture(cfg) == "GPT2LMHeadModel":  # Conv1D weights are [in, out]
    sd["transformer.wte.weight"] = top["embed"]
    sd["transformer.wpe.weight"] = top["pos_embed"]
    sd["transformer.ln_f.weight"] = top["final_norm_scale"]
    sd["transformer.ln_f.bias"] = top["final_norm_shift"]
    for i in range(cfg.depth):
      l = {n: w[i] for n, w in layers.items()}
      p = f"transformer.h.{i}."
      sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = l["norm1_scale"], l["norm1_shift"]
      sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = l["norm2_scale"], l["norm2_shift"]
      sd[p + "attn.c_attn.weight"] = np.concatenate(
        [l[w].reshape(d, d) for w in ("wq", "wk", "wv")], axis=1
      )
      sd[p + "attn.c_attn.bias"] = np.concatenate([l[b].reshape(d) for b in ("bq", "bk", "bv")])
      sd[p + "attn.c_proj.weight"], sd[p + "attn.c_proj.bias"] = l["wo"].reshape(d, d), l["bo"]
      sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = l["w1"], l["b1"]
      sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = l["w2"], l["b2"]
  else:
    llama = hf_architecture(cfg) == "LlamaForCausalLM"
    names = (
      LLAMA_LAYER_NAMES
      if llama
      else {
        "wq": "attn.q_proj",
        "wk": "attn.k_proj",
        "wv": "attn.v_proj",
        "wo": "attn.o_proj",
        "w1": "mlp.fc1",
        "w2": "mlp.fc2",
        "w3": "mlp.fc3",
        "norm1_scale": "norm1.weight",
        "norm1_shift": "norm1.bias",
        "norm2_scale": "norm2.weight",
        "norm2_shift": "norm2.bias",
      }
    )
    sd["model.embed_tokens.weight"] = top["embed"]
    if "pos_embed" in top:
      sd["model.embed_positions.weight"] = top["pos_embed"]
    sd["model.norm.weight"] = top["final_norm_scale"]
    if "final_norm_shift" in top:
      sd["model.norm.bias"] = top["final_norm_shift"]
    for i in range(cfg.depth):
      for n, w in layers.items():
        w = w[i]
        if n in ("wo", "w2"):
          w = out_linear(w)
        elif n.startswith("w"):
          w = linear(w)
        elif n.startswith("b"):  # biases: [n, h] -> [d]; b1 [f], bo/b2 [d]
          sd[f"model.layers.{i}.{names['w' + n[1:]]}.bias"] = w.reshape(-1)
          continue
        sd[f"model.layers.{i}.{names[n]}" + ("" if n.startswith("norm") else ".weight")] = w
  if not cfg.tie_embeddings:
    sd["lm_head.weight"] = top["head"].T
  if cfg.embed_scale != 1.0:
    if cfg.tie_embeddings and hf_architecture(cfg) != "OdeTransformerForCausalLM":
      raise UserError(
        f"model.embed_scale={cfg.embed_scale} with tied embeddings has no "
        f"{hf_architecture(cfg)} equivalent; export a model trained with "
        "model.embed_scale=1 or untied embeddings"
      )
    if hf_architecture(cfg) != "OdeTransformerForCausalLM":  # fold it into the tables
      for name in ("transformer.wte.weight", "transformer.wpe.weight", "model.embed_tokens.weight"):
        if name in sd:
          sd[name] = sd[name] * np.float32(cfg.embed_scale)
  return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}


def hf_config(cfg, context: int, dtype: str, special: dict) -> dict:
  """config.json of the exported model (`context`: the trained sequence length)."""
  arch = hf_architecture(cfg)
  common = {
    "architectures": [arch],
    "vocab_size": cfg.vocab_size,
    "tie_word_embeddings": cfg.tie_embeddings,
    "dtype": dtype,
    "use_cache": True,
    **special,
  }
  if arch == "GPT2LMHeadModel":
    return {
      "model_type": "gpt2",
      "n_embd": cfg.d_model,
      "n_layer": cfg.depth,
      "n_head": cfg.num_heads,
      "n_inner": cfg.mlp_dim,
      "n_positions": cfg.max_len,
      "n_ctx": cfg.max_len,
      "activation_function": "gelu_new",
      "layer_norm_epsilon": cfg.norm_eps,
      "resid_pdrop": 0.0,
      "embd_pdrop": 0.0,
      "attn_pdrop": 0.0,
      "scale_attn_weights": True,
      **common,
    }
  layers = {
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.depth,
    "num_attention_heads": cfg.num_heads,
    "max_position_embeddings": cfg.max_len if cfg.family == "gpt2" else context,
  }
  if arch == "LlamaForCausalLM":
    return {
      "model_type": "llama",
      **layers,
      "num_key_value_heads": cfg.kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.norm_eps,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
      "attention_bias": False,
      "mlp_bias": False,
      **common,
    }
  reference = cfg.llama_block == "reference"
  block_norm = "layer" if cfg.family == "gpt2" else "rms_shift" if reference else "rms"
  module = os.path.splitext(MODELING_FILE)[0]
  return {
    "model_type": "odetransformer",
    **layers,
    "family": cfg.family,
    "norm_eps": cfg.norm_eps,
    "block_norm": block_norm,
    "block_norm_eps": REFERENCE_LLAMA_NORM_EPS if reference else cfg.norm_eps,
    "ffn_reads_attn_norm": reference,
    "rope_base": cfg.rope_base,
    "embed_scale": cfg.embed_scale,
    "auto_map": {
      "AutoConfig": f"{module}.OdeTransformerConfig",
      "AutoModelForCausalLM": f"{module}.OdeTransformerForCausalLM",
    },
    **common,
  }


def safetensors_files(state: dict, max_bytes: int = SHARD_BYTES) -> dict:
  """{file name: bytes}: model.safetensors, or shards of at most `max_bytes` (a larger
  tensor alone) and model.safetensors.index.json."""
  from safetensors.numpy import save  # lazy: only writing the weights needs safetensors

  shards, size = [{}], 0
  for name, x in state.items():
    if size and size + x.nbytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = x
    size += x.nbytes
  meta = {"format": "pt"}
  if len(shards) == 1:
    return {"model.safetensors": save(shards[0], metadata=meta)}
  files, weight_map = {}, {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    files[fname] = save(shard, metadata=meta)
    weight_map.update({name: fname for name in shard})
  index = {
    "metadata": {"total_size": sum(x.nbytes for x in state.values())},
    "weight_map": weight_map,
  }
  files["model.safetensors.index.json"] = json.dumps(index, indent=2).encode()
  return files
