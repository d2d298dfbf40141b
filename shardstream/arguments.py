"""Checks of the arguments the public API takes, with errors that name the argument.

Training scripts pass values from configs and sweeps: numpy integers, strings where a
flag belongs ("no" is truthy and shuffled), negative counts. Each is taken as the plain
value it stands for or refused here, where it is given, not deep inside an iteration.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = ["flag", "integer"]


def integer(value: Any, name: str, minimum: int | None = None, below: int | None = None) -> int:
    """`value` as a plain int (numpy's too) of at least `minimum` and below `below`, or an
    error naming the argument."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be {minimum} or more, not {number}")
    if below is not None and number >= below:
        raise ValueError(f"{name} must be below {below}, not {number}")
    return number


def flag(value: Any, name: str) -> bool:
    """`value` as a plain bool (numpy's too), or an error naming the argument."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return bool(value)
