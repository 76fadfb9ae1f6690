"""Errors a user can fix. The app turns each into one message and a non-zero exit."""


class TrainerError(Exception):
    """Base of the errors whose message tells the user what is wrong and what to do.
    `alike`: every rank of a torchrun job meets it alike (a value of the command line, which
    each is given), so that rank 0 alone says it (on each node, its first rank: app.say_refusal)."""

    def __init__(self, message: str, alike: bool = False):
        super().__init__(message)
        self.alike = alike


class ConfigError(TrainerError):
    """A configuration value that cannot work; the message names the key."""


class PlanError(TrainerError):
    """A plan that cannot be built or is inconsistent; the message names the tensor or region."""


class DataError(TrainerError):
    """Missing, empty or corrupt data; the message names the path."""


class PeerError(TrainerError):
    """Another rank of the job failed, ended, or did not answer in time; the message says
    which, or where its log is."""


class CheckpointError(TrainerError):
    """A checkpoint that cannot be read or belongs to another model or plan."""


class WriteError(TrainerError):
    """A file the run cannot write (a full disk, a folder made read-only); the message names it.
    `errno`: the write's, which says what to do (make room, or make the folder writable)."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class DivergedError(TrainerError):
    """Training diverged: a NaN or infinite loss (under AMP too: no loss scale mends a forward
    pass), or an epoch's loss too large to come from a model that still learns."""
