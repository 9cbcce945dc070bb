"""Exceptions raised for bad user input; the CLI turns them into one clear error line."""


class InputError(ValueError):
    """Bad input from the user: a file, a record, a config key or a checkpoint.

    The message names the offending file and line, or the key and its valid values.
    """
