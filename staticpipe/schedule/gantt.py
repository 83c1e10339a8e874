"""``draw_gantt``: timelines as a PNG, one panel per timeline, one row per rank.

Putting a measured step above the simulator's prediction for the same action times shows at a glance
where the runtime waits that the schedule does not. matplotlib is imported only here, and only when a
chart is drawn, so the schedule package stays importable without it.
"""
from __future__ import annotations

from typing import Iterable, Union

from .actions import Action, Kind, parse_action
from .execution import Event
from .simulate import Simulation

COLORS = {Kind.F: "#4c72b0", Kind.B: "#dd8452", Kind.W: "#55a868", Kind.OPT: "#8c8c8c",
          Kind.SEND: "#c44e52", Kind.RECV: "#8172b3", Kind.FB: "#937860"}
THIN = (Kind.SEND, Kind.RECV)  # drawn as thin bars under the compute boxes
LABEL_MIN_WIDTH = 0.012  # of the panel's time span: narrower boxes get no micro-batch number

Timeline = Union[Simulation, Iterable[tuple[int, Union[Action, str], float, float]]]


def _events(timeline: Timeline) -> list[Event]:
    """(rank, action, start, end) with actions parsed and time shifted to start at 0."""
    raw = timeline.events if isinstance(timeline, Simulation) else list(timeline)
    events = [(r, a if isinstance(a, Action) else parse_action(a), s, e) for r, a, s, e in raw]
    t0 = min((s for _, _, s, _ in events), default=0.0)
    return [(r, a, s - t0, e - t0) for r, a, s, e in events]


def draw_gantt(timelines: dict[str, Timeline], path: str) -> None:
    """Write a PNG to ``path``: one panel per named timeline (a ``Simulation`` or raw events).

    Boxes are coloured by kind (F, B, W, OPT, a paired FB; SEND/RECV thin); a rank's later chunks are
    drawn lighter, and boxes wide enough carry their micro-batch number (an FB: its F's & its B's).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = {name: _events(t) for name, t in timelines.items()}
    ranks = sorted({r for events in panels.values() for r, *_ in events})
    fig = Figure(figsize=(12, 0.5 + (0.45 * len(ranks) + 0.8) * len(panels)))
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch, nothing left open
    axes = fig.subplots(len(panels), 1, squeeze=False)
    for ax, (name, events) in zip(axes[:, 0], panels.items()):
        span = max((e for *_, e in events), default=1.0) or 1.0
        chunk = _chunk_index(events)
        for r, a, s, e in events:
            thin = a.kind in THIN
            y, h = (r + 0.3, 0.12) if thin else (r - 0.35, 0.6)
            alpha = 1.0 - 0.45 * chunk.get((r, a.stage), 0) / max(1, max(chunk.values(), default=0))
            ax.broken_barh([(s, e - s)], (y, h), facecolors=COLORS[a.kind], alpha=alpha,
                           edgecolor="white", linewidth=0.5)
            if not thin and a.microbatch is not None and (e - s) / span >= LABEL_MIN_WIDTH:
                label = f"{a.microbatch}&{a.b_microbatch}" if a.kind is Kind.FB else str(a.microbatch)
                ax.text((s + e) / 2, r - 0.05, label, ha="center", va="center", fontsize=7, color="white")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_ylim(max(ranks, default=0) + 0.6, -0.6)
        ax.set_xlim(0, span)
        ax.set_xlabel("time")
    kinds = [k for k in COLORS if any(a.kind is k for ev in panels.values() for _, a, _, _ in ev)]
    fig.legend(handles=[Patch(color=COLORS[k], label=k.value) for k in kinds], loc="upper right",
               ncol=len(kinds), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)


def _chunk_index(events: list[Event]) -> dict[tuple[int, int], int]:
    """(rank, stage) -> the stage's position among its rank's stages (0 for the first chunk)."""
    stages: dict[int, set[int]] = {}
    for r, a, _, _ in events:
        stages.setdefault(r, set()).add(a.stage)
    return {(r, s): i for r, ss in stages.items() for i, s in enumerate(sorted(ss))}
