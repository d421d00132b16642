"""The fault drill: run the reference trainer uninterrupted (golden), then under the watchdog while
injecting faults, then judge whether the faulted run is the same run.

plan.py (pure: which faults, when), inject.py (side effects: signals, corruption), runner.py
(processes), judge.py (pure: the verdict), report.py (Markdown + PNG), and drill_cmd.py for the CLI.
"""
