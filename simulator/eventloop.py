"""The step simulator's SimPy environment, made cheaper per event without changing which events run or in what
order (tests/test_step_digest.py holds the simulated step bit for bit).

- `StepEnvironment.timeout` builds a `simpy.Timeout` without its constructor's call chain (the same attributes,
  the same (time, NORMAL, event id) queue entry);
- `StepEnvironment.start_soon` schedules a callback the way `env.process` schedules a process's start (an event at
  URGENT priority), for work run as callbacks rather than as a generator process;
- `StepEnvironment.drive` runs a generator of events as `env.process` would (the same start, resumptions and end
  event) without simpy.Process's per-resumption work (it does not send event values into the generator);
- `new_event` builds a simpy.Event without its constructor's call chain; `call_later` schedules a callback as a
  timeout would, its event a slotted `Scheduled` (for events that nothing else waits on), and `trigger_later`
  succeeds an event after a delay as a timeout triggering it would;
- `run_to_end` processes every event as repeated `env.step()` calls do, with SimPy 4's step inlined.

    env = StepEnvironment()
    env.timeout(1.5).callbacks.append(lambda _e: print(env.now))
    events = run_to_end(env)
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable

import simpy
from simpy.events import NORMAL, PENDING, URGENT, Event, Timeout

_new_timeout = Timeout.__new__
_new_event_object = Event.__new__
_push = heapq.heappush


class Scheduled:
    """A bare scheduled event for callbacks that nothing else waits on or inspects (the network's wake-ups and
    deliveries, a comm's start, a rank's compute): only what SimPy's step and run_to_end read (callbacks, _ok,
    _value), in slots, without a simpy.Event's instance dictionary."""

    __slots__ = ("callbacks", "_ok", "_value", "target")


_new_scheduled = Scheduled.__new__


def call_later(env: simpy.Environment, delay: float, callback: Callable, value=None) -> Scheduled:
    """Run callback(event) `delay` (>= 0) after now: the queue entry of env.timeout(delay, value) with `callback`
    appended to its callbacks, as a `Scheduled` event (whose _value is `value`)."""
    ev = _new_scheduled(Scheduled)
    ev.callbacks, ev._ok, ev._value = [callback], True, value
    _push(env._queue, (env._now + delay, NORMAL, next(env._eid), ev))
    return ev


def trigger_later(env: simpy.Environment, delay: float, event: Event, value=None) -> None:
    """Succeed `event` with `value` `delay` (>= 0) after now, with the two queue entries of
    env.timeout(delay, value).callbacks.append(event.trigger) (a Scheduled event, then `event` when it fires),
    without building the bound method or calling trigger and schedule."""
    ev = _new_scheduled(Scheduled)
    ev.callbacks, ev._ok, ev._value, ev.target = [_relay], True, value, event
    _push(env._queue, (env._now + delay, NORMAL, next(env._eid), ev))


def _relay(scheduled: Scheduled) -> None:
    """simpy.Event.trigger(scheduled) of scheduled.target: its state and value, then scheduled now."""
    event = scheduled.target
    env = event.env
    event._ok, event._value = scheduled._ok, scheduled._value
    _push(env._queue, (env._now, NORMAL, next(env._eid), event))


def new_event(env: simpy.Environment) -> Event:
    """simpy.Event(env) without its constructor's call (the same attributes: pending, no callbacks yet)."""
    ev = _new_event_object(Event)
    ev.env, ev.callbacks, ev._value = env, [], PENDING
    return ev


class StepEnvironment(simpy.Environment):
    """A simpy.Environment whose timeouts and URGENT starts cost fewer Python calls (see the module docstring)."""

    def timeout(self, delay: float, value=None) -> Timeout:
        if delay < 0:
            raise ValueError(f"Negative delay {delay}")
        ev = _new_timeout(Timeout)
        ev.env, ev.callbacks, ev._value, ev._delay, ev._ok = self, [], value, delay, True
        _push(self._queue, (self._now + delay, NORMAL, next(self._eid), ev))
        return ev

    def start_soon(self, callback: Callable) -> None:
        """Run callback(event) at the point where a process created now would start (SimPy's Initialize; the event
        a `Scheduled`)."""
        ev = _new_scheduled(Scheduled)
        ev.callbacks, ev._ok, ev._value = [callback], True, None
        _push(self._queue, (self._now, URGENT, next(self._eid), ev))

    def drive(self, generator) -> simpy.Event:
        """Run `generator` (it yields events, ignoring what the yield returns) as a process; the returned event is
        scheduled when it ends, as a process's own event is."""
        driven = Driven(self, generator)
        self.start_soon(driven.resume)
        return driven.end


class Driven:
    """A generator of events resumed as simpy.Process resumes one (at once past events already processed, else
    when the event it waits for is processed); `finish` schedules `end` (value None; subclasses add to it)."""

    __slots__ = ("env", "generator", "end")

    def __init__(self, env: simpy.Environment, generator=None):
        self.env, self.generator, self.end = env, generator, new_event(env)

    def resume(self, _event) -> None:
        for event in self.generator:
            if event.callbacks is not None:  # not processed yet: come back when it is
                event.callbacks.append(self.resume)
                return
        self.finish()

    def finish(self, value=None) -> None:
        end, env = self.end, self.env
        end._ok, end._value = True, value
        _push(env._queue, (env._now, NORMAL, next(env._eid), end))


def run_to_end(env: simpy.Environment) -> int:
    """Process every event of env, as repeated `env.step()` calls do (the same order and effects), and return how
    many: SimPy 4's step inlined, one Python call less per event; a failed event that nothing defused raises.
    Python's cyclic garbage collector is paused meanwhile (and resumed after, if it was on): the loop allocates
    events, callbacks and tuples by the tens of thousands, which would run it every few hundred allocations, for a
    few percent of the loop's time; what became garbage is collected when it is back on."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _process(env)
    finally:
        if collecting:
            gc.enable()


def _process(env: simpy.Environment) -> int:
    queue, pop = env._queue, heapq.heappop
    events = 0
    while queue:
        env._now, _, _, event = pop(queue)
        callbacks, event.callbacks = event.callbacks, None
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc
        events += 1
    return events
