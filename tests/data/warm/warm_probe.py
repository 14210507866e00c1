"""What a process forked by tunekit.trials.warm_start sees (tests/integration/test_warm_start.py).

python -m warm_probe OUT.json EXIT_CODE|kill|sleep|nest
"""

import atexit
import json
import os
import signal
import sys
import time

loaded_before = "torch._dynamo" in sys.modules
from tunekit.plugin_loading import search_path  # noqa: E402 (after the check above)

out, how = sys.argv[1], sys.argv[2]
facts = {
    "pid": os.getpid(),
    "sid": os.getsid(0),
    "cwd": os.getcwd(),
    "on_path": os.getcwd() in sys.path,
    "plugins_searched_here": os.getcwd() in search_path(),  # as a fresh `python -m`: never
    "env": os.environ.get("WARM_PROBE"),
    "argv": sys.argv,
    "name": __name__,
    "torch_loaded_before": loaded_before,
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "stdin": sys.stdin.readline().strip(),
}
atexit.register(lambda: open(out + ".atexit", "w").close())
with open(out, "w") as f:
    json.dump(facts, f)
print("to stdout")
print("to stderr", file=sys.stderr)
sys.stdout.flush()
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "sleep":
    time.sleep(600)
if how == "nest":  # a forked process forks one of its own through a warm server
    from tunekit.trials.warm_start import popen_python

    nested = [sys.executable, "-m", "warm_probe", out + ".nested", "5"]
    child = popen_python(nested, env=dict(os.environ), stdout=1, stderr=2, umask=0o022)
    sys.exit(child.wait(120))
sys.exit(int(how))
