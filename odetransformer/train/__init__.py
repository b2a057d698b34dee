"""Training: the loop (`loop.train_and_evaluate`), its checked set-up (`setup.check_run`),
the jitted steps, the one evaluation
path every evaluation runs (`evaluation`: the scorer, the eval data), optimizer, losses,
metrics, health checks, the mesh and sharding rules, `checkpoint/` (save, integrity,
restore, resume fingerprints), loading a trained run, and fine-tuning's start from a
pre-trained run.

May import: `odetransformer.model`, `odetransformer.runtime`, `odetransformer.errors`,
`input_pipeline`; never `odetransformer.tools` or `odetransformer.analysis`.
"""
