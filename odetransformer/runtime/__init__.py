"""Process plumbing that is not about the model: the workdir I/O layer (`fileio`: every
path may be a gs:// URL), host and accelerator detection, transparent huge pages, the
workdir lock.

May import: `odetransformer.errors` only. The model never imports this package.
"""
