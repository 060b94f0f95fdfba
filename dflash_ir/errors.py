"""Errors users see; each message says what happened and what to do."""


class DflashError(Exception):
    """Base of dflash-ir's user-facing errors."""


class ContextOverflowError(DflashError):
    """A call would need more context rows than the compiled context size holds."""


class ArtifactError(DflashError):
    """A compiled artifact is missing, edited, or made by another version or backend."""
