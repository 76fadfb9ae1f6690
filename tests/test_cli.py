"""run.py's command line around the run itself: signals between a sweep's jobs, the folders
a sweep's jobs take, and the messages for what Hydra or OmegaConf refuse."""
import subprocess
import sys

from tests.test_trainer import command, from_a_terminal


def test_sigterm_between_a_sweeps_jobs_is_one_line(tmp_path):
    """A scheduler preempting a sweep: SIGTERM while Hydra writes the next job's .hydra/
    ended in a traceback and exit 1, where a job's own run says "terminated", exit 143."""
    term_between_jobs = f"""
import runpy, signal, sys
from hydra.core import utils
save = utils._save_config
def term_at_the_second_job(cfg, filename, output_dir):
    if output_dir.parent.name == "1":
        signal.raise_signal(signal.SIGTERM)
    save(cfg, filename, output_dir)
utils._save_config = term_at_the_second_job
sys.argv = {command(tmp_path / "sweep", "mode=plan", "trainer.seed=1,2,3", multirun=True)[1:]!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    out = subprocess.run([sys.executable, "-c", term_between_jobs], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120, preexec_fn=from_a_terminal)
    assert (out.returncode, out.stderr.splitlines()[-1:]) == (143, ["terminated"]), out.stderr
    assert "Traceback" not in out.stderr and (tmp_path / "sweep" / "0" / "plan.json").exists()
