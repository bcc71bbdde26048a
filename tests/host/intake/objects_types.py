"""Types the objects-mode tests send across: importable by the host (pytest) and by the
worker (the tests add this folder to the worker's import roots)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import pathlib
from typing import NamedTuple

import pydantic

CONSTRUCTED: list[str] = []


class Reading(pydantic.BaseModel):
    sensor: str
    value: float
    when: datetime.datetime


@dataclasses.dataclass
class Point:
    x: int
    y: int


@dataclasses.dataclass(slots=True, frozen=True)
class FrozenPoint:
    x: int
    y: int


class Pair(NamedTuple):
    left: int
    right: str


class Colour(enum.Enum):
    RED = 1
    GREEN = 2


class AppError(KeyError):
    """A host-side exception class whose __init__ has a side effect the decoder must not run."""

    def __init__(self, *args: object) -> None:
        CONSTRUCTED.append("AppError.__init__")
        super().__init__(*args)


class PathError(Exception):
    """An exception whose state holds a type the exception channel refuses (a concrete Path)."""

    def __init__(self, message: str, path: pathlib.Path) -> None:
        super().__init__(message)
        self.path = path


def not_a_model() -> str:
    """A function: `objects_types.*` must not admit it."""
    return "called"
