"""``Profile``: what every forward op and layer of a program costs, as ``profile`` measured it, with
its tables and CSV/JSON forms."""
from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .._paddle import core, framework
from ..rewrite.stages import op_label
from .layers import Layer
from .table import format_table, human_bytes


@dataclass
class OpRow:
    """One forward op. Times are medians of ``repeat`` runs, in seconds; bytes at the profiled batch."""

    index: int  # in the program's global block
    type: str
    layer: int
    forward_s: float
    backward_s: float  # all gradient ops of this op together
    param_bytes: int  # parameters the op reads
    activation_bytes: int  # its non-persistable outputs
    saved_bytes: int  # the part of them that backward ops read: held from forward to backward
    flops: int  # forward, estimated; 0 where the op type has no estimate (see ``note``)
    note: str = ""


@dataclass
class LayerRow:
    """One layer (``layers.Layer``): sums over its ops; ``param_bytes`` counts each parameter once."""

    index: int
    name: str
    ops: tuple[int, ...]
    parameters: tuple[str, ...]
    forward_s: float
    backward_s: float
    param_bytes: int
    activation_bytes: int
    saved_bytes: int
    flops: int


@dataclass
class Profile:
    device: str
    batch_size: int
    repeat: int
    loss: str
    ops: list[OpRow]
    layers: list[LayerRow] = field(default_factory=list)
    param_bytes: dict[str, int] = field(default_factory=dict)  # parameter -> bytes
    var_bytes: dict[str, int] = field(default_factory=dict)  # forward activation -> bytes at the batch
    notes: list[str] = field(default_factory=list)

    @classmethod
    def measured(cls, place: Any, batch: dict, repeat: int, loss: str, rows: list[OpRow], param_bytes: dict[str, int],
                 var_bytes: dict[str, int], layers: list[Layer], unestimated: set[str]) -> "Profile":
        """The profile of ``rows`` measured on ``place`` at ``batch``'s size (on either IR), its ``layers``
        aggregated, and a note naming the op types without a FLOP estimate."""
        device = f"gpu:{place.get_device_id()}" if isinstance(place, core.CUDAPlace) else "cpu"
        result = cls(device, int(next(iter(batch.values())).shape[0]), repeat, loss, rows, param_bytes=param_bytes,
                     var_bytes=var_bytes)
        result.layers = result.aggregate(layers)
        if unestimated:
            result.notes.append(f"FLOPs are not estimated (counted as 0) for op types: {', '.join(sorted(unestimated))}")
        return result

    def op(self, index: int) -> OpRow:
        """The row of the op at ``index`` in the program; ``KeyError`` naming it if it has none."""
        for row in self.ops:
            if row.index == index:
                return row
        raise KeyError(f"op #{index} is not a profiled forward op")

    def aggregate(self, layers: Iterable[Layer]) -> list[LayerRow]:
        """Rows for any grouping of the profiled ops into layers (``auto_place`` groups with its cuts)."""
        by_index = {row.index: row for row in self.ops}
        rows = []
        for layer in layers:
            ops = [by_index[i] for i in layer.ops]
            rows.append(LayerRow(layer.index, layer.name, layer.ops, layer.parameters,
                                 sum(r.forward_s for r in ops), sum(r.backward_s for r in ops),
                                 sum(self.param_bytes[p] for p in layer.parameters),
                                 sum(r.activation_bytes for r in ops), sum(r.saved_bytes for r in ops),
                                 sum(r.flops for r in ops)))
        return rows

    def check(self, program: framework.Program, forward: Iterable[int]) -> None:
        """``ValueError`` unless this profile was taken on ``program`` (same forward ops, same types)."""
        block = program.global_block()
        by_index = {row.index: row for row in self.ops}
        for i in forward:
            row = by_index.get(i)
            if row is None or row.type != block.ops[i].type:
                raise ValueError(f"the profile does not match the program: {op_label(i, block.ops[i])} is "
                                 f"{'not profiled' if row is None else f'profiled as {row.type!r}'}; "
                                 "profile the program you place")

    def table(self, level: str = "layers") -> str:
        """The per-layer (``"layers"``) or per-op (``"ops"``) table with a total line."""
        rows = _rows(self, level)
        by_layer = level == "layers"

        def cells(r: OpRow | LayerRow) -> list:
            return [f"{r.forward_s * 1e3:.3f}", f"{r.backward_s * 1e3:.3f}", human_bytes(r.param_bytes),
                    human_bytes(r.activation_bytes), human_bytes(r.saved_bytes), f"{r.flops / 1e6:.2f}"]

        body = [[r.index, r.name, len(r.ops)] + cells(r) if by_layer else
                [r.index, r.type, r.layer] + cells(r) + [r.note] for r in rows]
        total = LayerRow(-1, "", (), (), sum(r.forward_s for r in rows), sum(r.backward_s for r in rows),
                         sum(self.param_bytes.values()), sum(r.activation_bytes for r in rows),
                         sum(r.saved_bytes for r in rows), sum(r.flops for r in rows))
        body.append(["total", "", len(self.ops) if by_layer else ""] + cells(total) + ([] if by_layer else [""]))
        headers = (["#", "layer", "ops"] if by_layer else ["#", "op", "layer"]) + [
            "fwd ms", "bwd ms", "params", "activations", "saved", "MFLOP"] + ([] if by_layer else ["note"])
        head = (f"Profile on {self.device}, batch {self.batch_size}, median of {self.repeat} runs, loss "
                f"{self.loss}: {len(self.ops)} forward ops in {len(self.layers)} layers")
        return "\n".join([head, format_table(headers, body)] + [f"note: {n}" for n in self.notes])

    def __str__(self) -> str:
        return self.table("layers")

    def to_csv(self, path: str, level: str = "ops") -> None:
        """One row per op (``level="ops"``) or per layer (``"layers"``), columns as the dataclass fields."""
        rows = [asdict(r) for r in _rows(self, level)]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def from_json(cls, path: str) -> "Profile":
        """The profile ``to_json`` wrote: measured once, planned with anywhere (every process of a launched
        job must plan from the same numbers). ``ValueError`` naming the file if it is not one."""
        try:
            with open(path) as f:
                data = json.load(f)
            return cls(data["device"], data["batch_size"], data["repeat"], data["loss"],
                       [OpRow(**row) for row in data["ops"]],
                       [LayerRow(**{**row, "ops": tuple(row["ops"]), "parameters": tuple(row["parameters"])})
                        for row in data["layers"]],
                       data["param_bytes"], data["var_bytes"], data["notes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path} is not a profile written by Profile.to_json ({type(exc).__name__}: {exc})") from exc


def _rows(profile: Profile, level: str) -> list:
    if level not in ("ops", "layers"):
        raise ValueError(f"level must be 'ops' or 'layers', got {level!r}")
    return profile.ops if level == "ops" else profile.layers
