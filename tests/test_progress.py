"""Long work says what it does as it starts, also when its output is a pipe or a log (issue 64):
calibrate's collectives, the compute profile a plan is priced with, and the first step that
torch.compile compiles in, each announced on a line before the line with its result."""

import subprocess
import sys


def _run(*argv: str, cwd) -> list[str]:
    """The command's stdout and stderr, merged into one pipe as a log would take them."""
    cmd = [sys.executable, "-m", "hybridpar", *argv]
    r = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:]
    return r.stdout.splitlines()


def _before(lines: list[str], announced: str, result: str) -> None:
    first = next((i for i, ln in enumerate(lines) if ln.startswith(announced)), None)
    got = next((i for i, ln in enumerate(lines) if ln.startswith(result)), None)
    assert first is not None and got is not None and first < got, "\n".join(lines)


def test_calibration_profile_and_compilation_are_announced_through_a_pipe(tmp_path, cache):
    lines = _run("calibrate", "--nproc", "2", "--repeats", "1", cwd=tmp_path)
    _before(lines, "hybridpar: calibrating cpu collectives at 2 ranks", "localhost (cpu, gloo)")
    assert any(ln.endswith("s left") for ln in lines), lines  # the parts done, the time left
    lines = _run(
        *("train", "--model", "mlp", "--nproc", "2", "--batch", "16", "--preset", "ddp"),
        *("--compile", "--compile-backend", "aot_eager", "--max-steps", "2", "--epochs", "1"),
        cwd=tmp_path,
    )
    _before(lines, "hybridpar: compute profile of mlp on cpu", "plan batch for mlp")
    _before(lines, "hybridpar: first step (torch.compile compiles 1 parts", "  epoch   1")
    _before(lines, "hybridpar: first step (torch.compile compiles 1 parts", "compiled 1 parts")
