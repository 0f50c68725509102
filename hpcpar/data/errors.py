"""The dataset error type: one line naming the file and the field that is wrong."""

from ..errors import HpcparError


class DataError(HpcparError, ValueError):
    """A dataset, shard file or reader argument is unusable (missing, corrupt, mismatched)."""
