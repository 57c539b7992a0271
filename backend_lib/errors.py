"""Errors that reach a client: each says what is wrong with that caller's request."""


class InputError(ValueError):
    """The request is malformed or out of limits. Only that request fails."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its configured maximum; the request is refused."""
