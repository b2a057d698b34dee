"""Merging LoRA adapters into their base weights (for export as a plain model)."""
import dataclasses

from odetransformer.model import LanguageModel, create_model


def merge_lora(model: LanguageModel) -> LanguageModel:
  """A plain discrete model (no adapters, all weights trainable) with W = W0 + s·A·B."""
  cfg = model.config
  if not cfg.lora_rank:
    raise ValueError("this model has no LoRA adapters to merge")
  merged = create_model(dataclasses.replace(cfg, lora_rank=0, lora_train_embeddings=False))
  for name, w in model.stack.layers().items():
    merged.stack.params[name][...] = w
  for name in ("embed", "pos_embed", "final_norm_scale", "final_norm_shift", "head"):
    if hasattr(model, name):
      getattr(merged, name)[...] = getattr(model, name)[...]
  return merged
