"""Another package named ``supervisor`` in this install: supervisord's (``pip install supervisor``).

Both distributions put their files in one ``site-packages/supervisor/`` folder; installed after this
toolkit, supervisord's ``supervisor/options.py`` replaces ours and every command fails with an
ImportError about ``supervisor.options`` (installed before, ours replaces theirs, and supervisord
breaks). Uninstalling either removes files the other needs. So every entry point looks for
supervisord's own files beside this module first (one ``stat`` each) and says so in one line, with
the fix. (An editable install of this toolkit is shadowed whole by a regular ``supervisor`` folder
in site-packages: none of its code runs, and Python's "No module named 'supervisor.cli'" is all
there is to see; the fix is the same.)
"""

from __future__ import annotations

import os

# Files only supervisord's package has (this toolkit never will).
SUPERVISORD_FILES = ("supervisord.py", "supervisorctl.py")


def foreign_supervisor(package_dir: str = os.path.dirname(os.path.abspath(__file__))) -> str:
    """One line naming the clash and the fix when supervisord's files share ``package_dir`` (this
    package's folder), else ''."""
    found = next((n for n in SUPERVISORD_FILES if os.path.exists(os.path.join(package_dir, n))), None)
    if found is None:
        return ""
    return (
        f"another package named 'supervisor' is installed in the same place as this toolkit's: "
        f"{os.path.join(package_dir, found)} is supervisord's (`pip install supervisor`), and its files "
        "replace ours (supervisor/options.py); fix: `pip uninstall -y supervisor`, then reinstall this "
        "toolkit (`pip install --force-reinstall --no-deps resumable-training`, or `pip install -e .` in "
        "its checkout), and run supervisord from an environment of its own (`pipx install supervisor`)"
    )
