"""User-facing error types.

Every error a user can cause (bad job file, wrong grid, broken dataset) derives from
:class:`HpcparError`; the CLI prints such errors as one line and exits with code 2, with no
traceback. Anything else is a bug and keeps its traceback.
"""


class HpcparError(Exception):
    """A user error: the message is one line naming the file/field/layer and what was expected."""

    exit_code = 2


class GridError(HpcparError, ValueError):
    """The process grid does not fit the communicator (wrong sizes, non-positive axes)."""


class CommError(HpcparError, RuntimeError):
    """A tensor cannot be moved through MPI as asked (dtype, device, mismatched shapes)."""
