"""``chorus explain``: every algorithm, step by step.

The real schedules (chorus.schedules) run in rounds through chorus.sim's semantics with
symbolic contents (chorus.explain.walk); the shared-memory algorithms run as phases over
the window (chorus.explain.shm).  A walkthrough prints as text (chorus.explain.text) or
as a self-contained animated page (chorus.explain.html); a traced run replays as one
(chorus.explain.replay).

    from chorus.explain.cli import walkthrough
    from chorus.explain.text import render
    print(render(walkthrough("all_reduce", 4, "ring")))
"""
