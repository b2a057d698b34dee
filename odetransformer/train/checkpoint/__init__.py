"""Orbax checkpoints: enough to resume a run bit for bit, readable by other tools.

One concern per module, each importing only those above it:

  paths        where a run's files live in its workdir; which steps are complete;
               `CheckpointError`
  fingerprint  what a run's checkpoints depend on (resume and tokenizer checks),
               config.json and the workdir's tokenizer
  integrity    the sha256 records and per-chunk crc32c written with every save and
               checked on every read; the orbax handlers that do it
  restore      the one restore path (`restore_newest`) and the model alone
               (`restore_model_state`)
  manager      the `Checkpointer` of a training run: saves, owners of unfinished
               saves, preemption, resume
"""
