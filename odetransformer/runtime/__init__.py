"""Process plumbing that is not about the model: the workdir I/O layer (`fileio`: every
path may be a gs:// URL), host and accelerator detection, transparent huge pages, the
workdir lock, library log filters (`logs`) and what the processes of a multi-host job
exchange (`multihost`).

May import: `odetransformer.errors` and jax only. The model never imports this package.
"""
