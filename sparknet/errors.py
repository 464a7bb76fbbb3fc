"""The one exception type users see: its message is a single line that says what to fix."""


class SparknetError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback."""


class PermanentTaskError(SparknetError):
    """Raised inside a Spark task for a fault that a retry cannot heal (a shard whose bytes differ
    from the manifest, a missing object): the task hands it back to the driver, which fails the run
    at once instead of letting Spark retry the task."""


class InputError(SparknetError):
    """A problem the user fixes in what they gave: an option, a setting, a file, a name or id
    that AWS would refuse or does not have. Commands that tell it apart from a failure on the
    way (AWS, a node, an interrupt) exit 2 for it, 1 for those."""
