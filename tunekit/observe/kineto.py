"""Start torch.profiler once in the main thread.

Kineto complains on stderr when its first use is in another thread, and tuners
profile from worker threads. The first start also imports much of torch
(about 2 s on a small CPU), so commands do it only once their input is known
to be good.
"""

from __future__ import annotations

import threading

_started = False


def start_profiler_in_main_thread() -> None:
    global _started
    if _started or threading.current_thread() is not threading.main_thread():
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        pass
    _started = True
