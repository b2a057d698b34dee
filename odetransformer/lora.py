"""Merging LoRA adapters into their base weights (for export as a plain model)."""
import dataclasses

from odetransformer.model import LanguageModel, build_from_values


def merge_lora(model: LanguageModel) -> LanguageModel:
  """A plain discrete model (no adapters, all weights trainable) with W = W0 + s·A·B."""
  cfg = model.config
  if not cfg.lora_rank:
    raise ValueError("this model has no LoRA adapters to merge")
  plain = dataclasses.replace(cfg, lora_rank=0, lora_train_embeddings=False)
  return build_from_values(plain, model.stack.layers(), model)
