"""Real ``torch.distributed`` ranks for the TP tests: ``spawn_gloo(fn, world)`` runs ``fn(rank, world)`` in ``world``
fresh processes joined in one gloo process group on 127.0.0.1, every rank set up and torn down the same way."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from mooncake_master import free_ports


def _run(rank: int, fn, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world)
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
    # Every check passed and the group is down: leave without the interpreter's exit, where gloo's threads were seen
    # to abort a rank (SIGABRT, "terminate called without an active exception") on a loaded machine. A rank whose
    # ``fn`` raised never gets here: its error reaches the test through ``mp.spawn``.
    os._exit(0)


def spawn_gloo(fn, world: int) -> None:
    """Run ``fn(rank, world)`` (a module-level function: the ranks are spawned) on ``world`` gloo ranks; raises what
    a rank raised."""
    mp.spawn(_run, args=(fn, world, free_ports(1)[0]), nprocs=world, join=True)
