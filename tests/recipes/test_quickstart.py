"""The quickstart recipe end to end, as a user runs it: it trains, and the loss falls."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_learns_the_counting_pattern():
    # The recipe's CPU path is the op's PyTorch reference; under TRITON_INTERPRET=1 the same
    # run takes minutes (the kernels' own tests cover the interpreter).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(ROOT / "recipes" / "quickstart.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    losses = [float(loss) for loss in re.findall(r"^step +\d+ +loss (\S+)$", run.stdout, re.MULTILINE)]
    final = float(re.search(r"^final loss (\S+)$", run.stdout, re.MULTILINE).group(1))
    assert len(losses) == 7, run.stdout
    assert losses[0] > 4.0 and final < 0.2, run.stdout
