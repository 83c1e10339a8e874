"""``staticpipe.auto_plan`` (``partition/planner.py``): partition x schedule x per-stage recompute under caps.

One profile of a small unguarded MLP serves every test, so the choices are deterministic. What is checked:
the choice is the fastest predicted plan that fits; the plan applied to the program is the one chosen and
its own memory model says what the planner priced; a recompute subset priced from the two built plans
equals the plan built with exactly that subset; the report and the errors say what they must.
"""
from __future__ import annotations

import pytest

import staticpipe
from models import build_mlp
from staticpipe._paddle import paddle
from staticpipe.memory_model import human_bytes
from staticpipe.partition import recompute_subsets
from pipeline_util import assert_same_training, train_twins

DEVICES = ["gpu:0", "gpu:1"]
M = 8
pytestmark = pytest.mark.timeout(300)


def net():
    return build_mlp(num_stages=2, guarded=False, in_dim=32, hidden=64, depth=6)


def adam():
    return paddle.optimizer.Adam(1e-3)


def momentum():
    return paddle.optimizer.Momentum(0.05, momentum=0.9)


@pytest.fixture(scope="module")
def profile():
    n = net()
    return staticpipe.profile(n.main, n.random_batch(16), startup=n.startup, loss=n.loss)


def plan(profile, **kw):
    n = net()
    report = staticpipe.auto_plan(n.main, n.loss, adam, DEVICES, M, profile=profile, startup=n.startup, **kw)
    return n, report


def on(candidate, device):
    """The bytes a candidate plan holds on one device (the candidates of a measured profile differ by machine)."""
    return next(d.total for d in candidate.memory if d.device == device)


def test_unlimited_chooses_the_fastest_and_applies_it(profile):
    n, report = plan(profile)
    assert report.chosen.step_s == min(c.step_s for c in report.candidates)
    assert report.chosen.recompute == ()  # recompute only costs time when memory is free
    applied = staticpipe.plan_of(n.main)
    assert applied.schedule == report.chosen.schedule
    assert tuple(s.device for s in applied.stages) == report.chosen.devices
    assert tuple(applied.memory.devices(16)) == report.chosen.memory
    assert {c.schedule for c in report.candidates} == set(staticpipe.schedule.registry.KINDS) - set(report.skipped)


def test_a_cap_excludes_the_plans_over_it_and_picks_the_fastest_that_fits(profile):
    _, free = plan(profile)
    fastest = free.chosen
    cap = max(d.total for d in fastest.memory) - 1  # the unlimited choice no longer fits
    n, report = plan(profile, memory_limit=cap)
    fitting = [c for c in report.candidates if c.fits]
    assert fitting and report.chosen == min(fitting, key=lambda c: c.step_s)
    assert all(d.total <= cap for d in report.chosen.memory)
    for c in report.candidates:
        assert c.over == {d.device: d.total - cap for d in c.memory if d.total > cap}
    loser = next(c for c in report.candidates if not c.fits)
    assert report.why_not(loser) == "over the cap: " + ", ".join(
        f"{d} by {human_bytes(b)}" for d, b in loser.over.items())
    assert staticpipe.plan_of(n.main).schedule == report.chosen.schedule


def test_below_every_plan_without_recompute_it_recomputes(profile):
    _, free = plan(profile, schedules=["1F1B"])
    cap = {"gpu:0": min(on(c, "gpu:0") for c in free.candidates if not c.recompute) - 1,  # stage 0 must recompute
           "gpu:1": max(on(c, "gpu:1") for c in free.candidates)}
    n, report = plan(profile, schedules=["1F1B"], memory_limit=cap)
    assert 0 in report.chosen.recompute and report.chosen.fits
    assert staticpipe.plan_of(n.main).stages[0].recompute


def test_beyond_six_stages_the_subsets_priced_still_give_the_choice_every_subset_gives(profile, monkeypatch):
    """With the exhaustive limit at 0, this 2-stage job is priced as a 16-stage one would be: no stage, the
    fewest that fit, every stage; the choice under a cap that forces stage 0 to recompute is unchanged."""
    _, free = plan(profile, schedules=["1F1B", "F-then-B"])
    plain = [c for c in free.candidates if not c.recompute]
    # every plan without recompute misses on gpu:0 (whatever partitions the measured profile gives); gpu:1 is free
    cap = {"gpu:0": min(on(c, "gpu:0") for c in plain) - 1, "gpu:1": max(on(c, "gpu:1") for c in free.candidates)}
    _, every = plan(profile, schedules=["1F1B", "F-then-B"], memory_limit=cap)
    monkeypatch.setattr(recompute_subsets, "EXHAUSTIVE_UP_TO", 0)
    _, picked = plan(profile, schedules=["1F1B", "F-then-B"], memory_limit=cap)
    assert picked.chosen == every.chosen and picked.chosen.recompute == (0,)
    assert all(c in every.candidates for c in picked.candidates) and len(picked.candidates) < len(every.candidates)
    assert sorted(c.recompute for c in picked.candidates if (c.schedule, c.policy) == ("1F1B", "time")) == [
        (), (0,), (0, 1)]


def test_a_recompute_subset_is_priced_as_the_plan_built_with_it(profile):
    """The planner builds two plans per partition (no stage / every stage recomputed) and prices each subset
    from them; building the plan with exactly that subset must give the same figures."""
    _, report = plan(profile, schedules=["1F1B"])
    priced = next(c for c in report.candidates if c.recompute == (1,))
    n = net()
    staticpipe.auto_place(n.main, devices=list(priced.devices), policy="time", profile=profile)
    with paddle.static.program_guard(n.main, n.startup):
        opt = staticpipe.PipelineOptimizer(adam(), num_microbatches=M, recompute=[1], micro_batch_size=16)
        opt.minimize(n.loss)
    assert tuple(opt.plan.memory.devices(16)) == priced.memory


def test_no_plan_fits_says_by_how_much_per_device(profile):
    with pytest.raises(ValueError) as err:
        plan(profile, schedules=["1F1B", "F-then-B"], memory_limit=1000)
    _, free = plan(profile, schedules=["1F1B", "F-then-B"])
    closest = min(free.candidates, key=lambda c: sum(d.total for d in c.memory))
    misses = ", ".join(f"{d.device} by {d.total - 1000} bytes ({human_bytes(d.total - 1000)})" for d in closest.memory)
    assert str(err.value) == (f"auto_plan: no plan fits the memory caps; the closest ({closest.schedule}, time cut, "
                              f"recompute 0, 1) misses {misses}")


def test_the_report_names_the_choice_and_the_runners_up(profile):
    _, report = plan(profile, schedules=["1F1B", "ZB-H1", "V-Min"])
    text = str(report).splitlines()
    assert text[0] == (f"auto_plan: micro-batch 16, caps gpu:0 unlimited, gpu:1 unlimited; "
                       f"{len(report.candidates)} plans priced; times from the op profile alone (no plan timed)")
    assert text[1] == f"  chosen: {report.chosen.describe()}"
    others = {c.schedule for c in report.candidates} - {report.chosen.schedule}
    assert len([line for line in text[3:] if "slower" in line or "as fast" in line]) == len(others)


def test_whole_recompute_prices_none_or_every_stage(profile):
    _, every = plan(profile, schedules=["1F1B"])
    _, whole = plan(profile, schedules=["1F1B"], recompute="whole")
    _, none = plan(profile, schedules=["1F1B"], recompute=False)
    assert sorted(c.recompute for c in every.candidates) == [(), (0,), (0, 1), (1,)]
    assert sorted(c.recompute for c in whole.candidates) == [(), (0, 1)]
    assert [c.recompute for c in none.candidates] == [()]


@pytest.mark.parametrize("kw, message", [
    (dict(recompute="some"), "recompute must be True (every subset of stages), \"whole\" (none or all) or False; "
                             "got 'some'"),
    (dict(memory_limit=[1, 2, 3]), "memory_limit has 3 entries for the 2 devices ['gpu:0', 'gpu:1']"),
    (dict(memory_limit={"gpu:7": 1}), "memory_limit names ['gpu:7'], which are not among the devices ['gpu:0', 'gpu:1']"),
    (dict(schedules=["2F2B"]), "unknown schedule '2F2B'; known schedules: " + ", ".join(
        staticpipe.schedule.registry.KINDS)),
    (dict(time_steps=-1), "time_steps must be an integer >= 0, got -1"),
    (dict(comm=-0.5), "comm must be seconds >= 0, a mapping {(source rank, destination rank): seconds} or a function "
                      "of the two ranks, got -0.5"),
    (dict(memory_limit=float("nan")), "memory_limit=nan: a memory cap must be a positive, finite number of bytes "
                                      "(None for no cap)"),
    (dict(memory_limit=[float("nan"), 1e9]), "memory_limit[0]=nan: a memory cap must be a positive, finite number "
                                             "of bytes (None for no cap)"),
    (dict(memory_limit="8 gigs"), "memory_limit='8 gigs' is not a size: give bytes (a number) or a size such as "
                                  "'8GB' or '512MiB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"),
    (dict(memory_limit={"gpu:0": True}), "memory_limit['gpu:0'] must be bytes (a number) or a size such as '8GB', "
                                         "got bool: True"),
    (dict(memory_limit=object), "memory_limit must be bytes, a size such as '8GB', one per device or {device: bytes}; "
                                "got type: <class 'object'>"),
])
def test_bad_arguments_are_named(profile, kw, message):
    with pytest.raises(ValueError) as err:
        plan(profile, **kw)
    assert str(err.value) == message


def test_a_message_latency_prices_every_plan_and_the_zero_bubble_orders_plan_with_it(profile):
    """A latency far above the step: every plan waits for a micro-batch to go down and back (2 x comm at
    least); the ZB-H1 plan applied is the one planned with the latency (``make_schedule(..., comm=)``)."""
    _, free = plan(profile, schedules=["1F1B", "ZB-H1"])
    comm = 100 * max(c.step_s for c in free.candidates)
    n, slow = plan(profile, schedules=["1F1B", "ZB-H1"], comm=comm)
    assert all(c.step_s >= 2 * comm for c in slow.candidates) and all(c.step_s < comm for c in free.candidates)
    n, zb = plan(profile, schedules=["ZB-H1"], comm={(0, 1): comm, (1, 0): comm})
    applied = staticpipe.plan_of(n.main)
    expected = staticpipe.schedule.make_schedule("ZB-H1", 2, M, comm=comm)
    assert {r: [a for a in acts if a.kind.name in ("F", "B", "W")] for r, acts in applied.actions.items()} == {
        r: [a for a in acts if a.kind.name in ("F", "B", "W")] for r, acts in expected.items()}


def test_a_size_string_is_a_cap_in_bytes(profile):
    """"8GB" is 8e9 bytes per device (it was read as a list of three caps), as the number is."""
    _, by_text = plan(profile, schedules=["1F1B"], memory_limit="2MiB")
    _, by_number = plan(profile, schedules=["1F1B"], memory_limit=2 * 2 ** 20)
    assert by_text.memory_limit == by_number.memory_limit == {"gpu:0": 2 ** 21, "gpu:1": 2 ** 21}
    assert [c.fits for c in by_text.candidates] == [c.fits for c in by_number.candidates]


def test_it_needs_times():
    n = net()
    with pytest.raises(ValueError) as err:
        staticpipe.auto_plan(n.main, n.loss, adam, DEVICES, M)
    assert str(err.value) == "auto_plan needs measured times: pass feed= (one micro-batch, or a loader) or profile="


def test_given_a_micro_batch_it_times_every_built_plan_without_touching_the_callers_state(profile):
    n = net()
    report = staticpipe.auto_plan(n.main, n.loss, adam, DEVICES, M, feed=n.random_batch(16), profile=profile,
                                  startup=n.startup, schedules=["1F1B", "ZB-H1"], recompute="whole", time_steps=1)
    assert report.timed_plans == 3  # 1F1B with no stage and every stage recomputed; ZB-H1 (split backward): none
    assert 0 < report.efficiency <= 2
    assert str(report).splitlines()[0].endswith(
        f"plans priced; times from 3 timed plans, simulated / measured step {report.efficiency:.2f}")
    assert report.chosen.step_s == min(c.step_s for c in report.candidates)
    assert staticpipe.plan_of(n.main).schedule == report.chosen.schedule
    scope = paddle.static.global_scope()
    assert all(scope.find_var(p.name) is None for p in n.main.all_parameters())


def test_a_feed_of_another_size_than_the_profile_is_refused(profile):
    n = net()
    batch = n.random_batch(8)
    with pytest.raises(ValueError) as err:
        staticpipe.auto_plan(n.main, n.loss, adam, DEVICES, M, feed=batch, profile=profile, startup=n.startup)
    assert str(err.value) == (f"feed has batches of {dict.fromkeys(batch, 8)}, but the profile was taken at "
                              "micro-batch 16: give one micro-batch of the size the profile was taken at")


def test_time_steps_zero_prices_from_the_profile_even_with_a_feed(profile):
    n = net()
    report = staticpipe.auto_plan(n.main, n.loss, adam, DEVICES, M, feed=n.random_batch(16), profile=profile,
                                  startup=n.startup, schedules=["1F1B"], time_steps=0)
    _, untimed = plan(profile, schedules=["1F1B"])
    assert report.efficiency is None and report.timed_plans == 0
    assert [c.step_s for c in report.candidates] == [c.step_s for c in untimed.candidates]


def test_in_a_launched_job_it_plans_only_from_a_profile_given(profile, monkeypatch, tmp_path):
    """Every process of a launched job must choose the same plan: its own measurements could differ."""
    _, alone = plan(profile, schedules=["1F1B", "V-Min"])
    profile.to_json(tmp_path / "profile.json")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    n = net()
    expected = ("{} in a launched job: every process would measure its own times and could choose another plan than "
                "the others; take the profile once (staticpipe.profile(...).to_json(path)) and pass "
                "profile=staticpipe.partition.Profile.from_json(path) on every rank, with no feed")
    with pytest.raises(ValueError) as err:
        staticpipe.auto_plan(n.main, n.loss, adam, DEVICES, M, feed=n.random_batch(16), profile=profile)
    assert str(err.value) == expected.format("auto_plan(feed=...)")
    with pytest.raises(ValueError) as err:
        staticpipe.auto_plan(n.main, n.loss, adam, DEVICES, M, feed=n.random_batch(16))
    assert str(err.value) == expected.format("auto_plan without profile=")
    with pytest.raises(ValueError) as err:
        staticpipe.auto_place(n.main, devices=DEVICES, policy="time", feed=n.random_batch(16))
    assert str(err.value) == expected.format("auto_place(policy='time', feed=...)")
    loaded = staticpipe.partition.Profile.from_json(tmp_path / "profile.json")
    _, launched = plan(loaded, schedules=["1F1B", "V-Min"])
    assert launched.chosen == alone.chosen


def test_a_plan_it_measured_and_chose_trains_as_one_device(program_ir):
    """On either IR, auto_plan profiles the program and times the plans it builds on one micro-batch
    (``feed=``), applies the fastest, and that pipeline trains as one device does."""
    reports = []

    def builder(guarded: bool = True):
        n = net()
        if guarded:
            reports.append(staticpipe.auto_plan(n.main, n.loss, momentum, DEVICES, 4, feed=n.random_batch(4),
                                                startup=n.startup, schedules=["1F1B", "ZB-H1"], recompute="whole",
                                                time_steps=1))
        return n

    twin = train_twins(builder, momentum, steps=2, batch_size=16)
    assert_same_training(twin, rtol=1e-5)
    report = reports[0]
    assert report.timed_plans == 3 and report.chosen.step_s == min(c.step_s for c in report.candidates)
    assert twin.plan.schedule == report.chosen.schedule
    assert tuple(s.device for s in twin.plan.stages) == report.chosen.devices

