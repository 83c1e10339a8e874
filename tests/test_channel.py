"""The in-process channel between threads outside lanes: messages keyed by (route, micro-batch), a
receiver parked until its sender wakes it, abort waking every parked receiver, and the poll that finds a
message nobody woke it for."""
import threading

import numpy as np
import pytest

from staticpipe.runtime import lanes
from staticpipe.runtime.channel import InProcessChannel
from staticpipe.runtime.errors import PipelineAborted

JOIN_S = 30  # a bound for a thread that must end; never reached unless the channel is broken


def parked_receiver(channel: InProcessChannel, key) -> tuple[threading.Thread, dict]:
    """A thread receiving ``key``, started and parked (its waiting lock registered) before this returns."""
    out: dict = {}

    def receive():
        try:
            out["message"] = channel.recv(key, 0)
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            out["error"] = exc
    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    while True:  # registered under the mailbox lock, which the test then takes to look
        with channel._lock:
            if key in channel._waiting:
                return thread, out


def test_a_message_sent_before_its_receive_is_taken_at_once_and_only_once():
    channel = InProcessChannel()
    message = {"x": np.arange(3)}
    channel.send((0, 1), message, 1)
    assert channel.recv((0, 1), 0) is message
    with pytest.raises(RuntimeError, match=r"message \(0, 2\) was sent twice"):
        channel.send((0, 2), {}, 1)
        channel.send((0, 2), {}, 1)


def test_a_parked_receiver_wakes_when_its_sender_calls_wake(monkeypatch):
    monkeypatch.setattr(lanes, "POLL_S", 3600.0)  # no poll: only a wake can end the wait
    channel = InProcessChannel()
    thread, out = parked_receiver(channel, (3, 0))
    message = {"y": np.ones(2)}
    channel.send((3, 0), message, 1)
    with channel._lock:  # the send left the message and the receiver's lock to this thread's wake
        assert (3, 0) in channel._box and (3, 0) not in channel._waiting
    assert thread.is_alive()
    channel.wake()
    thread.join(JOIN_S)
    assert not thread.is_alive() and out == {"message": message}


@pytest.mark.parametrize("then", ["recv", "allreduce", "flush"])
def test_the_senders_own_blocking_calls_wake_its_receivers_first(monkeypatch, then):
    """A sender that goes on to wait itself must not leave its receiver parked (both would wait)."""
    monkeypatch.setattr(lanes, "POLL_S", 3600.0)
    channel = InProcessChannel()
    thread, out = parked_receiver(channel, (5, 2))
    channel.send((5, 2), {"z": np.zeros(1)}, 1)
    if then == "recv":
        channel.send((6, 0), {}, 0)
        channel.recv((6, 0), 1)
    elif then == "allreduce":
        assert channel.allreduce(("opt", 0), 0, np.ones(1), 1) == 1
    else:
        channel.flush()
    thread.join(JOIN_S)
    assert not thread.is_alive() and set(out["message"]) == {"z"}


def test_abort_wakes_every_parked_receiver_with_the_reason(monkeypatch):
    monkeypatch.setattr(lanes, "POLL_S", 3600.0)
    channel = InProcessChannel()
    receivers = [parked_receiver(channel, (r, 0)) for r in range(3)]
    channel.abort("stage 2 failed")
    for thread, out in receivers:
        thread.join(JOIN_S)
        assert not thread.is_alive()
        assert isinstance(out["error"], PipelineAborted) and str(out["error"]) == "stage 2 failed"
    with pytest.raises(PipelineAborted, match="stage 2 failed"):
        channel.send((9, 9), {}, 0)
    channel.reset()
    channel.send((9, 9), {"ok": 1}, 0)
    assert channel.recv((9, 9), 0) == {"ok": 1}


def test_a_receiver_nobody_wakes_finds_its_message_at_its_next_poll(monkeypatch):
    monkeypatch.setattr(lanes, "POLL_S", 0.01)
    channel = InProcessChannel()
    thread, out = parked_receiver(channel, (1, 4))
    channel.send((1, 4), {"w": 1}, 1)  # and this thread never calls wake
    thread.join(JOIN_S)
    assert not thread.is_alive() and out == {"message": {"w": 1}}
