"""Loaded by a gateway that `bench/call_counts.py` starts (this directory is on its PYTHONPATH):
SIGUSR2 turns cProfile on in the event loop's thread, the next SIGUSR2 turns it off and writes the
profile to $CALL_PROFILE_OUT. Nothing else changes; a gateway started any other way never loads it."""

import cProfile
import os
import signal

_profile: cProfile.Profile | None = None


def _toggle(_signum: int, _frame: object) -> None:
    global _profile
    if _profile is None:
        _profile = cProfile.Profile()
        _profile.enable()
    else:
        _profile.disable()
        _profile.dump_stats(os.environ["CALL_PROFILE_OUT"])
        _profile = None


signal.signal(signal.SIGUSR2, _toggle)
