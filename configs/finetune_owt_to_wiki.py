"""Paper Fig. 5 (left): pre-train on OpenWebText with 18 steps at GPT-medium width,
fine-tune on WikiText-103 with N ∈ {9, 12, 18, 24} steps, each method.

Pre-train (18 steps; the GPT baseline has 24 layers in the paper's figure):
  python main.py --config=configs/owt_medium.py --config.model.num_steps=18 --workdir=$PRE
Fine-tune, for N in 9 12 18 24 and METHOD in continuous full lora:
  python main.py --config=configs/finetune_owt_to_wiki.py --workdir=$W_${METHOD}_$N \
      --config.init_from=$PRE --config.finetune.method=$METHOD \
      --config.finetune.num_steps=$N --config.data.data_dir=$DATA

Expect: with LoRA every N beats the GPT baseline; full fine-tuning is comparable to
GPT, and fewer steps overfit less (paper Section 6.2). Not run by us (accelerator pod).
"""
import ml_collections

from configs import wikitext103_medium


def get_config():
  config = wikitext103_medium.get_config()
  config.init_from = ""                    # required: the OpenWebText pre-training workdir
  config.finetune = ml_collections.ConfigDict()
  config.finetune.method = "lora"          # 'continuous' | 'full' | 'lora'
  config.finetune.num_steps = 18           # N ∈ {9, 12, 18, 24}
  config.finetune.lora_rank = 16
  config.finetune.lora_alpha = 32.0
  config.finetune.targets = "wq,wk,wv,wo"
  config.finetune.train_embeddings = False
  config.num_train_steps = 10_000
  config.optim.learning_rate = 1e-4
  return config
