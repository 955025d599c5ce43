"""`extras/`: the trainer imports each extra only where the option that turns it on is set."""

import subprocess
import sys

from helpers import REPO

# After importing the trainer, then after building a trainer with each set of options: the extras newly loaded.
_LOADED = """
import os, sys, tempfile
sys.path.insert(0, os.path.join({repo!r}, "tests"))
from datasets import Dataset
from helpers import make_trainer
import trl_grpo_ext.trainer
from trl_grpo_ext.testing import save_tiny

seen = set()

def new_extras():
    loaded = {{name for name in sys.modules if name.startswith("trl_grpo_ext.extras.")}}
    new = sorted(name.removeprefix("trl_grpo_ext.extras.") for name in loaded - seen)
    seen.update(loaded)
    return new

print("extras:", new_extras())
folder = tempfile.mkdtemp()
model = save_tiny(os.path.join(folder, "model"))
data = Dataset.from_dict({{"prompt": ["abc=", "hello="] * 4}})
quiet = dict(console="raw", warn_on_anomalies=False)
make_trainer(folder, model, None, data, **quiet)
print("extras:", new_extras())
make_trainer(folder, model, None, data, **quiet, skip_zero_advantage_rows=True, beta=0.0)
print("extras:", new_extras())
make_trainer(folder, model, None, data, **quiet, dynamic_sampling=True)
print("extras:", new_extras())
make_trainer(folder, model, None, data, **quiet, selective_rollouts=True)
print("extras:", new_extras())
make_trainer(folder, model, None, data)  # the defaults: the console line and the alarms, sent to trackers
print("extras:", new_extras())
"""


def test_importing_the_trainer_loads_no_extra_and_each_option_loads_its_own():
    command = [sys.executable, "-c", _LOADED.format(repo=REPO)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [line.removeprefix("extras: ") for line in result.stdout.splitlines() if line.startswith("extras:")] == [
        "[]",
        "[]",
        "['skipping']",
        "['dynamic', 'generation', 'plan']",
        "['selective']",
        "['alerts', 'console']",
    ]
