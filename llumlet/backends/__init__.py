"""Engine backends of a llumlet, chosen by name: ``sim`` (the model engine on a real clock), ``torch``
(the CPU reference engine) and ``vllm`` (a real vLLM v1 engine; needs vLLM installed, docs/vllm.md).

``make_backend(name, config)`` builds one and raises :class:`UnknownBackendError` on an unknown name.
"""

from llumlet.backends.base import BACKEND_NAMES, Backend, BackendConfig, UnknownBackendError, make_backend

__all__ = ["BACKEND_NAMES", "Backend", "BackendConfig", "UnknownBackendError", "make_backend"]
