"""Reports kept gzip-compressed (``.json.gz``, as reports/ keeps them) read the same as
the plain ``.json`` they came from, in every command that reads reports: harness diff,
merge, matrix, durations, bench files, and the known-issues verifier. Gzip is told by
its first bytes, so a compressed file under a plain name reads too."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from harness import known_issues as ki
from harness.commands import cli, diff, matrix
from harness.commands import durations as durations_cmd
from harness.commands.bench import benchfile
from harness.core import reportfile
from harness.known_issues import cli as kcli
from harness.known_issues import verify as kv

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "reports" / "cpu-shard-e2e"  # one run, whole and as two shards merged


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each committed report of the sharded run, plain (``NAME.json``) and compressed
    (``NAME.json.gz``), in one folder."""
    d = tmp_path_factory.mktemp("runs")
    out = {}
    for name in ("unsharded", "shard-1", "shard-2", "merged"):
        text = reportfile.read_text(E2E / f"{name}.json.gz")
        (d / f"{name}.json").write_text(text)
        (d / f"{name}.json.gz").write_bytes(gzip.compress(text.encode(), 9))
        out[name] = (str(d / f"{name}.json"), str(d / f"{name}.json.gz"))
    return out


def test_the_committed_reports_are_gzip():
    assert (E2E / "merged.json.gz").read_bytes()[:2] == reportfile.GZIP_MAGIC


def test_diff_reads_a_compressed_report(runs, capsys):
    (whole, whole_gz), (merged, merged_gz) = runs["unsharded"], runs["merged"]
    assert diff.main([whole, merged, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert diff.main([whole_gz, merged_gz, "--json"]) == 0
    compressed = json.loads(capsys.readouterr().out)
    assert compressed["tests"] == plain["tests"]
    assert compressed["regressions"] == plain["regressions"] == []
    assert diff.main([whole_gz, merged]) == 0  # one of each


def test_merge_reads_compressed_shards(runs, tmp_path, capsys):
    out_plain, out_gz = tmp_path / "plain.json", tmp_path / "from-gz.json"
    assert cli.main(["merge", runs["shard-1"][0], runs["shard-2"][0], "-o", str(out_plain)]) == 0
    assert cli.main(["merge", runs["shard-1"][1], runs["shard-2"][1], "-o", str(out_gz)]) == 0
    capsys.readouterr()
    plain, from_gz = json.loads(out_plain.read_text()), json.loads(out_gz.read_text())
    assert from_gz["summary"] == plain["summary"]
    assert [t["nodeid"] for t in from_gz["tests"]] == [t["nodeid"] for t in plain["tests"]]


def test_matrix_and_durations_read_a_compressed_report(runs):
    plain, gz = runs["unsharded"]
    assert matrix.render(matrix.load([gz])) == matrix.render(matrix.load([plain]))
    assert durations_cmd.load(gz) == durations_cmd.load(plain)


def test_the_known_issues_verifier_reads_compressed_reports(runs, capsys):
    plain, gz = runs["unsharded"]
    assert kv.load_report(gz) == kv.load_report(plain)
    issues = ki.load(ki.DEFAULT_PATH)
    assert kv.verify(issues, [("r", kv.load_report(gz))]) == \
        kv.verify(issues, [("r", kv.load_report(plain))])
    # the command over a compressed report exits as over the plain one
    code_plain = kcli.main(["verify", plain])
    out_plain = capsys.readouterr().out
    assert kcli.main(["verify", gz]) == code_plain
    assert capsys.readouterr().out == out_plain.replace(plain, gz)


def test_a_bench_file_reads_compressed(tmp_path):
    src = ROOT / "reports" / "bench" / "cpu" / "bench.json"
    gz = tmp_path / "bench.json.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    assert benchfile.load(gz) == benchfile.load(src)
    assert diff.file_kind(gz) == benchfile.KIND


def test_gzip_is_told_by_its_bytes_not_its_name(runs, tmp_path):
    plain, gz = runs["merged"]
    renamed = tmp_path / "merged-compressed.json"  # gzip under a plain name
    renamed.write_bytes(Path(gz).read_bytes())
    mislabelled = tmp_path / "merged-plain.json.gz"  # plain text under a .gz name
    mislabelled.write_text(Path(plain).read_text())
    want = Path(plain).read_text()
    assert reportfile.read_text(renamed) == reportfile.read_text(mislabelled) == want


def test_a_damaged_gzip_is_one_clear_line(runs, tmp_path, capsys):
    cut = tmp_path / "cut.json.gz"
    data = Path(runs["merged"][1]).read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    assert diff.main([str(cut), runs["merged"][0]]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {cut}: a damaged gzip file" in err and err.count("\n") == 1, err
    assert kcli.main(["verify", str(cut)]) == 2
    assert f"cannot read {cut}: a damaged gzip file" in capsys.readouterr().err
    with pytest.raises(matrix.BadInput, match="damaged gzip"):
        matrix.load([str(cut)])
