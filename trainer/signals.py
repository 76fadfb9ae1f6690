"""Ctrl-C and SIGTERM held off while native modules initialize."""
import contextlib
import os
import signal
import sys
import threading

STOPPING = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held():
    """Ctrl-C or SIGTERM that arrives inside the block is taken as it ends, by the handler
    that was in place. Raised inside a native module's initialization, the interruption did
    harm there: torch's import swallowed it and left numpy's modules half made (the run went
    on, to fail later), a pybind11 module ended in std::terminate, and matplotlib's ft2font
    left objects that its static destructor freed after Python's finalization, so the process
    aborted at exit. Python runs its handlers in the main thread, whichever thread the signal
    reached, so the handlers are swapped here, not the signal mask."""
    if threading.current_thread() is not threading.main_thread():  # whose handlers only the main thread sets
        yield
        return
    arrived = []
    before = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in STOPPING}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if len(arrived) > 1:  # pressed again while held: at once, as a second Ctrl-C does while a run winds down
            exit_at_once(arrived[-1])
        if arrived:
            signal.raise_signal(arrived[0])  # its handler raises here, or ends the process as it would have


def exit_at_once(signum: int, say: bool = True):
    """Ends the process now, as a shell reports the signal (130 for SIGINT, 143 for SIGTERM),
    without unwinding; the part of a checkpoint being written is removed, as os._exit skips
    run_dir.written_whole's removal (those written are whole)."""
    from trainer.run_dir import PARTS
    for part in list(PARTS):
        part.unlink(missing_ok=True)
    if say:
        print("stopped at once", file=sys.stderr, flush=True)
    os._exit(128 + signum)
