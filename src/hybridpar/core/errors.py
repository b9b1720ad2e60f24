"""The one exception type that user-facing code raises for bad input.

Its message is a single line that says what to change; the CLI prints it and exits with code 2.
"""


class ConfigError(ValueError):
    """Bad input: an unknown name, an impossible grid, a malformed file. One line, actionable."""


class Interrupted(BaseException):
    """The job was told to stop (SIGINT, SIGTERM); every rank it started has been stopped. Like
    KeyboardInterrupt it is no Exception, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}; every rank was stopped")
