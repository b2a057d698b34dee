"""The one exception the input pipeline raises for bad user input."""

from odetransformer.errors import UserError


class DataError(UserError, ValueError):
  """Bad data configuration or input: a one-line message naming the problem and the fix.

  Every entry point prints it as a single line and exits with status 2
  (`odetransformer.errors.run_cli`); anything else escaping the pipeline is a bug, not
  a user error.
  """
