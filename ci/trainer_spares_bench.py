"""Four fresh trainers one after another, against a stand-in for the weight-sync routes,
with N trainer spares kept (the argument): what a test that needs fresh trainers pays.
Time two settings side by side with any whole-process timer, for example

    hyperfine -w 1 -r 3 '.venv/bin/python ci/trainer_spares_bench.py 0' \\
                        '.venv/bin/python ci/trainer_spares_bench.py 1'
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "tests")]

from harness import models  # noqa: E402
from harness.trainer.handle import SPARES, Trainer, TrainerSpec  # noqa: E402
from test_trainer_process import _serve_routes  # noqa: E402


def main(spares: int) -> None:
    srv, stop = _serve_routes()
    SPARES.count = spares
    model, logs = str(models.model_dir("llama")), tempfile.mkdtemp()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        for _ in range(4):
            t = Trainer(TrainerSpec.make(url=url, engine="shm", packed=True, timeout=10),
                        log_dir=logs)
            try:
                t.sync(model, timeout=120)
                time.sleep(5)  # the test's own work between two fresh trainers
            finally:
                t.close()
    finally:
        SPARES.close()
        stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
