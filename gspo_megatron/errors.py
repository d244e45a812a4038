"""The one exception type for mistakes in what the user gave us (config, data, reward, model files,
checkpoints, output directory), and how a command line reports it.

Code anywhere below ``train.py`` raises :class:`UserInputError` (or a subclass) with a message that
names the file and line, or the config field, and says what to do. ``gspo-train`` and the tools catch
it on every rank and end with ONE line ``<prog>: error: <message>`` on stderr and exit status 2,
printed by global rank 0 only (other ranks exit with 2 quietly), without a traceback unless
``--debug`` (or ``GSPO_DEBUG=1``) is given.

Under torchrun every rank runs the same start-up checks; :func:`agree` (one all-gather over the
default process group, which the program creates next anyway) lets every rank learn whether any
rank failed, so all stop together and :func:`stop_all` has rank 0 print before anyone exits
(a rank exiting first makes torchrun kill the others, possibly before rank 0 has printed).
"""

from __future__ import annotations

import os
import sys
import traceback

EXIT_USER_ERROR = 2


class UserInputError(ValueError):
    """Bad user input; ``str(e)`` is the one line to show (it names the file:line or the field)."""


class ConfigError(UserInputError):
    """A config that cannot work. ``errors`` lists every problem found, each naming its field."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        msg = (
            self.errors[0]
            if len(self.errors) == 1
            else (f"{len(self.errors)} config errors:\n" + "\n".join(f"  - {e}" for e in self.errors))
        )
        super().__init__(msg)


def one_line(e: BaseException) -> str:
    """The error's message folded onto one line (KeyError's repr quotes dropped)."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(msg).split()) or type(e).__name__


def is_rank0() -> bool:
    """Global rank 0, or a process that is not part of a torchrun job (no collectives needed)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # noqa: BLE001 - torch missing or broken: fall back to the environment
        pass
    return os.environ.get("RANK", "0") == "0"


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get("GSPO_DEBUG", "") not in ("", "0")


def report(prog: str, e: BaseException, debug: bool = False) -> int:
    """Print ``prog: error: <one line>`` on rank 0 (with the traceback first when ``debug``) and
    return :data:`EXIT_USER_ERROR`. Every rank calls it; the others print nothing."""
    if is_rank0():
        if debug_requested(debug):
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def agree(error: BaseException | None) -> BaseException | None:
    """Collective over every rank (under torchrun; a no-op in a world of one): the lowest failing
    rank's error (as a UserInputError carrying its one line, or this rank's own error when it is
    that one), or None when every rank passed. Creates the default process group if needed."""
    if _world_size() <= 1:
        return error
    import torch.distributed as dist

    from gspo_megatron.runtime.distributed import init_process_group

    init_process_group()
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else one_line(error))
    first = next((m for m in messages if m), None)
    if first is None:
        return None
    return error if error is not None and one_line(error) == first else UserInputError(first)


def stop_all(prog: str, error: BaseException, debug: bool = False, *, together: bool = False) -> int:
    """Report ``error`` (rank 0 prints), and when every rank stops together (``together``: the
    caller says so, because the error is what :func:`agree` returned, or a broadcast made every rank
    raise it) wait for rank 0 to have printed, then leave the process groups. Returns
    :data:`EXIT_USER_ERROR`."""
    code = report(prog, error, debug)
    import torch.distributed as dist

    if dist.is_initialized():
        if together:
            dist.barrier()
        from gspo_megatron.runtime.distributed import destroy_distributed

        destroy_distributed()
    return code
