"""Paper: DiffEqFormer at GPT-small shape on WikiText-103 (Table 1 / App. C.4).

Differs from owt_small: the WikiText-103 corpus (detokenized), peak lr 6e-4 and
20,000 steps × 512 × 1024 tokens (WikiText-103 has ~103 M training tokens, so ≈ 100
epochs: the paper reports that GPT overfits here and DiffEqFormer less so; its step
count and WikiText batch size are not in our text — 512 and 20k are our choice).
Evaluation is on the validation split.

  python -m input_pipeline.prepare --dataset=wikitext103 --data_dir=$DATA
  python main.py --config=configs/wikitext103_small.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/wikitext103_small.py --config.model.kind=gpt --workdir=$W_gpt --config.data.data_dir=$DATA
  Weight-sharing baseline (Zhong et al.): --config.model.kind=shared

Expect: DiffEqFormer below GPT-small and the weight-sharing ODE in validation
perplexity (paper Table 1). Not run by us (accelerator pod).
"""
from configs import owt_small


def get_config():
  config = owt_small.get_config()
  config.num_train_steps = 20_000
  config.eval_every_steps = 1_000
  config.checkpoint_every_steps = 1_000
  config.data.source = "wikitext103"
  config.data.eval_max_batches = 0      # the whole validation split (~250 k tokens)
  config.optim.learning_rate = 6e-4
  return config
