"""`dflash train CONFIG --check --check-data` reads the data as training would (what a deploy runs before it
touches the running job), and the trainer's final `done: step N` names the real last step."""

from __future__ import annotations

from dflash.cli import main

GOOD = '{"messages": [{"role": "user", "content": "count by 1 from w1"}, {"role": "assistant", "content": "w1 w2 w3"}]}\n'


def _with_data(tiny_dict, tmp_path, text):
    data = tmp_path / "train.jsonl"
    data.write_text(text)
    tiny_dict["data"] = {**tiny_dict["data"], "synthetic": None, "regenerate": None, "train_path": str(data)}
    tiny_dict["output_dir"] = str(tmp_path / "out")
    return data


def test_check_data_refuses_a_bad_line_that_check_alone_accepts(write_config, tiny_dict, tmp_path, capsys):
    data = _with_data(tiny_dict, tmp_path, GOOD + GOOD + '{"messages": [broken\n')
    config = str(write_config(tiny_dict))
    assert main(["train", config, "--check"]) == 0  # the config alone is fine
    capsys.readouterr()
    assert main(["train", config, "--check", "--check-data"]) == 3  # a data error (dflash/runtime/failures.py)
    err = capsys.readouterr().err
    assert err.startswith(f"dflash: error: {data}:3: malformed JSON") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing written


def test_check_data_counts_the_rows_of_good_data(write_config, tiny_dict, tmp_path, capsys):
    data = _with_data(tiny_dict, tmp_path, GOOD * 3)
    assert main(["train", str(write_config(tiny_dict)), "--check", "--check-data"]) == 0
    assert f"data OK: {data} (3 rows)" in capsys.readouterr().out


def test_done_names_the_real_last_step_when_logging_interval_does_not_divide_it(write_config, tiny_dict, tmp_path,
                                                                                capsys):
    tiny_dict["output_dir"] = str(tmp_path / "run")
    tiny_dict["data"]["synthetic"]["num_samples"] = 200
    tiny_dict["data"]["regenerate"] = None
    tiny_dict["optim"]["max_steps"] = 7
    tiny_dict["checkpoint"]["interval"] = 7
    tiny_dict["logging"]["interval"] = 3  # last logging record at step 6
    assert main(["train", str(write_config(tiny_dict))]) == 0
    out = capsys.readouterr().out
    assert "done: step 7" in out and "done: step 6" not in out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip().endswith("step-00000007")
