"""The one exception type users see: its message is a single line that says what to fix."""


class SparknetError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback."""
