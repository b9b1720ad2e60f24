"""The one exception type that user-facing code raises for bad input.

Its message is a single line that says what to change; the CLI prints it and exits with code 2.
"""


class ConfigError(ValueError):
    """Bad input: an unknown name, an impossible grid, a malformed file. One line, actionable."""
