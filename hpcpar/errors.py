"""Every error class of hpcpar and every exit code, in one place.

A mistake a user can make (a bad job file, a grid that does not fit, a broken dataset, a layer that
cannot be split that way, a run directory that cannot be resumed, a job that cannot be launched)
raises a subclass of :class:`HpcparError` whose message is one line naming the file/field/layer and
what was expected. The CLI and every rank print it as ``hpcpar: error: <message>`` and exit with the
class's ``exit_code``, without a traceback. Anything else is a bug and keeps its traceback (exit
code 1).

The classes are as few as a user needs to tell apart: each names *what to fix*.
docs/reference/errors.md lists each class with what raises it, and what every exit code means (a
test checks that it names every class and code).

This module imports nothing from hpcpar: every layer may use it."""

EXIT_OK = 0
EXIT_FAILED = 1               # a bug, a dead rank, or the stall detector's abort
EXIT_USAGE = 2                # any HpcparError, a click usage error
EXIT_REQUEUE = 3              # stopped by a signal after a checkpoint: requeue to resume
EXIT_DIVERGED = 4             # a non-finite loss or gradient (on_nonfinite = "stop")
EXIT_BELOW_REFERENCE = 5      # hpcpar report --expect: a point fell short of its reference
EXIT_OUT_OF_MEMORY = 6        # hpcpar run: a rank killed by the kernel's memory limit
EXIT_ABORTED = 130            # Ctrl-C in the CLI


class HpcparError(Exception):
    """A user error: the message is one line naming the file/field/layer and what was expected.
    Catch this to catch every hpcpar user error; raise one of the subclasses below."""

    exit_code = EXIT_USAGE
    #: Set on an error every rank raises alike (the same check on the same data), so that
    #: rank 0 alone reports it.
    collective: bool = False


class ConfigError(HpcparError, ValueError):
    """A setting is invalid: a job file field, a command-line option, an ``HPCPAR_*``
    environment variable, a machine file, or an API option value (``compression=``...)."""

    exit_code = EXIT_USAGE


class GridError(HpcparError, ValueError):
    """The process grid does not fit the communicator (wrong sizes, non-positive axes)."""

    exit_code = EXIT_USAGE


class LayerError(HpcparError, ValueError):
    """A layer or model cannot run over this grid or on this input: too many ranks for the
    volume (halo wider than a rank's part), an option the distributed layer does not
    support, an input shape other than the one it was built for, a module ``spatialize``
    cannot convert, a tensor-parallel axis larger than the features it splits."""

    exit_code = EXIT_USAGE


class CommError(HpcparError, RuntimeError):
    """A collective cannot proceed as asked: a tensor MPI cannot carry (dtype, device,
    layout), or ranks that disagree (shapes differ across ranks, the model differs across
    ranks under DistributedDataParallel). Raised on every rank alike, instead of a hang."""

    exit_code = EXIT_USAGE


class DataError(HpcparError, ValueError):
    """A dataset is missing, malformed, or does not fit the job: HDF5 volume shards and
    their manifest, graph files and their partitions, the options that make them."""

    exit_code = EXIT_USAGE


class RunDirError(HpcparError, RuntimeError):
    """A run directory cannot be used as asked: a checkpoint is missing, corrupt, or was
    written by another grid/model; run records (``meta.json``, ``rank-*.csv``) are missing,
    unreadable or of another schema version."""

    exit_code = EXIT_USAGE


class DivergedError(HpcparError, FloatingPointError):
    """Training diverged: a rank's loss or gradients (or the weights) became non-finite."""

    exit_code = EXIT_DIVERGED


class LaunchError(HpcparError, RuntimeError):
    """The job cannot be started or submitted: no ``mpiexec``, a launcher that fails to
    start, ``-n`` against an existing MPI world, a bad site profile, batch-script value or
    submission option (``--time``, ``--after``, ``--nodes``), ``sbatch``/``squeue``
    failures, sweep points that failed."""

    exit_code = EXIT_USAGE


#: every error class, root first (the reference page and its test list these)
ERRORS = (HpcparError, ConfigError, GridError, LayerError, CommError, DataError, RunDirError,
          DivergedError, LaunchError)

#: every exit code: name -> value
EXIT_CODES = {name: code for name, code in globals().items() if name.startswith("EXIT_")}
