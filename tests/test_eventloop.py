"""simulator.eventloop runs the same events in the same order as plain SimPy: generators driven by
StepEnvironment.drive against the same generators as simpy processes, on a schedule full of ties (equal times, zero
delays, events triggered by others, events already processed when yielded)."""

from __future__ import annotations

import pytest
import simpy

from rackcast.simulator.eventloop import StepEnvironment, call_later, new_event, run_to_end, trigger_later

DELAYS = (0.0, 0.5, 0.25, 0.0, 0.25, 1.0, 0.5)


def _scenario(env, spawn) -> list:
    """Five workers yielding timeouts (many ending at the same instant), a shared event one of them triggers, and
    a worker started by another; returns the trace (time, worker, step) filled in as the run goes."""
    trace, gate = [], env.event()

    def worker(name: int):
        for step, d in enumerate(DELAYS[name:] + DELAYS[:name]):
            trace.append((env.now, name, step))
            if step == 2 and name == 0:
                gate.succeed()
                spawn(child(name))
            if step == 3:
                yield gate  # already triggered (or processed) for some workers, pending for others
            yield env.timeout(d)
        trace.append((env.now, name, "end"))

    def child(parent: int):
        trace.append((env.now, "child of", parent))
        yield env.timeout(0.0)
        trace.append((env.now, "child", "end"))

    for name in range(5):
        spawn(worker(name))
    return trace


def test_driven_generators_run_their_steps_in_simpy_process_order_with_the_same_event_count():
    plain = simpy.Environment()
    plain_trace = _scenario(plain, plain.process)
    plain_events = run_to_end(plain)
    lean = StepEnvironment()
    lean_trace = _scenario(lean, lean.drive)
    lean_events = run_to_end(lean)
    assert lean_trace == plain_trace
    assert lean_events == plain_events


def test_step_environment_timeouts_fire_at_their_time_with_their_value():
    env = StepEnvironment()
    seen = []
    env.timeout(2.0, "b").callbacks.append(lambda e: seen.append((env.now, e.value)))
    env.timeout(1.0, "a").callbacks.append(lambda e: seen.append((env.now, e.value)))
    assert run_to_end(env) == 2
    assert seen == [(1.0, "a"), (2.0, "b")]


def test_new_event_is_a_pending_simpy_event_that_runs_its_callbacks_when_it_succeeds():
    env = StepEnvironment()
    ev, plain = new_event(env), simpy.Event(env)
    assert type(ev) is type(plain) and not ev.triggered and ev.callbacks == [] and ev.env is env
    seen = []
    ev.callbacks.append(lambda e: seen.append((env.now, e.value)))
    env.timeout(1.5).callbacks.append(lambda _e: ev.succeed("done"))
    assert run_to_end(env) == 2
    assert seen == [(1.5, "done")] and ev.processed


def test_call_later_runs_its_callbacks_in_the_order_of_the_same_timeouts_with_their_values():
    def schedule(env, later: bool) -> list:
        seen = []
        for i, d in enumerate((0.5, 0.0, 0.5, 0.25, 0.0, 0.5)):
            cb = (lambda e, i=i: seen.append((env.now, i, e._value)))
            if later and i % 2:
                call_later(env, d, cb, f"v{i}")
            else:
                env.timeout(d, f"v{i}").callbacks.append(cb)
        return seen

    for make in (simpy.Environment, StepEnvironment):
        env_a, env_b = make(), make()
        a, b = schedule(env_a, False), schedule(env_b, True)
        assert run_to_end(env_a) == run_to_end(env_b) == 6
        assert b == a and [i for _, i, _ in a] == [1, 4, 3, 0, 2, 5]


def test_run_to_end_pauses_the_garbage_collector_and_restores_its_state_even_when_an_event_fails():
    import gc

    seen = []
    for was_on in (True, False):
        (gc.enable if was_on else gc.disable)()
        try:
            env = StepEnvironment()
            env.timeout(1.0).callbacks.append(lambda _e: seen.append(gc.isenabled()))
            assert run_to_end(env) == 1
            assert gc.isenabled() == was_on
            env.event().fail(RuntimeError("boom"))
            with pytest.raises(RuntimeError, match="boom"):
                run_to_end(env)
            assert gc.isenabled() == was_on
        finally:
            gc.enable()
    assert seen == [False, False]


def test_trigger_later_succeeds_its_event_in_the_order_and_with_the_value_of_a_timeout_triggering_it():
    def schedule(env, later: bool) -> list:
        seen = []
        for i, d in enumerate((0.5, 0.0, 0.5, 0.25, 0.0)):
            target = env.event()
            target.callbacks.append(lambda e, i=i: seen.append((env.now, i, e.value, e.ok)))
            if later and i % 2:
                trigger_later(env, d, target, f"v{i}")
            else:
                env.timeout(d, f"v{i}").callbacks.append(target.trigger)
            env.timeout(d).callbacks.append(lambda _e, i=i: seen.append((env.now, "tie", i)))  # ties in between
        return seen

    for make in (simpy.Environment, StepEnvironment):
        env_a, env_b = make(), make()
        a, b = schedule(env_a, False), schedule(env_b, True)
        assert run_to_end(env_a) == run_to_end(env_b) == 15
        assert b == a and (0.0, 1, "v1", True) in a
