"""Wrong answers to every exercise: cheats that look for the grader's reference on the call stack.

Each walks up from its own frame (``sys._getframe`` / ``inspect.stack()``), reads every frame's locals and
globals, the attributes of the objects it finds there and the variables their closures capture, and calls
the first reference it can reach: an exercise object's ``reference``, or the registry (``get_exercise`` or its
dict) with an exercise id read off the stack. The grader keeps all of that off the learner's stack, so each
one finds nothing and raises ``LookupError``.
"""

import inspect
import re
import sys

from k3course.grading import all_exercises

EXERCISE_ID = re.compile(r"\b\d\d\.[a-z_0-9]+\b")


def _reachable(namespace: dict):
    """The values of a frame's namespace, their attributes and their closures' variables (one level down)."""
    for value in list(namespace.values()):
        yield value
        yield from list(getattr(value, "__dict__", {}).values()) if not inspect.ismodule(value) else ()
        for cell in getattr(value, "__closure__", None) or ():
            try:
                yield cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue


def _ids(frames) -> list[str]:
    """Every exercise id written in a string local of the stack."""
    return [match for frame in frames for value in list(frame.f_locals.values()) if isinstance(value, str)
            for match in EXERCISE_ID.findall(value)]


def _reference_from(frames):
    """The first reference the frames lead to, or None."""
    ids = _ids(frames)
    for frame in frames:
        for namespace in (frame.f_locals, frame.f_globals):
            for value in _reachable(namespace):
                if callable(getattr(value, "reference", None)) and hasattr(value, "cases"):
                    return value.reference
                if getattr(value, "__name__", None) == "get_exercise" and ids:
                    return value(ids[0]).reference
                if isinstance(value, dict) and ids and ids[0] in value and hasattr(value[ids[0]], "reference"):
                    return value[ids[0]].reference
    return None


def reference_from_the_frames_above(*args, **kwargs):
    """Walks frame.f_back from its caller to the bottom of the stack and answers with the grader's reference."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    reference = _reference_from(frames)
    if reference is None:
        raise LookupError("no reference on the stack")
    return reference(*args, **kwargs)


def reference_from_inspect_stack(*args, **kwargs):
    """The same search through inspect.stack() (which also follows f_back)."""
    reference = _reference_from([record.frame for record in inspect.stack()[1:]])
    if reference is None:
        raise LookupError("no reference on the stack")
    return reference(*args, **kwargs)


WRONG = {exercise_id: [reference_from_the_frames_above, reference_from_inspect_stack]
         for exercise_id in all_exercises()}
