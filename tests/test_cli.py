"""The command line: check compiles every kernel, demo round-trips, errors are one line."""
import subprocess
import sys
import time

import pytest


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_check_compiles_every_kernel_for_sm90_and_sm80():
    r = run("check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nvrtc" in r.stdout and "cuda_headers" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("compiled ") and last.endswith("sm_90, sm_80: OK"), last
    print(last)


def test_check_fails_on_a_compile_error(tmp_path, monkeypatch, capsys):
    """A broken kernel makes check exit non-zero (the loader is pointed at a copy of the headers and
    of one family, nibble.cu, with a bad line: check compiles the families it finds there)."""
    import shutil

    from kvlab.cuda import loader

    src = loader.kernels_dir()
    bad = tmp_path / "kernels_cu"
    bad.mkdir()
    for h in src.glob("*.cuh"):
        shutil.copy(h, bad / h.name)
    (bad / "nibble.cu").write_text((src / "nibble.cu").read_text() + "\n__global__ void broken() { int x = ; }\n")
    monkeypatch.setattr(loader, "kernels_dir", lambda: bad)
    from kvlab.cli_check import run_check

    assert run_check(("sm_90",), verbose=False) == 1
    out = capsys.readouterr()
    assert "nibble" in out.err and "COMPILE ERROR" in out.err
    assert out.out.strip().splitlines()[-1].endswith("FAILED (1 families)")


@pytest.mark.parametrize("version, noted", [((13, 0), True), ((13, 4), True), ((13, 5), False), ((14, 0), False)])
def test_check_names_an_nvrtc_older_than_the_tuned_one(monkeypatch, version, noted):
    """Under an NVRTC older than the one the register bounds are tuned with, check's environment
    says why some kernels spill there; under 13.5 and later it says nothing more."""
    from cupy.cuda import nvrtc

    from kvlab import cli_check

    monkeypatch.setattr(nvrtc, "getVersion", lambda: version)
    info = cli_check.environment()
    assert info["nvrtc"] == "%d.%d" % version
    assert ("nvrtc_note" in info) is noted
    if noted:
        assert "13.5" in info["nvrtc_note"] and "spill" in info["nvrtc_note"]


def test_demo_runs():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    assert "int4_per_token_head" in r.stdout and "nvfp4" in r.stdout


def test_bad_arguments_are_one_line_errors():
    r = run("check", "--arch", "sm_12345")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    r = run("frobnicate")
    assert r.returncode == 2 and "Traceback" not in r.stderr


# ---- bad arguments: one line naming the option, exit code 2 (1 for a missing GPU), nothing run ----
def _one_line_error(r, cmd, *words):
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr, r.stderr
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"kvlab {cmd}: "), err
    for w in words:
        assert w in err, (w, err)
    return err


def test_check_rejects_a_bad_arch_before_compiling():
    for arch, words in (("sm_12345", ("--arch", "'sm_12345'")), ("hopper", ("--arch", "'hopper'")),
                        ("sm_10", ("--arch", "'sm_10'"))):
        r = run("check", "--arch", arch, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        _one_line_error(r, "check", *words)
        assert "instantiation" not in r.stdout  # nothing was compiled


@pytest.mark.parametrize("args, words", [
    (("--format", "int5"), ("--format", "'int5'", "int4_per_token_head")),
    (("--head-size", "100"), ("--head-size", "100")),
    (("--tokens", "0"), ("--tokens", "0")),
    (("--heads", "-2"), ("--heads", "-2")),
    (("--block-size", "0"), ("--block-size", "0")),
    (("--seed", "-1"), ("--seed", "-1")),
])
def test_demo_rejects(capsys, args, words):
    from kvlab.__main__ import main

    assert main(["demo", *args]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing ran
    err = out.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvlab demo: error: "), err
    for w in words:
        assert w in err, (w, err)


def test_demo_with_one_format_and_small_sizes(capsys):
    from kvlab.__main__ import main

    assert main(["demo", "--format", "nvfp4", "--tokens", "5", "--heads", "2", "--head-size", "64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[1].split()[0] == "nvfp4" and lines[1].split()[1] == "36"


@pytest.mark.parametrize("cmd", ["report", "bench"])
def test_bad_output_folder_fails_at_once(tmp_path, cmd):
    f = tmp_path / "a_file"
    f.write_text("x")
    for out, words in ((f, ("--out", "existing file")), (f / "sub", ("--out", "is a file"))):
        t0 = time.time()
        r = run(cmd, "--quick", "--out", str(out), timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        _one_line_error(r, cmd, *words)
        assert time.time() - t0 < 60  # before loading a model or touching a GPU
    assert f.read_text() == "x"


def test_report_rejects_an_empty_model_name(capsys, tmp_path):
    from kvlab.__main__ import main

    assert main(["report", "--quick", "--model", " ", "--out", str(tmp_path / "r")]) == 2
    assert "--model" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_bench_rejects_an_unknown_suite_with_or_without_gpu(tmp_path):
    r = run("bench", "nosuchsuite", "--out", str(tmp_path / "b"), timeout=120)
    assert r.returncode == 2
    _one_line_error(r, "bench", "nosuchsuite", "write")
    assert not (tmp_path / "b").exists()


def test_bench_without_gpu_is_one_line_and_exit_1(tmp_path):
    from kvlab.bench.cli import gpu_or_none

    if gpu_or_none() is not None:
        pytest.skip("a GPU is visible: the no-GPU path cannot be exercised here")
    r = run("bench", "write", "--quick", "--out", str(tmp_path / "b"), timeout=120)
    assert r.returncode == 1
    _one_line_error(r, "bench", "no CUDA GPU")
    assert not (tmp_path / "b").exists()


def test_attention_bench_grids_cover_the_issue_shapes():
    """Issue 4's benchmark grid: 32/8 heads at d = 128 and 64, the shipped model's 9/3 at d = 64;
    decode batch 1/8/32/64 × 1k–128k, prefill 4k and 16k; --quick keeps the target shapes."""
    from kvlab.bench import suite_decode, suite_prefill

    pf = {(hq, hkv, d): set(lengths) for hq, hkv, d, lengths in suite_prefill._grid(False)}
    assert pf[(32, 8, 128)] == {4096, 16384} and pf[(9, 3, 64)] == {4096, 16384} and (32, 8, 64) in pf
    assert suite_prefill._grid(True) == [(32, 8, 128, (4096,))]
    dec = dict(suite_decode._grid(False))
    assert {b for b, _ in dec[(32, 8, 128)]} == {1, 8, 32, 64}
    assert {c for _, c in dec[(32, 8, 128)]} >= {1024, 8192, 32768, 131072}
    assert (9, 3, 64) in dec and (32, 8, 64) in dec
    assert dict(suite_decode._grid(True))[(32, 8, 128)] == [(32, 8192), (1, 131072), (64, 4096)]


def test_bench_l2_flush_mode(monkeypatch):
    """KVLAB_BENCH_L2 picks how the timer's cold-L2 flush leaves the L2 (dirty by default,
    clean = write-backs before the start event); a typo is an error, not a silent default."""
    from kvlab.bench.timing import l2_flush_mode

    monkeypatch.delenv("KVLAB_BENCH_L2", raising=False)
    assert l2_flush_mode() == "dirty"
    monkeypatch.setenv("KVLAB_BENCH_L2", "clean")
    assert l2_flush_mode() == "clean"
    monkeypatch.setenv("KVLAB_BENCH_L2", "cleen")
    with pytest.raises(ValueError, match="KVLAB_BENCH_L2"):
        l2_flush_mode()
