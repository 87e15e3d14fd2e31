"""chorus.shm.phases.Crew: helper threads that run parts of one rank's large copies at once."""

import threading
import time

import pytest

from chorus import config
from chorus.shm.phases import Crew
from chorus.shm.placement import MAX_THREADS, threads_for


def test_tasks_run_on_distinct_threads_and_run_returns_after_all_of_them():
    crew, seen, finished = Crew(3), [], []

    def task(i, pause):
        def run():
            seen.append((i, threading.get_ident()))
            time.sleep(pause)
            finished.append(i)
        return run

    crew.run([task(0, 0.0), task(1, 0.05), task(2, 0.02)])
    assert sorted(finished) == [0, 1, 2]
    assert len({ident for _, ident in seen}) == 3
    assert dict(seen)[0] == threading.get_ident()  # part 0 runs on the caller
    assert crew.handed == 2
    crew.run([task(3, 0.0), task(4, 0.0)])  # helpers are reused, fewer tasks are fine
    assert crew.handed == 3
    crew.close()


def test_a_helpers_error_is_raised_only_after_every_task_finished():
    crew, finished = Crew(2), []

    def slow():
        time.sleep(0.05)
        finished.append("caller")

    def boom():
        raise OSError("helper failed")

    with pytest.raises(OSError, match="helper failed"):
        crew.run([slow, boom])
    assert finished == ["caller"]
    crew.run([lambda: finished.append("again"), lambda: None])  # the crew still works
    assert finished[-1] == "again"
    crew.close()


def test_the_callers_error_wins_but_helpers_are_still_collected():
    crew, finished = Crew(2), []

    def helper():
        time.sleep(0.05)
        finished.append("helper")

    def caller():
        raise KeyError("caller failed")

    with pytest.raises(KeyError):
        crew.run([caller, helper])
    assert finished == ["helper"]  # run() did not return while the helper still worked
    crew.close()


def test_a_closed_crew_runs_every_task_on_the_caller():
    crew = Crew(3)
    crew.run([lambda: None] * 3)
    crew.close()
    where = []
    crew.run([lambda: where.append(threading.get_ident())] * 3)
    assert where == [threading.get_ident()] * 3


def test_more_tasks_than_threads_is_an_error():
    with pytest.raises(ValueError, match="3 tasks for a crew of 2 threads"):
        Crew(2).run([lambda: None] * 3)


def test_threads_per_rank(monkeypatch, caplog):
    with config.override(CHORUS_SHM_THREADS=None):
        assert threads_for(8, 16, False) == 2
        assert threads_for(2, 2, False) == 1  # 2 CPUs for 2 ranks: no helpers
        assert threads_for(1, 64, False) == MAX_THREADS
        assert threads_for(4, 16, True) == 1  # ranks that are threads share the GIL
    with config.override(CHORUS_SHM_THREADS=3):
        assert threads_for(8, 2, False) == 3
    for wrong in ("many", "0"):  # reported, not raised: one rank failing alone would hang the others
        monkeypatch.setenv("CHORUS_SHM_THREADS", wrong)
        with caplog.at_level("WARNING", logger="chorus"):
            assert threads_for(8, 16, False) == 2
        assert f"CHORUS_SHM_THREADS={wrong!r}" in caplog.text
