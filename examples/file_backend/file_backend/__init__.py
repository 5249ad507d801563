"""An out-of-tree weight-transfer backend for the harness: each update is ONE
safetensors file in a directory both sides can read (any file system).

* ``file_backend.engine``: the worker side, loaded by vLLM in its worker processes;
* ``register`` (here): the ``vllm.general_plugins`` entry point that tells vLLM's
  engine factory about it, so that ``--weight-transfer-config '{"backend": "file"}'`` works;
* ``file_backend.backend``: the trainer side (``Sender``) and the harness's ``BACKEND``.

This module imports neither vLLM nor the harness: vLLM calls ``register`` in every one
of its processes, before it may be ready to import its weight-transfer package.
"""

ENGINE = "file"
# A deliberate bug, read by the worker side (the server inherits it from whoever starts
# it): "drop" leaves the largest tensor of every update out, "stale" loads nothing.
# Every route still answers 200; the harness's checks must catch both.
BREAK_ENV = "FILE_BACKEND_BREAK"


def register() -> None:
    """vLLM general plugin: register the engine under the name "file", lazily (the
    engine module is imported the first time a server is started with it)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to register
        return
    if ENGINE not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE, "file_backend.engine",
                                                    "FileWeightTransferEngine")
