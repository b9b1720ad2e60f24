"""Run a function on N ranks: spawned local processes, or the ranks torchrun started.

`launch(fn, nprocs, *args, backend=...)` starts nprocs processes (gloo by default; NCCL with one
GPU per process for a CUDA run), initialises torch.distributed in each with a collective timeout, runs
fn(*args) and returns every rank's result in rank order. It watches the ranks: when one dies (a
signal, a non-zero exit) or raises, the others are stopped and a RankFailure names it; a rank
that hangs makes the others time out in their next collective, and the still-running one is named
as the culprit. No orphans: the fork server dies with the launcher and a rank with the server
(each sets PR_SET_PDEATHSIG as the first thing it runs of ours and checks that its parent is still
there: `server_guard`, `_Guard`), and SIGINT or SIGTERM to the launcher stops every rank and raises
Interrupted. The function to run is passed by name, so unpickling the job imports nothing of it.

Ranks are forked from multiprocessing's fork server, which imports torch once, the first time this
process launches, instead of each rank importing it anew (docs/runtime.md measures it). The server
is a fresh interpreter that has imported torch and run nothing (no threads, no CUDA), so a fork
of it is as clean as a spawn. A rank takes the launcher's environment, working directory and
import path as they are at the launch, not as they were when the server started. A command that
will launch may start the server first (`start_server`), so that it imports torch while the
command plans.

Under torchrun (WORLD_SIZE is set) it initialises from the environment and runs fn in-process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import glob
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from queue import Empty
from typing import Any

from hybridpar.core.errors import Interrupted

__all__ = [
    "Interrupted",
    "RankFailure",
    "free_port",
    "launch",
    "settle_server",
    "start_server",
    "stop_on_signals",
    "under_torchrun",
]


class RankFailure(RuntimeError):
    """A rank died, raised, or hung. The message is one line naming it; `details` holds the
    failing rank's traceback when there is one."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float, backend: str | None = None) -> None:
    """gloo, or NCCL with gloo beside it for host tensors (metrics, agreed decisions)."""
    import torch
    import torch.distributed as dist

    from hybridpar.runtime.comm.devices import local_gpu

    backend = backend or "gloo"  # NCCL when the caller places the ranks on GPUs
    if backend == "nccl":
        torch.cuda.set_device(local_gpu())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _warn_shared_store() -> None:
    """torchrun's restarts (--max-restarts) and the rendezvous store it shares with the workers do
    not mix (pytorch/pytorch#135712): a restarted rank can read the previous attempt's addresses
    and the job fails to connect. Seen here with torch 2.13; the workaround is torch's own switch."""
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and os.environ.get("RANK") == "0"
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        print(
            "hybridpar: warning: torchrun --max-restarts with the shared rendezvous store can fail "
            "to reconnect after a restart (pytorch#135712); run torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            file=sys.stderr,
            flush=True,
        )


def die_with_parent(parent: int | None) -> None:
    """Be killed when this process's parent dies (PR_SET_PDEATHSIG); exit now if the parent is
    not `parent` (it died before the signal was set, and this process was handed to another)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)


class _Guard:
    """The first argument a rank unpickles: unpickling it sets the rank's parent-death signal,
    before the job (the largest part of what the rank reads) is unpickled, and drops the rank's
    copy of the fork server's "alive" pipe (`_release_server`). Until then only
    multiprocessing's own start-up has run in the rank."""

    def __init__(self, rank: int, server: int | None) -> None:
        self.rank, self.server = rank, server

    def __reduce__(self):
        return _guard, (self.rank, self.server)


def _guard(rank: int, server: int | None) -> None:
    from hybridpar.core import faults

    faults.at("rank", rank)
    die_with_parent(server)
    _release_server()
    faults.at("unpickle", rank)  # the job is unpickled next, as part of this same read


def _reference(fn: Callable) -> str:
    if "<" in fn.__qualname__:
        raise TypeError(f"launch runs module-level functions; {fn.__qualname__} is not one")
    return f"{fn.__module__}:{fn.__qualname__}"


def _resolve(ref: str) -> Callable:
    module, _, name = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _child(
    _guarded: None,
    rank: int,
    world: int,
    port: int,
    timeout_s: float,
    backend: str | None,
    fn: str,
    args: tuple,
    queue: mp.Queue,
    world_env: tuple[dict, str, list],
) -> None:
    env, cwd, path = world_env  # the launcher's, at this launch (the server started earlier)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where it is
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from hybridpar.core.cluster import rank_threads
    from hybridpar.runtime.comm import shutdown

    torch.set_num_threads(rank_threads(os.cpu_count() or 1, world))  # the ranks share the cores
    try:
        init_distributed(timeout_s, backend)
        result = _resolve(fn)(*args)
        try:
            # by value: torch's multiprocessing pickler would send a tensor's storage as a file
            # descriptor the launcher fetches from this process later, which is gone by then
            blob = pickle.dumps(result)
        except Exception as exc:
            raise TypeError(
                f"{fn} returned a {type(result).__name__}, which cannot be sent back "
                f"to the launcher ({exc})"
            ) from None
        queue.put((rank, "ok", blob))
        shutdown()  # nobody tears down the group while another rank still uses it
        code = 0
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        first = (str(exc).strip().splitlines() or [""])[0]
        queue.put((rank, "error", (f"{type(exc).__name__}: {first}", traceback.format_exc())))
        code = 1
    _leave(queue, code)


def _leave(queue: mp.Queue, code: int) -> None:
    """End a rank once its report is in the pipe, without the interpreter's teardown. By now
    shutdown() has ended torch.distributed, but C++ objects that Python still references (gloo's
    contexts and threads, the store's client) are destroyed during finalisation in no set order,
    and about one run in a hundred of a test that ends with async gloo collectives aborted there
    ("terminate called without an active exception", SIGABRT) after returning its result; the
    launcher then reported the rank as killed. Nothing a rank owns needs that teardown: shared
    memory segments are unlinked when mapped, files are closed by their owners."""
    queue.close()
    queue.join_thread()  # the feeder thread has written the report
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(
    fn: Callable,
    nprocs: int,
    *args: Any,
    timeout_s: float = 300.0,
    backend: str | None = None,
    grace_s: float = 3.0,
) -> list[Any]:
    """fn(*args) on nprocs ranks; returns their results in rank order. A spawned rank ends with
    os._exit once it has reported (see `_leave`): fn's atexit handlers do not run, so fn closes
    (flushes) what it opens."""
    if under_torchrun():
        import torch.distributed as dist

        from hybridpar.runtime.comm import shutdown

        owned = not dist.is_initialized()  # a caller that runs several jobs keeps its group
        if owned:
            _warn_shared_store()
            init_distributed(timeout_s, backend)
        result = fn(*args)
        if owned:
            shutdown()
        return [result]
    ctx, server = _server()
    queue = ctx.Queue()
    port = free_port()
    # the job's name in the shared-memory segments its ranks make (comm.host): a rank stopped
    # between making one and unlinking it leaves it behind, and this launcher removes it
    job = f"j{os.getpid()}p{port}"
    env = {**os.environ, "HYBRIDPAR_JOB": job}
    ref, here = _reference(fn), (env, os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(
            target=_child,
            args=(_Guard(r, server), r, nprocs, port, timeout_s, backend, ref, args, queue, here),
            daemon=True,
        )
        for r in range(nprocs)
    ]
    restore = stop_on_signals()
    _received.clear()
    _watching.set()
    try:
        for p in procs:
            p.start()
        return _watch(procs, queue, nprocs, timeout_s, grace_s)
    finally:
        _watching.clear()
        _stop(procs)
        for path in glob.glob(f"/dev/shm/hybridpar-{job}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        queue.close()
        restore()


# what the fork server imports once for every rank it forks: first the guard that ties it to the
# launcher (it reads HYBRIDPAR_LAUNCHER), then torch and the runtime (their import reads no
# environment variable and starts no thread; each rank still reads its settings when it runs,
# after taking the launcher's environment), and torch._dynamo, which torch imports lazily
# on a rank's first optimizer (torch.optim.Optimizer.__init__), in every rank at every launch
# unless it is preloaded
PRELOAD = [
    "hybridpar.runtime.server_guard",  # first: the server dies with the launcher
    "torch",
    "torch.distributed.tensor",
    "torch._dynamo",
    "hybridpar.runtime.train.run",
]


def _server() -> tuple[Any, int | None]:
    """The fork-server context, its server started (importing torch once), and its pid: the
    parent every rank must find (None where multiprocessing does not tell it)."""
    import multiprocessing.forkserver as fs

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    main = threading.current_thread() is threading.main_thread()
    # the server's first import ties it to this process (server_guard), where the parent-death
    # signal can follow this process: it follows the thread that starts the server
    os.environ["HYBRIDPAR_LAUNCHER"] = str(os.getpid()) if main else ""
    # the server starts with Ctrl-C ignored (and Python leaves an ignored SIGINT so, in it and
    # in the ranks it forks): a Ctrl-C at the terminal reaches the whole process group, and a
    # server still importing torch printed a 30-line traceback of it; this process stops the
    # server and its ranks itself (stop_on_signals, _watch)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        fs.ensure_running()
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
    return ctx, getattr(_fork_server(), "_forkserver_pid", None)


def _fork_server() -> Any:
    """multiprocessing's fork-server object in this process (None before
    multiprocessing.forkserver is imported). Imports nothing: a signal handler calls it."""
    return getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)


# the pid of the server `start_server` started, until `settle_server` has seen it finish its import
_importing: int | None = None


def start_server() -> None:
    """Start the fork server now, so that it imports torch while this process still reads its
    inputs and plans (a command that will launch calls it first): the two imports run side by
    side instead of one after the other. The server
    is no rank: it has imported torch and runs nothing until `launch` asks it to fork. If this
    process ends before then (a bad input, exit 2), the server is killed at exit rather than
    left to finish its import alone. Nothing to do under torchrun."""
    global _importing
    if under_torchrun():
        return
    _importing = _server()[1]
    atexit.unregister(_kill_server)  # registered once, however often a process calls this
    atexit.register(_kill_server)


def settle_server() -> None:
    """Wait until the fork server `start_server` started has finished its import: a measurement
    (a compute profile) taken meanwhile would share a core with it. The server answers a fork
    only from its main loop, after the import, so one trivial process started and joined is the
    wait; once per server started early, nothing otherwise."""
    global _importing
    if _importing is not None and _importing == getattr(_fork_server(), "_forkserver_pid", None):
        p = mp.get_context("forkserver").Process(target=int, daemon=True)
        p.start()
        p.join()
    _importing = None


def _kill_server() -> None:
    """End the fork server at once (at exit, or on a signal before any rank started): its ranks,
    if any are still there, follow it (PR_SET_PDEATHSIG). Imports nothing: a signal handler
    calls it."""
    server = _fork_server()
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
    server._forkserver_pid = server._forkserver_alive_fd = None


def _release_server() -> None:
    """Drop this rank's copy of the fork server's "alive" pipe. The server exits when every copy
    of its write end is closed, and multiprocessing hands one to each process it forks; a rank
    holding it would keep the server alive after the launcher is killed, and the server would
    keep the rank alive (its PR_SET_PDEATHSIG waits for the server): measured, the ranks of a
    launcher killed by SIGKILL ran on for 20 s, until a collective timed out."""
    server = _fork_server()
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


_received: list[int] = []  # signals the handler recorded while ranks were running
_watching = threading.Event()


def stop_on_signals() -> Callable[[], None]:
    """SIGINT and SIGTERM (Ctrl-C, a scheduler, `timeout`) end the job with one line. Before any
    rank runs there is nothing to clean up: the handler says so and exits at once (raising from a
    handler can land inside a C++ callback, e.g. during `import torch`, and abort). While ranks
    run it only records the signal; the launcher's watch loop raises Interrupted and stops them.
    Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, _frame):
        if _watching.is_set():
            _received.append(signum)
            return
        name = signal.Signals(signum).name
        os.write(2, f"hybridpar: stopped by {name} before any rank started\n".encode())
        _kill_server()  # started early (`start_server`), it would finish its import alone
        os._exit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, h) for s, h in old.items()] and None


def _watch(procs: list, queue, nprocs: int, timeout_s: float, grace_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    backstop = timeout_s * 4 + 600  # collectives time out much sooner
    deadline = time.monotonic() + backstop

    def drain(wait: float = 0.0) -> None:
        end = time.monotonic() + wait
        while True:
            try:
                rank, status, payload = queue.get(
                    timeout=max(0.0, min(0.05, end - time.monotonic()))
                )
            except Empty:
                if time.monotonic() >= end:
                    return
                continue
            (results if status == "ok" else errors)[rank] = payload

    while True:
        drain(0.05)
        if _received:
            raise Interrupted(_received[0])
        codes = [p.exitcode for p in procs]
        failed = [r for r, c in enumerate(codes) if (c is not None and c != 0) or r in errors]
        if failed:
            break
        if all(c == 0 for c in codes) or (
            len(results) == nprocs and all(c is not None for c in codes)
        ):
            drain(0.2)
            missing = [r for r in range(nprocs) if r not in results]
            if missing:
                raise RankFailure(f"rank {missing[0]} exited without returning its result")
            return [pickle.loads(results[r]) for r in range(nprocs)]
        if time.monotonic() > deadline:
            raise RankFailure(
                f"job exceeded its {backstop:.0f} s backstop; ranks {sorted(set(range(nprocs)) - set(results))} never finished"
            )
    # something failed: give the others a moment to report, then name the culprit
    t_fail = time.monotonic()
    while time.monotonic() - t_fail < grace_s and any(p.exitcode is None for p in procs):
        drain(0.1)
    drain(0.1)
    raise RankFailure(*_blame(procs, errors))


def _blame(procs: list, errors: dict[int, tuple[str, str]]) -> tuple[str, str]:
    codes = [p.exitcode for p in procs]
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    if killed:
        r = killed[0]
        return f"rank {r} {_describe(codes[r])}; the job was stopped", ""
    raised = [
        r
        for r in errors
        if "timed out" not in errors[r][0].lower()
        and "timeout" not in errors[r][0].lower()
        and "connection" not in errors[r][0].lower()
    ]
    if raised:
        r = min(raised)
        return f"rank {r} failed: {errors[r][0]}", errors[r][1]
    hung = [r for r, c in enumerate(codes) if c is None]
    if hung and errors:
        return (
            f"rank {hung[0]} did not respond (hung?); ranks {sorted(errors)} timed out waiting for it "
            "in a collective; the job was stopped"
        ), ""
    crashed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in errors]
    if crashed:
        return (
            f"rank {crashed[0]} {_describe(codes[crashed[0]])} without a message; the job was stopped",
            "",
        )
    r = min(errors)
    return f"rank {r} failed: {errors[r][0]}", errors[r][1]


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    t = time.monotonic()
    for p in procs:
        p.join(max(0.0, 2.0 - (time.monotonic() - t)))
        if p.is_alive():
            p.kill()
            p.join(1.0)
