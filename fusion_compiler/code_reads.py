"""What the code of a model's ``forward`` may read, from its bytecode (CPython's ``dis``), before
any trace: the module-level names (:func:`globals_read`), which the guard compares at every call
(:mod:`~fusion_compiler.runtime.state`), the globals it assigns, which the capture refuses, and
the values it reads that a trace reads once (:func:`~.process_state.read_once`)."""

from __future__ import annotations

import dis
import functools
import sys
import types
from typing import Any, Iterable

import torch

from .process_state import read_once
from .runtime.hooks import instance_forward

__all__ = ["globals_read", "users_module"]


_NOT_USERS = frozenset({"torch", "fusion_compiler"})
"""Top-level packages whose code is not the user's: what reads it is not guarded."""


def _package(module_name: str | None) -> str:
    return (module_name or "").split(".")[0]


def users_module(module_name: str | None) -> bool:
    """Whether code of the module named so is the user's (not torch's or this package's)."""
    return _package(module_name) not in _NOT_USERS


def _user_class(cls: type) -> bool:
    """A class of the user's code (not Python's, torch's or this package's)."""
    top = _package(cls.__module__)
    return top not in _NOT_USERS and top != "builtins" and top not in sys.stdlib_module_names


def _user_function(value: Any) -> bool:
    """A Python function of the user's code (not torch's, not this package's)."""
    return isinstance(value, types.FunctionType) and users_module(value.__module__)


def _unwrapped(value: Any) -> list[types.FunctionType]:
    """The user's functions ``value`` runs: itself, the function a ``functools.partial``
    wraps, the one a ``functools.wraps`` decorator wraps (``__wrapped__``), a property's getter,
    a bound method's function."""
    found, seen = [], set()
    while value is not None and id(value) not in seen:
        seen.add(id(value))
        if _user_function(value):
            found.append(value)
        if isinstance(value, functools.partial):
            value = value.func
        elif isinstance(value, property):
            value = value.fget
        elif isinstance(value, (types.MethodType, staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, types.FunctionType):  # functools.wraps sets __wrapped__
            value = vars(value).get("__wrapped__")
        else:  # any other object: its attributes are not looked up (they may run code)
            value = None
    return found


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...],
                                          tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """What ``code`` names (CPython's ``dis``): globals it loads, ``(global, attribute)`` pairs
    it loads (``config.SCALE``), globals it stores or deletes, attributes it loads, modules it
    imports."""
    loads, pairs, stores, attributes, imports = [], [], [], [], []
    previous = None
    for instruction in dis.get_instructions(code):
        name, op = instruction.argval, instruction.opname
        if op == "IMPORT_NAME":
            imports.append(name)
        if op == "LOAD_GLOBAL":
            loads.append(name)
        elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.append(name)
        elif op in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(name, str):
            attributes.append(name)
            if previous is not None and previous.opname == "LOAD_GLOBAL":
                pairs.append((previous.argval, name))
        previous = instruction
    return tuple(loads), tuple(pairs), tuple(stores), tuple(attributes), tuple(imports)


def globals_read(modules: Iterable[torch.nn.Module]
                 ) -> tuple[list[tuple[Any, str]], list[str], dict[str, tuple[str, str, Any]]]:
    """The module-level names the code of ``modules`` may read when it runs, as ``(namespace,
    name)`` (a function's globals, an imported module's ``__dict__`` for ``config.SCALE``, a
    user's class for ``Defaults.SCALE``); the globals it assigns (``global n; n += 1``); the
    names it reads that a trace reads once (``(kind, what, value)`` by name shown:
    :func:`~.process_state.read_once`). A static
    reading of the bytecode (CPython's ``dis``) of each module's ``forward`` (its instance
    forward where one replaced it), followed into the user's functions it reaches by a global
    name, an imported module's attribute, or a method or function-valued attribute of the module
    (through ``functools.partial``, ``functools.wraps``, properties), and into nested code. Names
    of builtins, and torch's and this package's code, are left out (as guarded names). A function
    reached another way (an argument, an object's attribute) is not followed; one a closure
    holds is, and what closures hold is told apart as names are, and guarded as ``(cell,
    "cell_contents")`` (a factory's ``cfg`` dict a class defined inside it reads)."""
    todo: list[tuple[types.CodeType, dict, Any]] = []

    cells: list[tuple[str, Any]] = []  # what closures hold: read as globals are
    followed: set[int] = set()
    once: dict[str, tuple[str, str, Any]] = {}
    found: dict[tuple[int, str], tuple[Any, str]] = {}

    def note(shown: str, value: Any) -> None:
        kind = read_once(value)
        if kind is not None:
            once.setdefault(shown, (*kind, value))

    def follow(value: Any, owner: Any) -> None:
        for fn in _unwrapped(value):
            todo.append((fn.__code__, fn.__globals__, owner))
            if id(fn) in followed:
                continue
            followed.add(id(fn))
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                try:
                    cells.append((name, cell.cell_contents))
                except ValueError:  # a cell not filled yet
                    continue
                if name != "__class__" and users_module(fn.__module__ or ""):  # (super()'s)
                    found.setdefault((id(cell), "cell_contents"), (cell, "cell_contents"))

    for module in modules:
        follow(instance_forward(module), module)
        follow(type(module).forward, module)
    seen: set[tuple[types.CodeType, int]] = set()
    stores: list[str] = []
    while todo or cells:
        while cells:
            name, held = cells.pop()
            note(name, held)
            follow(held, None)
        if not todo:
            break
        code, namespace, owner = todo.pop()
        if (code, id(owner)) in seen:
            continue
        seen.add((code, id(owner)))
        loads, pairs, stored, attributes, imports = _names(code)
        stores += [n for n in stored if n not in stores]
        for shown, value in [(n, namespace.get(n)) for n in loads] + [
                (f"{n}.{a}", getattr(namespace.get(n), a, None)) for n, a in pairs
                if isinstance(namespace.get(n), types.ModuleType)] + [
                (f"import {n}", sys.modules.get(n)) for n in imports]:
            note(shown, value)
        for name in loads:
            if name in namespace:
                found.setdefault((id(namespace), name), (namespace, name))
                follow(namespace[name], None)
        for name, attribute in pairs:
            imported = namespace.get(name)
            if isinstance(imported, types.ModuleType) and users_module(
                    imported.__name__) and attribute in vars(imported):
                found.setdefault((id(vars(imported)), attribute), (vars(imported), attribute))
                follow(vars(imported)[attribute], None)
            elif isinstance(imported, type) and _user_class(imported) and any(
                    attribute in vars(k) for k in imported.__mro__[:-1]):
                found.setdefault((id(imported), attribute), (imported, attribute))
        if isinstance(owner, torch.nn.Module):  # self.helper(), self.f = lambda ...
            for attribute in attributes:
                held = vars(owner).get(attribute, getattr(type(owner), attribute, None))
                note(f"self.{attribute}", held)
                follow(held, owner)
        todo += [(c, namespace, owner) for c in code.co_consts if isinstance(c, types.CodeType)]
    return list(found.values()), stores, once
