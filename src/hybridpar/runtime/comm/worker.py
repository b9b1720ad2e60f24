"""A communication thread: jobs run one at a time, in the order they were submitted.

The compressed reducer runs here so that encoding, the all-to-all, the owners' sums, the
all-gather and decoding of one bucket overlap the backward pass of the layers before it. The
kernels and the collectives release the GIL, so autograd keeps running on the main thread.

Order is what makes this safe. Every rank submits its buckets in the same order, and one thread
runs them in that order, so every rank issues the collectives in the same order. The jobs use
their own process groups (`GridSet.grad_group`). Collectives the main thread issues meanwhile
(batch-norm statistics, redistributions) are on other groups, so the two threads never interleave
collectives on one group in different orders on different ranks.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

import torch

__all__ = ["CommWorker", "close_all"]

_LIVE: weakref.WeakSet = weakref.WeakSet()


class CommWorker:
    def __init__(self, name: str = "hybridpar-comm") -> None:
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    def submit(self, fn: Callable[[], torch.Tensor]) -> torch.futures.Future:
        """Run `fn` on the thread after the jobs before it; its result (or exception) lands in the
        returned future."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            try:
                result = fn()
            except BaseException as exc:  # the waiting rank raises it: a timeout names the peer
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            # drop the job before waiting for the next: an idle thread must not keep its tensors
            # and process groups alive past the end of the job (gloo aborts a process whose
            # groups are destroyed late, at interpreter exit)
            del item, fn, fut
            result = None

    def stop(self) -> None:
        """Let the thread end after the queued jobs, without waiting for it."""
        self._q.put(None)

    def close(self) -> None:
        """Finish the queued jobs and stop the thread."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._q.put(None)
                self._thread.join()
            self._thread = None


def close_all() -> None:
    """Finish and stop every worker thread (comm.shutdown calls it before the groups go)."""
    for w in list(_LIVE):
        w.close()
