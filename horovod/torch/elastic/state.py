"""``TorchState``: the elastic state of a PyTorch job (model, optimizer, ``ElasticSampler`` and
plain attributes such as ``epoch`` and ``batch``), as upstream's ``horovod.torch.elastic``.

Each kind of value has a handler that saves a deep copy on commit, restores it on rollback and
syncs it from the rank that holds the newest commit. ``get_handler_registry`` and
``set_handler_registry`` let users add handlers for their own types, as upstream.

Must not touch: the engine; training loops (it only copies and broadcasts state).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from horovod.elastic.state import ObjectState
from horovod.frontend import rank
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)


class StateHandler:
    """Saves, restores and syncs one value of a ``TorchState``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root_rank: int) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """After a re-init (the job's size may have changed)."""

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class StateDictHandler(StateHandler):
    """A value with ``state_dict()``/``load_state_dict()``: saves a deep copy of its state."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class ModelStateHandler(StateDictHandler):
    def sync(self, root_rank: int) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=root_rank)


class OptimizerStateHandler(StateDictHandler):
    def sync(self, root_rank: int) -> None:
        broadcast_optimizer_state(self.value, root_rank=root_rank)


class SamplerStateHandler(StateDictHandler):
    def sync(self, root_rank: int) -> None:
        state = broadcast_object(
            self.value.state_dict(), root_rank=root_rank, name="elastic.sampler"
        )
        self.value.load_state_dict(state)

    def reset(self) -> None:
        self.value.reset()  # re-shard what remains of the epoch over the new ranks


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """``TorchState(model, optimizer, epoch=0, batch=0)``: ``state.model``, ``state.epoch``...
    Assigning a handled attribute (``state.model = other``) replaces and saves it."""

    _handlers: dict[str, StateHandler]

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        if model is not None:
            kwargs["model"] = model
        if optimizer is not None:
            kwargs["optimizer"] = optimizer
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            h = _handler_for(value)
            if h is None:
                plain[name] = value
            else:
                handlers[name] = h
        object.__setattr__(self, "_handlers", handlers)
        for name, h in handlers.items():
            object.__setattr__(self, name, h.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        root = self.newest_holder()
        for h in self._handlers.values():
            h.sync(root)
        self.sync_objects(root)
        for h in self._handlers.values():
            h.save()

    def reset(self) -> None:
        for h in self._handlers.values():
            h.reset()
