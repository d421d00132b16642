"""The fault drill: run the reference trainer uninterrupted (golden), then under the watchdog while
injecting faults, then judge whether the faulted run is the same run.

    plan.py        pure: which faults a scenario injects, and when (from a seed)
    drivers.py     one small object per kind of fault, waiting for its moment
    inject.py      the faults themselves: signals, damage to a checkpoint
    corruption.py  the ways a checkpoint gets damaged (shared with the tests)
    switch.py      the switch into the trainer for hangs a rank inflicts on itself
    runner.py      processes: the golden torchrun, the watchdog, injection while it runs
    judge.py       pure: the verdict over the runs' records
    diverge.py     pure: where a resumed run's checkpoints left golden's, and the likely cause
    report.py      the verdict table and the Markdown + PNG report
    storage.py     storage faults: the run dir on the fault filesystem
    faultfs.py     the fault-injecting FUSE passthrough; faultrules.py its rules (pure);
                   faultctl.py mounts and steers it; mounts.py mount helpers, a size-limited tmpfs

The command is supervisor/cli/drill.py.
"""
