"""The bench scripts' shared helpers: bench/lib.py's `record` and bench/lib.sh's preamble (the scripts themselves
run on the GPU machine: docs/PERFORMANCE.md)."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_lib", ROOT / "bench" / "lib.py")
bench_lib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_lib)


def test_record_adds_a_section_to_the_file(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"earlier": {"x": 1}}))
    bench_lib.record(path, "drafter", {"tokens_per_s": 2.5})
    bench_lib.record(path, "drafter", {"tokens_per_s": 3.0})
    assert json.loads(path.read_text()) == {"earlier": {"x": 1}, "drafter": {"tokens_per_s": 3.0}}
    assert capsys.readouterr().out.splitlines()[-1] == '[drafter] {"tokens_per_s": 3.0}'


def test_record_with_this_runs_sections_replaces_the_file(tmp_path):
    path = tmp_path / "target_forward.json"
    path.write_text(json.dumps({"stale": {}}))
    results: dict = {"attention": {"ms": 1}}
    bench_lib.record(path, "gemms", {"ms": 2}, results)
    assert results == {"attention": {"ms": 1}, "gemms": {"ms": 2}}
    assert json.loads(path.read_text()) == results


def _preamble(tmp_path, env: dict, *args: str) -> list[str]:
    script = tmp_path / "probe.sh"
    script.write_text(f'. "{ROOT}/bench/lib.sh" "$PWD/out-default" "$PWD/runs-default"\n'
                      'echo "$out|$runs|$#|$*|$PYTHONPATH|$PYTHONUNBUFFERED|$-"\n'
                      'echo "$undefined_variable"\necho "not reached"\n')
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "RUNS_DIR", "PYTHONPATH")}
    done = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env={**base, **env}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "undefined_variable" in done.stderr  # -u is on
    return done.stdout.splitlines()


def test_preamble_defaults_make_the_folders_and_keep_the_arguments(tmp_path):
    (line,) = _preamble(tmp_path, {}, "cfg.yaml", "a b")
    out, runs, argc, argv, pythonpath, unbuffered, flags = line.split("|")
    assert (out, runs) == (f"{tmp_path}/out-default", f"{tmp_path}/runs-default")
    assert Path(out).is_dir() and Path(runs).is_dir()
    assert (argc, argv) == ("2", "cfg.yaml a b")
    assert (pythonpath, unbuffered) == (str(tmp_path), "1")
    assert "u" in flags and "e" not in flags


def test_preamble_takes_out_and_runs_dir_from_the_environment(tmp_path):
    (line,) = _preamble(tmp_path, {"OUT": str(tmp_path / "o"), "RUNS_DIR": str(tmp_path / "r"),
                                   "PYTHONPATH": "/elsewhere"})
    out, runs, argc, _, pythonpath, _, _ = line.split("|")
    assert (out, runs, argc) == (str(tmp_path / "o"), str(tmp_path / "r"), "0")
    assert Path(out).is_dir() and Path(runs).is_dir()
    assert pythonpath == f"{tmp_path}:/elsewhere"


def test_config_and_list_takes_the_first_argument_and_the_rest_or_the_defaults(tmp_path):
    script = tmp_path / "args.sh"
    script.write_text(f'. "{ROOT}/bench/lib.sh" "$PWD/out" "$PWD/runs"\n'
                      'config_and_list default.yaml "a b" "$@"\necho "$cfg|$list|$#"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RUNS_DIR")}

    def run(*args: str) -> str:
        done = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run() == "default.yaml|a b|0"
    assert run("x.yaml") == "x.yaml|a b|1"
    assert run("x.yaml", "c", "d e") == "x.yaml|c d e|3"
    assert run("") == "default.yaml|a b|1"
