"""Merging LoRA adapters into their base weights (for export as a plain model)."""
import dataclasses

from odetransformer.model.transformer import LanguageModel, build_from_values


def merge_lora(model: LanguageModel) -> LanguageModel:
  """A plain discrete model (no adapters, all weights trainable) with W = W0 + s·A·B.

  A materialised ODE's step size (`out_proj_scale`, over W_O, W_2 and their updates) is
  folded into the merged weights, so the result computes the same function with scale 1.
  """
  cfg = model.config
  if not cfg.lora_rank:
    raise ValueError("this model has no LoRA adapters to merge")
  plain = dataclasses.replace(cfg, lora_rank=0, lora_train_embeddings=False,
                              out_proj_scale=1.0)
  return build_from_values(plain, model.stack.layers(), model)
