"""Start-up's record and console line (cluster/run/startup.py) from hand-made phases and actor marks (sync/startup.py),
without Ray: the seconds add up, each actor's parts come from its marks, and a log gets one line per change from Ray's
start on."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from cluster.run import startup as startup_module
from cluster.run.startup import Startup, state_of
from sync.startup import process_start_time


def startup_at(began: dict[str, float], marks: dict[str, dict], origin: float | None = 100.0) -> Startup:
    startup = Startup(origin, show=False)
    startup.began = dict(began)
    startup.marks = marks
    return startup


def test_the_first_records_phases_add_up_to_the_whole_and_each_actor_has_its_parts():
    # process start 100; checks 103, ray 104, registry 110, actors 111, probe 140, first step 141; record at 142.
    began = {"imports": 100.0, "checks": 103.0, "ray": 104.0, "registry": 110.0, "actors": 111.0, "probe": 140.0,
             "first_step": 141.0}
    marks = {"rollout worker 0": {"started": 112.0, "importing": 114.0, "loading": 120.0, "warming": 135.0,
                                  "ready": 137.0, "log": "/tmp/w0.err"},
             "learner": {"started": 111.5, "importing": 113.0, "loading": 125.0, "ready": 130.0},
             "reward model 'rm'": {"started": 110.0}}  # a process Ray had before the phase: no negative seconds
    got = startup_at(began, marks).metrics(142.0)
    assert {k: v for k, v in got.items() if k.count("/") == 2} == {
        "time/startup/imports": 3.0, "time/startup/checks": 1.0, "time/startup/ray": 6.0, "time/startup/registry": 1.0,
        "time/startup/actors": 29.0, "time/startup/probe": 1.0, "time/startup/first_step": 1.0,
        "time/startup/total": 42.0,
        "time/startup/engine": 17.0}  # rollout worker 0: loading 120 -> ready 137
    assert {k: v for k, v in got.items() if k.count("/") == 3} == {
        "time/startup/rollout_worker_0/process": 1.0, "time/startup/rollout_worker_0/boot": 2.0,
        "time/startup/rollout_worker_0/imports": 6.0, "time/startup/rollout_worker_0/load": 15.0,
        "time/startup/rollout_worker_0/warm_up": 2.0,
        "time/startup/learner/process": 0.5, "time/startup/learner/boot": 1.5, "time/startup/learner/imports": 12.0,
        "time/startup/learner/load": 5.0,  # no warm-up: loading -> ready
        "time/startup/reward_model_rm/process": 0.0}


def test_only_the_first_record_is_stamped_and_a_run_without_a_process_start_has_no_imports():
    startup = startup_at({"checks": 10.0, "ray": 11.0, "first_step": 12.0}, {}, origin=None)
    first = startup.stamp({"step": 1})
    assert "time/startup/imports" not in first and first["time/startup/checks"] == 1.0
    assert first["time/startup/total"] == pytest.approx(first["time/startup/checks"] + first["time/startup/ray"]
                                                        + first["time/startup/first_step"])
    assert startup.stamp({"step": 2}) == {"step": 2}


def test_a_log_gets_a_line_per_change_from_rays_start_and_nothing_when_quiet(monkeypatch):
    monkeypatch.setattr(startup_module, "POLL_S", 3600.0)  # the line is refreshed by hand here
    out = io.StringIO()
    startup = Startup(None, show=True, console=Console(file=out, force_terminal=False, width=300))
    startup.begin("checks")
    assert out.getvalue() == ""  # a config error found by the checks stays stderr's one line
    startup.begin("ray")
    startup.expected = ["learner", "rollout worker 0"]
    startup.marks = {"learner": {"started": 1.0, "importing": 2.0}}
    startup._refresh()
    startup._refresh()  # nothing changed: no new line
    startup.marks["learner"]["loading"] = 3.0
    startup._refresh()
    startup.close()
    lines = out.getvalue().splitlines()
    assert [line.split(": ", 2)[2] for line in lines] == [
        "ray", "ray  learner importing, rollout worker 0 starting",
        "ray  learner loading the model, rollout worker 0 starting"]
    quiet = io.StringIO()
    silent = Startup(None, show=False, console=Console(file=quiet))
    silent.begin("checks")
    silent.begin("ray")
    assert quiet.getvalue() == ""


def test_states_and_the_process_start():
    assert state_of({}) == "started" and state_of({"started": 1, "importing": 2, "loading": 3}) == "loading"
    import psutil

    assert process_start_time() == pytest.approx(psutil.Process(os.getpid()).create_time(), abs=0.05)


class Mailbox:
    """What `Startup` needs of a run's mailbox (`RunHandle.publish`): the published dicts, in order."""

    def __init__(self):
        self.published = []

    def publish(self, fleet):
        self.published.append(fleet)


def test_the_mailbox_gets_start_ups_state_on_each_change_with_quiet_too(monkeypatch):
    monkeypatch.setattr(startup_module, "POLL_S", 3600.0)  # published by hand here
    startup = Startup(None, show=False)  # --quiet: nothing printed, `relay status` still shows it
    mailbox = Mailbox()
    startup.begin("checks")
    startup.begin("registry")
    startup.attach(mailbox)
    startup.expected = ["learner", "rollout worker 0"]
    startup.marks = {"learner": {"started": 1.0, "importing": 2.0}}
    startup._publish()
    startup._publish()  # nothing changed (within the second): nothing sent
    startup.marks["learner"]["ready"] = 3.0
    startup._publish()
    startup.begin("first_step")  # the steps' status takes over: nothing more
    startup._publish()
    states = [m["startup"] for m in mailbox.published]
    assert [(s["phase"], s["actors"]) for s in states] == [
        ("registry", {}),
        ("registry", {"learner": "importing", "rollout worker 0": "starting"}),
        ("registry", {"learner": "ready", "rollout worker 0": "starting"})]
    assert all(0 <= s["seconds"] < 60 for s in states)
    assert startup._poller is None  # stopped at the first step
