"""The command line: check compiles every kernel, demo round-trips, errors are one line."""
import subprocess
import sys


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


def test_check_fails_on_a_compile_error(tmp_path, monkeypatch):
    """A broken kernel makes check exit non-zero (the loader is pointed at a copy with a bad file)."""
    import shutil

    from kvlab.cuda import loader

    src = loader.kernels_dir()
    bad = tmp_path / "kernels_cu"
    shutil.copytree(src, bad)
    (bad / "nibble.cu").write_text((bad / "nibble.cu").read_text() + "\n__global__ void broken() { int x = ; }\n")
    monkeypatch.setattr(loader, "kernels_dir", lambda: bad)
    from kvlab.cli_check import run_check

    assert run_check(("sm_90",), verbose=False) == 1


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
