"""User-facing errors: the CLI prints these as one line and exits 2 (no traceback)."""


class DraftlabError(Exception):
    """Bad input from the user: a recipe field, a file, a flag. The message names it."""
