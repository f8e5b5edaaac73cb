"""Recording a few training steps with torch.profiler: a Chrome trace in the run directory, and the top kernels
by device time (CPU time on a CPU-only machine) printed when the recording ends."""
import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

logger = logging.getLogger(__name__)
TOP_KERNELS = 15


class StepProfiler:
    """Call `step()` after every optimizer step: skips one step (warm-up), records `steps`, then stops."""

    def __init__(self, run_dir: str | Path, steps: int):
        self.trace = Path(run_dir) / "profile" / "trace.json"
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.on_cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        self.profiler = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                                on_trace_ready=self._report)
        self.profiler.start()
        self.running = True

    def step(self) -> None:
        if self.running:
            self.profiler.step()
            if not self.running:  # the report ran: the recording is over
                self.profiler.stop()

    def stop(self) -> None:
        """Ends the recording early (the run had fewer steps left than asked for)."""
        if self.running:
            self.profiler.stop()
            self.running = False

    def _report(self, prof: profile) -> None:
        prof.export_chrome_trace(str(self.trace))
        sort_by = "self_cuda_time_total" if self.on_cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=TOP_KERNELS)
        logger.info("profile: Chrome trace in %s (open in https://ui.perfetto.dev); top %d by %s:\n%s",
                    self.trace, TOP_KERNELS, sort_by, table)
        self.running = False
