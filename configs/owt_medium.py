"""Paper: DiffEqFormer at GPT-medium shape on OpenWebText (Table 3 / App. C.4).

Differs from owt_small: 24 steps/layers, d 1024, 16 heads, MLP 4096, batch 256 (the
paper's batch for medium and large on OpenWebText), 100,000 steps (≈ 26 B tokens, our
choice: the paper's step count is not in our text).

  python main.py --config=configs/owt_medium.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/owt_medium.py --config.model.kind=gpt --workdir=$W_gpt --config.data.data_dir=$DATA

Expect: validation perplexity below owt_small's, DiffEqFormer at or below GPT-medium
(paper Table 2). Not run by us (accelerator pod).
"""
from configs import owt_small


def get_config():
  config = owt_small.get_config()
  config.num_train_steps = 100_000
  config.global_batch_size = 256
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.mlp_dim = 4096
  config.model.num_steps = 24
  return config
