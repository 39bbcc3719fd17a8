"""Training on several processes: ``memfit train --nproc N``, one rank per process.

memfit does not build its own launcher or engine. ``--nproc N`` starts torchrun's launcher
(``torch.distributed.launcher``: the elastic agent of ``torchrun --standalone``, one node) from the
command's own process, and each of its N processes runs the same ``memfit train`` as a rank: it
joins the process group (gloo on a CPU, NCCL on GPUs), builds the one TrainStep with FSDP2 over the
N ranks (memfit.techniques.sharding) and trains its share of every global batch. A user's own
``torchrun --nproc-per-node N -m memfit.cli.main train ...`` runs the same ranks.

What the ranks agree on, and how:
- the data: every rank makes the same global batch and keeps its slice (``rank_share``), so N
  ranks train on the samples, in the order, that one process would;
- the loss logged: the mean of the ranks' losses (equal shares, so the global batch's loss);
- the peak: each rank measures its own; rank 0 gathers them (``gather``);
- out-of-memory adaptation: rank 0 decides the new plan and broadcasts it (``decide``), so all
  ranks rebuild the same step and stay in lockstep (see memfit.training.adapt);
- what is written: rank 0 writes metrics.jsonl and the report; checkpoints are DCP, each rank
  writing its shards (memfit.training.sharded_checkpoint).

A user error in any rank stops all of them (the elastic agent terminates the others): each rank
writes its one-line error to a file, and the launching command prints one line, rank 0's first.

SIGTERM or SIGUSR1 to the launching command: torchrun's agent passes it on to the ranks (SIGUSR1
added to the signals it handles), which stop after the same step with a checkpoint
(memfit.training.preemption); rank 0 leaves its line in the same folder and the launching command
prints it with the command that resumes, exit 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UserError

ERRORS_ENV = "MEMFIT_RANK_ERRORS"
"""Set by the launcher: the folder where each rank writes the error that stopped it."""
RANK0_GRACE = 5.0
"""Seconds a failed rank other than 0 waits for rank 0 to report an error too before it exits."""
TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits in a collective for the others (a rank that died is found sooner by the
launcher, which stops the rest)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of a run (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean_and_any(self, value: float, flag: bool) -> tuple[float, bool]:
        """The mean of ``value`` over the ranks, and whether ``flag`` is set on any rank: one
        all-reduce of two numbers (the loop's per-step loss, and a stop asked by a signal)."""
        import torch.distributed as dist
        t = torch.tensor([float(value), float(flag)], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(t)
        return float(t[0].item()) / self.world_size, bool(t[1].item() > 0)

    def gather(self, value: int) -> list[int]:
        """``value`` of every rank, in rank order (on every rank)."""
        import torch.distributed as dist
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, int(value))
        return out

    def decide(self, choose: Callable[[], Any]) -> Any:
        """``choose()`` run on rank 0 only, its result (or its UserError) on every rank."""
        import torch.distributed as dist
        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", choose())
            except UserError as e:
                box[0] = ("error", e)
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()


def current() -> Ranks | None:
    """The ranks of this process when a launcher (torchrun, or ``--nproc``) started it as one of
    several; None in a process of its own."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or int(world) <= 1:
        return None
    return Ranks(rank=int(os.environ["RANK"]), world_size=int(world),
                 local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def backend_for(device_kind: str) -> str:
    return "nccl" if device_kind == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(ranks: Ranks, device_kind: str):
    """Join the run's process group (torchrun's rendezvous address from the environment), and leave it."""
    import torch.distributed as dist
    if device_kind == "cuda":
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group(backend_for(device_kind), rank=ranks.rank, world_size=ranks.world_size,
                            timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def out_of_step(error: Exception, out_dir) -> UserError:
    """A collective failed (a rank died, or waited past the timeout for one that went elsewhere:
    out of memory on some ranks only): the run stops, its last checkpoint is kept."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return UserError(f"the ranks fell out of step ({first}); a rank died, or ran out of memory alone. The last "
                     f"checkpoint in {str(out_dir)!r} is kept: --resume continues from it (with --budget or a plan "
                     "that needs less memory, if memory ran short)")


def _collective_device() -> str:
    import torch.distributed as dist
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def rank_share(batch: Any, ranks: Ranks, rank_batch: int) -> Any:
    """This rank's slice of a global batch: samples ``[rank * rank_batch, (rank + 1) * rank_batch)``
    of every tensor (dim 0 is the batch)."""
    from torch.utils._pytree import tree_map
    lo = ranks.rank * rank_batch
    return tree_map(lambda x: x[lo:lo + rank_batch] if isinstance(x, torch.Tensor) else x, batch)


# -- the launching command ----------------------------------------------------------------------

def check_launch(nproc: int, device_kind: str, port: int | None) -> None:
    """Refuse, before any process starts, what would make the ranks fail: a backend this PyTorch
    or machine lacks, more GPU ranks than GPUs, a rendezvous port in use."""
    import torch.distributed as dist
    if not dist.is_available():
        raise UserError("--nproc needs torch.distributed, which this PyTorch build lacks; install a PyTorch "
                        "with distributed support, or train without --nproc")
    if device_kind == "cuda":
        if not dist.is_nccl_available():
            raise UserError("--nproc on GPUs needs the NCCL backend, which this PyTorch build lacks; install a "
                            "CUDA build of PyTorch, or train on the CPU (--device cpu, gloo)")
        if nproc > torch.cuda.device_count():
            raise UserError(f"--nproc {nproc} on GPUs needs a GPU per rank and this machine has "
                            f"{torch.cuda.device_count()}; use --nproc {torch.cuda.device_count()} or fewer")
    elif not dist.is_gloo_available():
        raise UserError("--nproc on a CPU needs the gloo backend, which this PyTorch build lacks; install a "
                        "PyTorch with gloo, or train without --nproc")
    if port is not None:
        if not 0 < port < 65536:
            raise UserError(f"--port {port}: give a TCP port from 1 to 65535, or leave it out (a free one is chosen)")
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise UserError(f"--port {port} is in use on this machine; choose another port, or leave --port "
                                "out (a free one is chosen)") from None


def launch(argv: list[str], nproc: int, *, port: int | None = None, debug: bool = False, resume: str = "") -> int:
    """Run ``memfit train *argv`` in ``nproc`` processes under torchrun's elastic agent (one node,
    no restarts), as torchrun does; the exit status is the ranks': 0, or the first failing rank's,
    with its one line. A signal that stopped the ranks after a checkpoint (memfit.training.preemption)
    is exit 0, with rank 0's line and the command that resumes, ``resume``."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not debug:  # the agent's own logging of a failed rank; the rank's error is printed below
        for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    threads = max(1, (os.cpu_count() or 1) // nproc)
    saved = {k: os.environ.get(k) for k in (ERRORS_ENV, "OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory(prefix="memfit-ranks-") as errors:
        os.environ.update({ERRORS_ENV: errors, "OMP_NUM_THREADS": saved["OMP_NUM_THREADS"] or str(threads)})
        # SIGUSR1 too (SLURM's early warning): the agent passes it on to the ranks, as it does SIGTERM
        signals = {"signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"} if "signals_to_handle" in {
            f.name for f in dataclasses.fields(LaunchConfig)} else {}
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"memfit-{os.getpid()}",
                              rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port or 0}",
                              rdzv_configs={"is_host": True}, max_restarts=0, monitor_interval=0.2, **signals)
        try:
            elastic_launch(config, sys.executable)("-m", "memfit.cli.main", "train", *argv)
        except ChildFailedError as e:
            if _said_stopped(Path(errors), resume):
                return 0  # (a rank that had saved was stopped while it exited)
            return _report_failure(Path(errors), e)
        except SignalException as e:  # the agent got a signal and passed it on to the ranks
            if _said_stopped(Path(errors), resume):
                return 0
            name = signal.Signals(e.sigval).name
            print(f"memfit train: {name}: the ranks stopped before saving; the last complete checkpoint in --out stays "
                  f"and --resume continues from it: {resume}", file=sys.stderr)
            return 128 + int(e.sigval)
        else:
            _said_stopped(Path(errors), resume)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return 0


def record_error(line: str, code: int) -> bool:
    """In a launched rank, keep the one line that stopped it for the launcher to print (True);
    False when this process is not a launched rank."""
    folder = os.environ.get(ERRORS_ENV)
    ranks = current()
    if not folder or ranks is None:
        return False
    written = Path(folder) / f"{ranks.rank}"
    written.with_suffix(".part").write_text(f"{code}\n{line}")
    written.with_suffix(".part").replace(written)  # (whole or not at all: ranks are stopped at any moment)
    if ranks.rank != 0:  # an error every rank hits (a plan, a checkpoint) is reported as rank 0's, not
        # as that of whichever rank got there first: the launcher stops every rank once one exits
        deadline = time.monotonic() + RANK0_GRACE
        while time.monotonic() < deadline and not (Path(folder) / "0").exists():
            time.sleep(0.05)
    return True


STOPPED = "stopped"
"""The file rank 0 of a launched run writes when a signal stopped the run after a checkpoint."""


def record_stop(line: str) -> bool:
    """In rank 0 of a launched run, keep the line saying where a signal stopped the run, for the
    launcher to print with the command that resumes (True); False when not a launched rank."""
    folder = os.environ.get(ERRORS_ENV)
    ranks = current()
    if not folder or ranks is None:
        return False
    if ranks.is_main:
        part = Path(folder) / f"{STOPPED}.part"
        part.write_text(line)
        part.replace(Path(folder) / STOPPED)
    return True


def _said_stopped(errors: Path, resume: str) -> bool:
    """Print rank 0's stop line and the command that resumes, if the ranks were stopped by a signal."""
    stopped = errors / STOPPED
    if not stopped.is_file():
        return False
    print(f"{stopped.read_text()}; resume with: {resume}", flush=True)
    return True


def _report_failure(errors: Path, failure) -> int:
    written = sorted((int(p.name), p.read_text().split("\n", 1)) for p in errors.iterdir() if p.name.isdigit())
    if written:
        rank, (code, line) = written[0]
        print(line if rank == 0 else line.replace(": error: ", f": error: rank {rank}: ", 1), file=sys.stderr)
        return int(code)
    failures = getattr(failure, "failures", {}) or {}
    first = min(failures.items(), default=(None, None))[1]
    code = getattr(first, "exitcode", 1) if first is not None else 1
    print(f"memfit train: error: a rank stopped with exit status {code} and no message (killed, or out of host "
          "memory?); run with --debug to see the ranks' output", file=sys.stderr)
    return 1
