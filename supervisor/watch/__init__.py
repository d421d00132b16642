"""The watchdog: its loop, restart policy, process control and hang diagnosis."""
