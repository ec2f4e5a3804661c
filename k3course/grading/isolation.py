"""Run a learner's answer in a forked child, so a crash or a hang fails one check instead of the kernel.

An unmasked ``tl.store`` under the Triton interpreter writes outside its tensor and can kill the process
(SIGSEGV); an infinite loop never returns. Run in a child, the notebook's kernel survives both, and the
learner reads what probably happened within seconds. A store just past the end of a tensor kills nothing at
once: it corrupts the heap, which the C library notices when that memory is freed (SIGABRT). So the child
frees everything the call allocated before it answers, and its exit status is checked after it answers: an
answer from a child that then dies is a crash, not a result.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import pickle
import signal
from collections.abc import Callable
from typing import Any

import torch

CRASH_HINT = ("most likely a tl.load or tl.store without a mask read or wrote outside its tensor "
              "(check every offset is masked, e.g. mask=cols < n_cols)")


class ChildCrashed(Exception):
    """The child process running the learner's answer died, or ran past its time limit."""


def can_isolate() -> bool:
    """Forking works here: a POSIX system, and CUDA not initialised (a forked child can't use it)."""
    return "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()


def _outcome(call: Callable[[], Any]) -> bytes:
    """``call()``'s result or exception, pickled by value; whatever the call allocated is unreferenced on return.

    Plain pickle: torch's multiprocessing pickler would share tensors through file descriptors that die with
    the child.
    """
    try:
        return pickle.dumps(("returned", call()))
    except BaseException as error:  # noqa: BLE001  (everything goes back to the parent, to be reported)
        try:
            return pickle.dumps(("raised", error))
        except Exception:  # an exception that can't be pickled goes back as its text
            return pickle.dumps(("raised", RuntimeError(f"{type(error).__name__}: {error}")))


def _child(send, call: Callable[[], Any]) -> None:
    """In the child: one thread (OpenMP's pool did not survive the fork), run ``call``, free what it allocated
    (a heap it corrupted aborts here, before any answer), then send back its pickled outcome."""
    torch.set_num_threads(1)
    faulthandler.disable()  # a crash here is expected and reported by the parent, not dumped to stderr
    message = _outcome(call)
    gc.collect()
    send.send_bytes(message)


def _how_it_ended(exitcode: int | None) -> str:
    """'SIGSEGV' for a child killed by a signal, else its exit code."""
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _crashed(child, when: str) -> ChildCrashed:
    """The error for a child that died: how it ended (its signal or exit code) and the likely cause."""
    return ChildCrashed(f"your function crashed the process{when} ({_how_it_ended(child.exitcode)}): {CRASH_HINT}")


def run_isolated(call: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``call()`` in a forked child; its return value, or its exception re-raised here.

    Raises :class:`ChildCrashed` when the child dies without answering (a signal), runs past ``timeout`` s, or
    answers but then does not exit cleanly (exit code 0) within ``timeout`` s.
    """
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, call), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout):
            child.kill()
            raise ChildCrashed(f"your function ran for more than {timeout:.0f} s (an endless loop, or a grid far "
                               "larger than the tensor?)")
        try:
            message = pickle.loads(receive.recv_bytes())
        except EOFError:
            child.join(5)
            raise _crashed(child, "") from None
        child.join(timeout)
        if child.exitcode != 0:
            child.kill()
            child.join(5)
            raise _crashed(child, " after it answered")
    finally:
        receive.close()
        child.join(5)
    if message[0] == "raised":
        raise message[1]
    return message[1]
