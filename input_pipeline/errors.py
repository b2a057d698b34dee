"""The one exception the input pipeline raises for bad user input."""


class DataError(ValueError):
  """Bad data configuration or input: a one-line message naming the problem and the fix.

  `main.py` prints it as a single line and exits non-zero; anything else escaping
  the pipeline is a bug, not a user error.
  """
