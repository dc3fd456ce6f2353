"""One lock per Hugging Face model: a call on a model (the engine it selects, its caches and measurements, the
drafters' per-model state) runs alone; every ``EarlyExitModel`` wrapping the same model shares it."""

from __future__ import annotations

import threading
import weakref

from torch import nn

_LOCKS: weakref.WeakKeyDictionary[nn.Module, ModelLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


class ModelLock:
    """A re-entrant lock that knows whether the calling thread holds it (``held``): one call on a model at a
    time (the engine it selects, its caches and measurements, the drafters' per-model state)."""

    def __init__(self) -> None:
        self._lock, self._owners = threading.RLock(), []  # the holder's id, once per acquisition

    def __enter__(self) -> ModelLock:
        self._lock.acquire()
        self._owners.append(threading.get_ident())
        return self

    def __exit__(self, *exc: object) -> None:
        self._owners.pop()
        self._lock.release()

    def held(self) -> bool:
        return threading.get_ident() in self._owners[-1:]


def model_lock(model: nn.Module) -> ModelLock:
    """The one ``ModelLock`` of a HF model (weakly held): every ``EarlyExitModel`` wrapping it shares it."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(model, ModelLock())
