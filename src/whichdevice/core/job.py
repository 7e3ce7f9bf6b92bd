"""The job resolve_device() was told about: task, sequences and offload, one record for every decider.

The CPU's measured dtype (precision) reads its batch size and length; placement (memory) reads all
of it. It lives here, below both, so neither imports the other for it.
"""

from __future__ import annotations

from whichdevice.core.frozen import frozen_record

__all__ = ["Job", "new_tokens"]


@frozen_record
class Job:
    """What the caller said about the job: the task, its sequences, and whether it may offload (None: not said)."""

    task: str = "inference"
    batch_size: int | None = None
    max_length: int | None = None
    offload: str | None = None
    offload_folder: str | None = None
    # Tokens each sequence generates (generate's max_new_tokens): what a one-time setup is counted
    # against. None: not said (then half of max_length).
    max_new_tokens: int | None = None
    # Many independent requests served through transformers' continuous batching (generate_batch),
    # as resolve_device(serving=True) says (attention/serving.py): not a batch one generate() runs.
    serving: bool = False

    @property
    def generation(self) -> bool:
        """An inference job whose sequences are known: a generate() call (a serving job runs
        generate_batch, which takes none of generate's keywords)."""
        sized = (self.batch_size, self.max_length, self.max_new_tokens)
        return self.task == "inference" and not self.serving and any(v is not None for v in sized)


def new_tokens(job: Job) -> int | None:
    """The tokens each sequence generates: max_new_tokens where said, else half of max_length; None
    where neither is said."""
    if job.max_new_tokens is not None:
        return job.max_new_tokens
    if job.max_length:
        return max(job.max_length - job.max_length // 2, 1)
    return None
