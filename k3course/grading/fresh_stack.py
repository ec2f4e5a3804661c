"""Call a learner's function on a thread of its own, so that its call stack holds nothing of the grader.

An answer that walks up its stack (``sys._getframe``, ``inspect.stack()``, ``frame.f_back``) and reads the
frames' locals and globals finds this module's frame and the threading module's: never the exercise, its
reference, the expected values or the registry. This module imports nothing that leads to them, and it is
handed only the function, its inputs, the names of the torch functions it may not call and the code of the package
functions it may not call (:mod:`k3course.grading.package_answer`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k3course.grading.forbid import refusing
from k3course.grading.guard_bands import GuardBands, guarding
from k3course.grading.package_answer import PackageAnswer, PackageRule, refusing_package

if TYPE_CHECKING:
    from k3course.grading.registry import Forbidden


def _run(fn: Callable[..., Any], args: tuple, kwargs: dict, forbidden: Forbidden | None, package: PackageRule | None,
         bands: GuardBands | None, outcome: dict) -> None:
    """On the new thread: outcome["returned"] = fn(*args, **kwargs), or outcome["raised"] = its exception (a
    refused package call, even one the answer caught, counts as raised)."""
    try:
        # torch's function modes and Python's profile hook are per thread: entered here, on the learner's (the
        # refusal last: its mode sees a call first, and the bands see what it lets through)
        with guarding(bands), refusing(forbidden), refusing_package(package) as refused:
            returned = fn(*args, **kwargs)
        if refused:
            raise PackageAnswer(package.message(refused[0]))
        outcome["returned"] = returned
    except BaseException as error:  # noqa: BLE001  (re-raised on the caller's thread)
        outcome["raised"] = error


def _interrupt(thread: threading.Thread) -> None:
    """Raise KeyboardInterrupt in ``thread`` at its next Python instruction (the caller was interrupted)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
    thread.join(1.0)


def call_on_fresh_stack(fn: Callable[..., Any], args: tuple, kwargs: dict, forbidden: Forbidden | None = None,
                        package: PackageRule | None = None, bands: GuardBands | None = None):
    """``fn(*args, **kwargs)`` on a new thread, refusing ``forbidden``'s torch functions and ``package``'s package
    functions, and banding what it allocates when ``bands`` is given; its return value, or its exception re-raised
    here. Interrupting the caller (Ctrl-C, a notebook's
    stop button) interrupts fn too.
    """
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=_run, args=(fn, args, kwargs, forbidden, package, bands, outcome), daemon=True,
                              name="k3course learner call")
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)  # short waits: the caller's thread keeps handling signals (KeyboardInterrupt)
    except KeyboardInterrupt:
        _interrupt(thread)
        raise
    if "raised" in outcome:
        raise outcome["raised"]
    return outcome["returned"]
