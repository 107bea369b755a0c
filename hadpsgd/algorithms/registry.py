"""The name registry behind ``--algo``: which class and options each name builds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from hadpsgd.algorithms.base import Algorithm
from hadpsgd.algorithms.options import AlgoOptions
from hadpsgd.comm import World


@dataclass(frozen=True)
class AlgoSpec:
    """A registry entry: what ``--algo NAME`` builds and which options it reads."""

    name: str
    description: str
    """One line for ``--help`` and the docs."""
    cls: type[Algorithm]
    options: type[AlgoOptions]


_REGISTRY: dict[str, AlgoSpec] = {}
A = TypeVar("A", bound="type[Algorithm]")


def register(name: str, description: str | None = None) -> Callable[[A], A]:
    """Class decorator that makes an algorithm available as ``build(name, ...)`` / ``--algo``.

    The entry carries the class's ``Options`` dataclass and a one-line description (default:
    the first line of the class docstring).
    """

    def deco(cls: A) -> A:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"algorithm name {name!r} is already registered")
        line = description or (cls.__doc__ or name).strip().split("\n")[0]
        _REGISTRY[name] = AlgoSpec(name, line, cls, cls.Options)
        cls.name = name
        return cls

    return deco


def names() -> list[str]:
    """Registered algorithm names, sorted."""
    return sorted(_REGISTRY)


def specs() -> list[AlgoSpec]:
    """Every registry entry, sorted by name."""
    return [_REGISTRY[n] for n in names()]


def spec(name: str) -> AlgoSpec:
    """The registry entry of ``name``.

    Raises:
        ValueError: If ``name`` is unknown; the message lists the registered names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; registered: {', '.join(names())}"
        ) from None


def get(name: str) -> type[Algorithm]:
    """The class registered under ``name`` (see :func:`spec`)."""
    return spec(name).cls


def build(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, topo: World,
          **options: Any) -> Algorithm:
    """Construct the algorithm registered under ``name`` (see :func:`get`)."""
    return get(name)(model, optimizer, topo, **options)
