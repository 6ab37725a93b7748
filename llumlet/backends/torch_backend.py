"""The ``torch`` backend: the CPU reference engine (``llumlet.engine.torch_engine.TorchEngine``).

A small seeded Llama computed for real on the CPU; steps take the time they compute (no pacing). Imported
lazily so that a llumlet without PyTorch can still run the ``sim`` backend.
"""

from __future__ import annotations

from llumlet.backends.base import Backend, BackendConfig

__all__ = ["make_torch_backend"]


def make_torch_backend(config: BackendConfig) -> Backend:
    """A ``TorchEngine`` for ``config``.

    Raises:
        RuntimeError: PyTorch / transformers or the torch engine module are not installed.
    """
    try:
        from llumlet.engine import torch_engine  # type: ignore[attr-defined, unused-ignore]
    except ImportError as exc:
        raise RuntimeError(
            f"the torch backend needs PyTorch and transformers (pip install torch transformers): {exc}"
        ) from exc
    engine = torch_engine.make_torch_engine(config)
    return Backend(name="torch", engine=engine, time_scale=0.0, real_token_ids=True)
