"""The fork server's first import (runtime.launcher.PRELOAD), before torch: the server ends with
the process that started it. The kernel kills it when that process dies (PR_SET_PDEATHSIG), and
it exits at once if that process is already gone. Without this, a launcher killed by SIGKILL
while its server was still importing torch left the server to finish that import alone (3.5 to
6 s seen under load, issue 70), and a rank still unpickling its job kept it alive longer.
The launcher names itself in HYBRIDPAR_LAUNCHER when it starts a server from its main thread
(the parent-death signal follows the thread that started the process); unset, nothing is done."""

from __future__ import annotations

import os

from hybridpar.core import faults
from hybridpar.runtime.launcher import die_with_parent

_launcher = os.environ.get("HYBRIDPAR_LAUNCHER")
if _launcher:
    die_with_parent(int(_launcher))
    faults.at("server")
