"""Local layers (upstream's ``local_layers``): the trainable weights whose gradients stay on
their rank, for ``PartialDistributedOptimizer`` and ``PartialDistributedGradientTape``.

Must not touch: a Keras module of its own choosing (the caller passes its ``Layer`` class).
"""

from __future__ import annotations

from typing import Any


def local_weights(local_layers: Any, layer_type: type, type_name: str) -> list[Any]:
    """The trainable weights of ``local_layers`` (one layer, several, or None for none);
    ValueError unless every one is a ``layer_type`` (called ``type_name`` in the message)."""
    if local_layers is None:
        return []
    layers: list[Any] = (
        [local_layers] if isinstance(local_layers, layer_type) else list(local_layers)
    )
    if not all(isinstance(layer, layer_type) for layer in layers):
        raise ValueError(f"All local layers must be of {type_name} type.")
    return [w for layer in layers for w in layer.trainable_weights]
