"""The algorithm's recipe for what a :class:`hadpsgd.Distributed` user left out.

``python -m hadpsgd.run`` fills the options a user did not give from the algorithm's recipe
(:meth:`hadpsgd.algorithms.AlgoOptions.recipe`), chosen by ``--optimizer``: BMUF with SGD
takes the measured SGD recipe (every worker at the global rate, its momentum kept, the
gradient clipped to norm 1: SSGD's word error rate on unseen voices), BMUF with Adam the
BMUF-Adam paper's. Before, the API took the option dataclass's own defaults whatever the
optimizer, which are BMUF-Adam's, so an SGD user got the recipe that under-trained on real
speech, silently. Here the API resolves the same recipe from the optimizer object's kind,
through the same function, and says it once, as the CLI does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from hadpsgd.algorithms.registry import AlgoSpec
from hadpsgd.api.options import in_keywords
from hadpsgd.cli import ConfigError, option_name


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The recipe's name for ``optimizer``: its torch class's name in lower case.

    ``sgd``, ``adam``, ``adamw``; a user's subclass of one of those takes its base's.
    """
    for base in type(optimizer).__mro__:
        if base.__module__.startswith("torch.optim") and base is not torch.optim.Optimizer:
            return base.__name__.lower()
    return type(optimizer).__name__.lower()


def resolve_recipe(entry: AlgoSpec, optimizer: torch.optim.Optimizer,
                   values: Mapping[str, Any], max_grad_norm: float | None
                   ) -> tuple[dict[str, Any], Any, str | None]:
    """The options and clipping the algorithm runs with, and the line that says what it filled.

    Args:
        entry: The algorithm's registry entry.
        optimizer: The user's optimizer (its kind picks the recipe).
        values: The algorithm's own options the user gave, by field name.
        max_grad_norm: The clipping the user gave, or None (the recipe's, else 0); checked
            later, by the caller, as it was given.

    Returns:
        The option values (the user's, and the recipe's for the ones left out), the clipping,
        and the line to print once (None where the recipe filled nothing).
    """
    kind = optimizer_kind(optimizer)
    field_of = {option_name(f): f.name for f in dataclasses.fields(entry.options)}
    given: dict[str, Any] = {"optimizer": kind}
    given.update({option_name(f): values[f.name] for f in dataclasses.fields(entry.options)
                  if f.name in values})
    if max_grad_norm is not None:
        given["max_grad_norm"] = max_grad_norm
    out = dict(values)
    clip: Any = 0.0 if max_grad_norm is None else max_grad_norm  # its type: check_shared
    filled: dict[str, Any] = {}
    notes: list[str] = []
    try:
        recipe = entry.options.recipe(given)
    except ConfigError as err:  # in the keywords a Python caller wrote
        raise in_keywords(err, entry, prefix=False) from None
    for key, value in recipe.items():
        if key in field_of:
            out[field_of[key]] = value
            filled[field_of[key]] = value
        elif key == "max_grad_norm":
            clip = float(value)
            filled[key] = clip
        elif key == "beta1":
            # The optimizer is the user's: say the recipe's beta1, do not change theirs.
            betas = optimizer.param_groups[0].get("betas")
            if betas is not None and betas[0] != value:
                notes.append(f"the recipe's beta1 is {value}; your optimizer's {betas[0]} is "
                             f"kept (betas=({value}, ...) for the recipe's)")
    line = entry.options.recipe_line(entry.name, kind, filled, lambda k, v: f"{k}={v!r}")
    if notes:
        line = f"{line or f'{entry.name} with {kind}'}; {'; '.join(notes)}"
    return out, clip, line


__all__ = ["optimizer_kind", "resolve_recipe"]
