"""Worker processes in one torch.distributed group, kept alive across tests.

``Workers(world)`` spawns ``world`` processes that join a gloo process group (on the CPU;
``backend="nccl"``: one GPU per process);
``workers.run(fn, *args)`` calls ``fn(rank, world, *args)`` on every one of them at once and
returns their results in rank order. Starting processes costs seconds, a call milliseconds, so
hypothesis can draw many examples against one group. ``fn`` must be a module-level function
of an importable module (the workers unpickle it), and its results picklable (CPU tensors).

A call that raises on some rank returns a ``Raised`` for that rank; a call that does not finish
within ``timeout`` seconds (a hang) kills the workers and fails the test, instead of hanging
the test run.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch.multiprocessing as mp

GROUP_TIMEOUT = timedelta(seconds=60)  # a collective that waits longer raises on its rank
# Examples of a property test over NCCL: each runs on every rank, and each new combination
# of options compiles its kernels in every process: the GPU profile's 200 took minutes of
# several GPUs (the LM head's test did not finish in 4 minutes on 2 × H200).
NCCL_EXAMPLES = 50


@dataclass
class Raised:
    """What a rank raised: the exception's type name, its message and the traceback."""

    type: str
    message: str
    traceback: str


def all_ok(results: list) -> list:
    """The ranks' results, after failing the test with the first rank's exception if one
    raised (its type, message and traceback)."""
    for rank, r in enumerate(results):
        if isinstance(r, Raised):
            raise AssertionError(f"rank {rank} raised {r.type}: {r.message}\n{r.traceback}")
    return results


class Workers:
    def __init__(self, world: int, timeout: float = 120.0, backend: str = "gloo"):
        self.world, self.timeout = world, timeout
        ctx = mp.get_context("spawn")
        fd, path = tempfile.mkstemp(prefix="fusedloss-pg-")
        os.close(fd)
        os.unlink(path)  # the file store creates it
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(target=_serve,
                        args=(r, world, path, backend, self._inboxes[r], self._outbox),
                        daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self.alive = True
        self.killed: list[int] = []  # ranks that did not leave within 5 s of ``close``

    def run(self, fn, *args) -> list:
        """fn(rank, world, *args) on every rank; the results (or ``Raised``) in rank order."""
        if not self.alive:
            raise RuntimeError("these workers were stopped after an earlier hang")
        for inbox in self._inboxes:
            inbox.put((fn, args))
        results: dict[int, object] = {}
        while len(results) < self.world:
            try:
                rank, value = self._outbox.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                raise AssertionError(
                    f"{fn.__name__} did not finish on ranks "
                    f"{sorted(set(range(self.world)) - set(results))} within {self.timeout} s "
                    f"(a hang)") from None
            results[rank] = value
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for inbox in self._inboxes:
            inbox.put(None)
        for rank, p in enumerate(self._procs):
            p.join(timeout=5)
            if p.is_alive():  # hung, e.g. in destroy_process_group
                p.kill()
                self.killed.append(rank)


def _serve(rank: int, world: int, path: str, backend: str, inbox, outbox) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    while (job := inbox.get()) is not None:
        fn, args = job
        try:
            value = fn(rank, world, *args)
        except BaseException as e:  # noqa: BLE001 - reported to the test, which decides
            value = Raised(type(e).__name__, str(e), traceback.format_exc())
        outbox.put((rank, value))
    dist.destroy_process_group()
