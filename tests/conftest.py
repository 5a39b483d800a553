"""Shared fixtures live in one module per area, loaded here."""

import os

# Under pytest-xdist (`make test` runs TEST_JOBS processes) each process gets its share of the cores for
# torch's (OpenMP's) threads, it and the children it starts: two processes of two threads each on two cores
# spin in each other's barriers, and a 20 s test took 140 s. Set before anything imports torch.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // int(workers)))

pytest_plugins = [
    "tests.fixtures_engine",
    "tests.fixtures_world",
    "tests.fixtures_services",
    "tests.fixtures_worker",
]
