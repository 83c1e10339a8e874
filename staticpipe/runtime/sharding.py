"""ZeRO stage 1 at run time: each shard's new parameters to its whole group, and no other shard's
optimizer state in this process (``rewrite/sharding.py`` says how the plan divides the updates).

After a step's updates each member of a sharding group holds the new values of its own shard's
parameters only; the others are last step's. ``gather_parameters`` broadcasts each member's new values
to the group, in member order, before any rank's next forward can read them: packed per dtype into one
array (every member knows the names, shapes and dtypes of every shard's parameters from the plan and
its own scope, so only the bytes travel), one broadcast per member and dtype instead of one per
parameter.

The other shards' optimizer state is erased after the startup program and its broadcasts
(``startup_sync.py``): the startup program makes the whole model's state on every rank (the moments are
zeros, but master weights are copies of the parameters, which the startup broadcast makes equal first),
so a rank holds the whole optimizer state only while it initialises.
"""
from __future__ import annotations

from .._paddle import core, np
from ..ir import np_dtype
from ..plan import Plan
from .channel import Channel


def gather_parameters(scope: core._Scope, place: core.Place, channel: Channel, plan: Plan,
                      stages: tuple[int, ...]) -> None:
    """Give ``scope`` (the device's, holding ``stages``) every shard's new parameters; every member of
    the sharding group calls it after the same stages' updates."""
    if channel.sharding == 1:
        return
    owner = {p: j for s in stages for p, j in plan.stages[s].param_shards.items()}
    tensors = {p: scope.find_var(p).get_tensor() for p in sorted(owner)}
    mine = {p: np.array(t) for p, t in tensors.items() if owner[p] == channel.shard}
    got = channel.shard_exchange({f"shard{channel.shard}:{dtype}": flat for dtype, flat in _packed(mine).items()})
    for key, flat in got.items():
        shard, dtype = key[len("shard"):].split(":", 1)
        if int(shard) == channel.shard:
            continue
        offset = 0  # the sender packed its parameters of this dtype in name order (``_packed``)
        for p in (p for p in tensors if owner[p] == int(shard) and np_dtype(tensors[p]._dtype()) == dtype):
            shape = tuple(tensors[p].shape())
            size = int(np.prod(shape, dtype=np.int64))
            tensors[p].set(flat[offset:offset + size].reshape(shape), place)
            offset += size


def _packed(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``values`` (in name order) flattened into one array per dtype."""
    out: dict[str, list[np.ndarray]] = {}
    for name in sorted(values):
        out.setdefault(str(values[name].dtype), []).append(values[name].ravel())
    return {dtype: np.concatenate(parts) for dtype, parts in out.items()}

