"""Persistable activations: a forward value the user marked ``persistable`` is still an activation.

Paddle accepts ``some_forward_output.persistable = True`` (it warns) and trains: on one device the value
simply outlives the run. In a pipeline a persistable value lives once per stage, so micro-batches in
flight would overwrite each other's copy before their backwards read it, and the stage would wait for a
startup value that never comes. The rewrite therefore sees such a value as what it is, an activation
(kept per micro-batch, sent across stages, fetched as the whole batch's value), while the user's program,
the single-device reference, keeps the flag.

A persistable value is an activation when the first op of the program that touches it writes it without
reading it, in the forward or backward pass: parameters, optimizer state (written by the optimizer),
batch norm's running statistics and loss scaling's state (read where they are updated, initialised by the
startup program) are not.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from .._paddle import OP_ROLE, ROLE_LRSCHED, ROLE_OPTIMIZE, framework


def persistable_activations(program: framework.Program) -> list[str]:
    """The persistable values of legacy ``program`` that are activations (see the module's docstring)."""
    block = program.global_block()
    params = {p.name for p in program.all_parameters()}
    seen: set[str] = set()
    found = []
    for op in block.ops:
        role = int(op.attr(OP_ROLE)) if op.has_attr(OP_ROLE) else 0
        reads = set(op.input_arg_names)
        for name in op.output_arg_names:
            var = block._find_var_recursive(name)
            if (name not in seen and name not in reads and name not in params and var is not None and var.persistable
                    and not role & (ROLE_OPTIMIZE | ROLE_LRSCHED)):
                found.append(name)
        seen.update(reads)
        seen.update(op.output_arg_names)
    return found


@contextlib.contextmanager
def as_activations(program: framework.Program) -> Iterator[list[str]]:
    """Build inside this block to see ``program``'s persistable activations as plain activations; their
    flag is restored on the way out, whatever happens (the user's program is left as it was)."""
    names = persistable_activations(program)
    block = program.global_block()
    for name in names:
        block._find_var_recursive(name).desc.set_persistable(False)
    try:
        yield names
    finally:
        for name in names:
            block._find_var_recursive(name).desc.set_persistable(True)
