"""Tensor and expert parallel over torch.distributed: which share of a weight a rank holds, the collectives the
model calls, and the launcher behind `--tp N`.

A rank holds 1/N of the split weights (`mhcrun.weights` says which dimension each weight splits along) and a
contiguous block of the routed experts; everything else is replicated. The model calls `all_reduce` after the
attention output (wo_b's columns), the index scores (before top-k, so every rank picks the same entries), the MoE
(each rank's experts), the embedding (vocabulary rows); `gather_vocab` joins the head's vocabulary rows. Both
reduce in fp32 (gloo has no bf16 reductions) and never call all_gather (it fails on gloo under inference_mode):
a gather is an all-reduce of a zero tensor each rank fills its own slice of, which is exact.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mhcrun.errors import InputError, Terminated, signal_exit
from mhcrun.settings import Env


@dataclass
class Traffic:
    """What one rank has put into all-reduces outside compiled graphs (their fp32 inputs), for the per-token report."""

    bytes: int = 0


@dataclass(frozen=True)
class Shard:
    """This process's place: rank `rank` of `world` (world 1: no parallelism), and its collectives' traffic."""

    rank: int = 0
    world: int = 1
    traffic: Traffic = field(default_factory=Traffic, compare=False, repr=False)

    def part(self, n: int) -> slice:
        """Rank's contiguous share of n (n divisible by world, checked by `check_divides`)."""
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)

    def experts(self, n_experts: int) -> range:
        s = self.part(n_experts)
        return range(s.start, s.stop)

    def take(self, t: torch.Tensor, split: int | None) -> torch.Tensor:
        """This rank's part of t along `split` (None: all of it): a view, so only its pages of a mapped tensor are
        ever read; a column share is made contiguous (a copy of the share alone)."""
        if split is None or self.world == 1:
            return t
        part = self.part(t.shape[split])
        t = t.narrow(split, part.start, part.stop - part.start)
        return t if t.is_contiguous() else t.contiguous()


SINGLE = Shard()  # world 1 never reduces: its traffic stays 0


def check_divides(cfg, world: int) -> None:
    """--tp N must divide what it splits: one line naming which, before any worker starts."""
    for what, n in (("attention heads", cfg.n_heads), ("o_groups", cfg.o_groups),
                    ("index heads", cfg.index_n_heads), ("routed experts", cfg.n_routed_experts),
                    ("the vocabulary", cfg.vocab_size)):
        if n % world:
            raise InputError(f"--tp {world} does not divide {what} ({n})")


# ---------------------------------------------------------------------------------------------- collectives

def all_reduce(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The sum of t over the ranks (in fp32), in t's dtype."""
    if shard.world == 1:
        return t
    import torch.distributed as dist

    if torch.compiler.is_compiling():  # inside a compiled region: the functional collective, which traces
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(t.float(), "sum", dist.group.WORLD).to(t.dtype)
    x = t.float().contiguous() if t.dtype != torch.float32 else t.contiguous().clone()
    shard.traffic.bytes += x.numel() * x.element_size()
    dist.all_reduce(x)
    return x.to(t.dtype)


def gather_vocab(local: torch.Tensor, shard: Shard, vocab: int) -> torch.Tensor:
    """Each rank's logits [b, V/N] of its vocabulary rows -> the full [b, V] on every rank (exact)."""
    if shard.world == 1:
        return local
    full = torch.zeros(*local.shape[:-1], vocab, dtype=torch.float32, device=local.device)
    full[..., shard.part(vocab)] = local.float()
    return all_reduce(full, shard)


def gather_rows(row: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Each rank's `row` -> [world, *row.shape] in rank order on every rank (an all-reduce of rows each rank fills
    its own of: exact, and no all_gather)."""
    if shard.world == 1:
        return row.unsqueeze(0)
    import torch.distributed as dist

    # NCCL reduces only device tensors: put the rows where the process group works, and bring them back
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else row.device
    x = torch.zeros(shard.world, *row.shape, dtype=row.dtype, device=device)
    x[shard.rank] = row.to(device)
    dist.all_reduce(x)
    return x.to(row.device)


def gather_values(values: list[float], shard: Shard) -> list[float]:
    """One float per rank, in rank order, on every rank (peak RSS per rank)."""
    return gather_rows(torch.tensor(values[0], dtype=torch.float64), shard).tolist()


def gather_text(text: str, shard: Shard, size: int = 512) -> list[str]:
    """One short string per rank (at most `size` UTF-8 bytes), in rank order, on every rank."""
    data = list(text.encode()[:size])
    rows = gather_rows(torch.tensor([len(data)] + data + [0] * (size - len(data)), dtype=torch.int32), shard)
    return [bytes(row[1:1 + int(row[0])].tolist()).decode(errors="replace") for row in rows]


# ---------------------------------------------------------------------------------------------- processes

def broadcast_text(text: str | None, shard: Shard) -> str | None:
    """Rank 0's `text` (any length) on every rank; the others pass None."""
    if shard.world == 1:
        return text
    import torch.distributed as dist

    box = [text]
    # NCCL sends only device tensors: the pickled object goes through this rank's CUDA device
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def env_shard(env: Env) -> Shard | None:
    """The shard torchrun (or mhcrun's launcher) set in the environment (RANK, WORLD_SIZE), or None outside a
    launch."""
    if env.rank is None or env.world is None:
        return None
    return Shard(env.rank, env.world)


def init_workers(shard: Shard, device: str, local_rank: int | None = None) -> None:
    """Join the process group (gloo on cpu, nccl on cuda, TorchNeuron's `neuron` backend on neuron: wired, not run on
    a device here); a peer that never comes ends this rank in 60 s. No rank returns before every rank has joined."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = {"cpu": "gloo", "cuda": "nccl", "neuron": "neuron"}[device]
    if device == "cuda":
        torch.cuda.set_device(shard.rank if local_rank is None else local_rank)
    if device == "neuron":  # registers the neuron device and its process-group backend; imported on this path only
        import torch_neuronx  # noqa: F401
    dist.init_process_group(backend, rank=shard.rank, world_size=shard.world,
                            timeout=datetime.timedelta(seconds=60))
    if backend == "gloo":
        # every rank leaves the set-up together: a rank that fails at once after it (a tensor missing from its
        # share) would otherwise close its connections while a peer still makes them, and gloo then writes its
        # own line ("connectFullMesh failed") on that peer's stderr, rank 0's being the user's
        dist.barrier()


ECHO = 4  # the exit code of a rank whose collective lost a peer (`peer_lost`)


def peer_lost(e: BaseException, launched: bool) -> bool:
    """Whether e is this rank's echo of another rank's failure (its collective lost the peer), in a rank that mhcrun's
    launcher started (`launched`): the launcher then reports the rank that failed first."""
    if not launched:
        return False
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, getattr(dist, "DistBackendError", ())) or (
        isinstance(e, RuntimeError) and any(m in text for m in ("Connection closed by peer", "Connection reset by peer",
                                                                 "gloo", "Timed out")))


def follow_launcher(pid: int) -> None:
    """In a rank that mhcrun's launcher (process `pid`) started: end when the launcher ends, however it ends (killed
    too: Linux's PR_SET_PDEATHSIG; elsewhere the launcher's own `stop` is all there is), and at once where it has
    ended already."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != pid:  # it ended before the line above
        os._exit(128 + signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_error_line(path: Path) -> str | None:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return errors[-1] if errors else (lines[-1] if lines else None)


def launch(world: int, argv: list[str], environ: Mapping[str, str]) -> int:
    """Run `mhcrun argv` as `world` ranks on this machine and wait. Rank 0's stdout and stderr are this
    process's; the other ranks' stdout is dropped and their stderr kept in a file. When a rank fails, every
    other rank is ended at once (no hang, no orphan) and the failing rank's error line is shown (rank 0's own,
    or `error: rank K: ...`); the exit code is the failing rank's (128 + N where signal N ended it). SIGTERM or
    SIGHUP to this process (`Terminated`) ends the ranks too, and a rank ends when this process does however it
    ends (`follow_launcher`). The ranks get `environ` (the user's) and their place in the launch."""
    env = dict(environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               MHCRUN_TP_LAUNCHED="1", MHCRUN_TP_PARENT=str(os.getpid()))
    # the ranks share this machine's cores (torchrun sets 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    logs = Path(tempfile.mkdtemp(prefix="mhcrun-tp-"))
    procs: list[subprocess.Popen] = []
    cmd = [sys.executable, "-m", "mhcrun.cli", *argv]
    try:
        for rank in range(world):
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            if rank == 0:
                procs.append(subprocess.Popen(cmd, env=e))
            else:
                with open(logs / f"rank{rank}.err", "wb") as errf:
                    procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.DEVNULL, stderr=errf,
                                                  stdin=subprocess.DEVNULL))
        while True:
            codes = [p.poll() for p in procs]
            # a rank that lost its peer exits with ECHO: it is never the failure to report
            failed = sorted(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), key=lambda f: f[1] == ECHO)
            if failed:
                rank, code = failed[0]
                if rank != 0:  # the same bad input fails every rank: then rank 0's own line is the one to show
                    try:
                        first = procs[0].wait(1.0)
                    except subprocess.TimeoutExpired:
                        first = None
                    if first not in (None, 0, ECHO):
                        rank, code = 0, first
                stop(procs)
                if code < 0:  # ended by a signal (the OOM killer's SIGKILL): as a shell reports it
                    print(f"error: rank {rank}: killed by {signal.Signals(-code).name}", file=sys.stderr, flush=True)
                    return 128 - code
                if rank != 0 or code == ECHO:
                    line = last_error_line(logs / f"rank{rank}.err") if rank and code != ECHO else None
                    msg = line.removeprefix("error: ") if line else (
                        "a collective lost its peers" if code == ECHO else f"exited with code {code}")
                    print(f"error: rank {rank}: {msg}", file=sys.stderr, flush=True)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except (KeyboardInterrupt, Terminated) as e:  # Ctrl-C, a job's timeout, a closed terminal: the ranks end too
        stop(procs)
        line, code = signal_exit(e)
        print(line, file=sys.stderr, flush=True)
        return code
    finally:
        stop(procs)
        for f in logs.glob("*"):
            f.unlink()
        logs.rmdir()


def stop(procs: list[subprocess.Popen]) -> None:
    """End every rank still running: SIGTERM, then SIGKILL after 3 s."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.time() + 3
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
