"""Paddle's gloo process groups, each over a rendezvous store of its own (worker side: imports Paddle).

Why: Paddle 3.3.1 connects every gloo group twice, both over the store it is given
(paddle/fluid/distributed/collective/process_group_gloo.cc, ProcessGroupGloo::CreateProcessGroupGloo): the
GlooCommContext that runs the collectives under the keys `<group id>/<rank>`, then the ProcessGroupGloo's own
gloo context under the bare keys `<rank>`, the same for every group. Fleet's topology creates its groups one
after another over the job's one store (the world group in init_parallel_env, then, for data parallel, the
data and the check groups, each of all ranks), so a rank that reaches the next group first finds a peer's bare
key still holding the peer's address from the previous group, connects to that pair's listening socket, which
is closed by then or about to serve another pair, and fails: `connect [127.0.0.1]:<port>: Connection refused`,
or both sides wait as listeners until gloo's 30 s timeout (`TIMEOUT self_rank = 0 pair_rank = 1`). A slow rank
can also read a fast peer's key already rewritten for the next group. Ranks that run in step never meet the
stale key, which is why 4 workers pass and 8 on 2 cores fail now and then. A barrier between groups does not
close the window (the bare keys are read and written inside one C++ call), so each group after the world group
rendezvouses over a TCPStore of its own, where its bare keys are new.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from paddle.base import core
from paddle.distributed import collective

from core.process import free_port

STORE_ADDRESS_KEY = "distbench/gloo_group_store/{}"  # in the job's store: where group <id>'s own store is

_stores: list = []  # every group's store, held for the life of the process (its rank 0 serves it)


def store_timeout_s(collective_timeout: float) -> int:
    """The seconds a group store waits for its members and for a key: the run's collective timeout (whole
    seconds, at least 1), so a busy node waits as long as the run allows (Paddle's TCPStore default: 900)."""
    return max(1, math.ceil(collective_timeout))


def group_store(job_store, rank: int, size: int, group_id: int, timeout_s: int):
    """A TCPStore for one group, served by its rank 0 on a free port of this node's address (the launcher's
    PADDLE_CURRENT_ENDPOINT) and published in the job's store under a key of that group id only."""
    key = STORE_ADDRESS_KEY.format(group_id)
    if rank == 0:
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
        job_store.set(key, f"{host}:{free_port('')}")  # Paddle's store binds every interface
    job_store.wait(key)
    host, port = bytes(job_store.get(key)).decode().rsplit(":", 1)
    store = core.TCPStore(host, int(port), rank == 0, size, timeout_s)
    _stores.append(store)
    return store


def gloo_groups_with_own_stores(collective_timeout: float) -> None:
    """From here on, every gloo group paddle.distributed.new_group creates (Fleet's topology groups) meets
    over a store of its own with the run's timeout; other backends' groups (NCCL on a GPU: its keys carry the
    group id) and the world group (init_parallel_env, over the job's store) are created as Paddle does."""
    impl = collective._new_process_group_impl
    create: Callable = getattr(impl, "__wrapped__", impl)  # Paddle's own, if this ran before
    timeout_s = store_timeout_s(collective_timeout)

    def new_process_group(backend, store, rank, world_size, *args, group_id=0, **kwargs):
        """Paddle 3.3.1's _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options,
        group_id=0, nccl_comm_init_option=0, nccl_config=None): every argument but the gloo case's passes
        through as given."""
        if backend != "gloo":
            return create(backend, store, rank, world_size, *args, group_id=group_id, **kwargs)
        own = group_store(store, rank, world_size, group_id, timeout_s)
        return core.ProcessGroupGloo.create(own, rank, world_size, group_id)

    new_process_group.__wrapped__ = create  # type: ignore[attr-defined]
    collective._new_process_group_impl = new_process_group
