"""What every script shares (scripts/_setup.py, eagle_backbone/runtime.py): the project's own errors end a script
in one line, a CUDA device torch lacks is refused at the start, and count settings are checked before any model
loads."""

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from eagle_backbone.data.conversations import load_conversations
from eagle_backbone.errors import ConfigError
from eagle_backbone.paths import REPO_ROOT
from eagle_backbone.runtime import check_device, int_list_setting, int_setting


def test_scripts_print_the_projects_own_value_errors_in_one_line(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    from _setup import one_line_errors

    @one_line_errors
    def main(fail):
        fail()

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    missing = lambda: load_conversations(REPO_ROOT / "no-such-prompts.json")  # noqa: E731  (a MissingInput)
    for fail in (lambda: int_setting("reps", 0, 1), lambda: (_ for _ in ()).throw(ConfigError("data.path=x: bad\nmore")),
                 missing):
        with pytest.raises(SystemExit) as e:
            main(fail)
        assert e.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")

    def library():  # a ValueError raised outside the project's code keeps its traceback
        raise ValueError("not ours")

    library.__code__ = library.__code__.replace(co_filename="/usr/lib/python3/somewhere.py")
    with pytest.raises(ValueError, match="not ours"):
        main(library)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="reps must be an integer"):
        main(lambda: int_setting("reps", 0, 1))


def test_a_cuda_device_on_a_torch_without_one_is_one_line(monkeypatch, capsys):
    """model.device=cuda where torch has no CUDA device: one error line at the script's start, before any model
    loads (torch's own failure is an assertion traceback); a script that only reads results is not refused."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    from _setup import start

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="model.device=cuda: .*torch.cuda.is_available\\(\\) is False.*model.device=cpu"):
        check_device("cuda")
    with pytest.raises(ValueError, match="model.device=gpu0: not a device"):
        check_device("gpu0")
    cfg = OmegaConf.create({"threads": None, "model": {"device": "cuda", "dtype": "float16", "target": "t"}})
    with pytest.raises(SystemExit) as e:
        start(cfg)
    assert str(e.value).startswith("error: model.device=cuda: ")
    start(cfg, loads_models=False)  # publishing a GPU run's pages on a CPU machine


@pytest.mark.parametrize("script, override, message", [
    ("profile_cost.py", "reps=0", "error: reps must be an integer >= 1, got 0 (conf/profile_cost.yaml)"),
    ("bench_attention.py", "reps=0", "error: reps must be an integer >= 1, got 0 (conf/bench_attention.yaml)"),
    ("bench_engine_ref.py", "concurrency=[]", "error: concurrency must be a non-empty list of integers >= 1, got []"),
])
def test_a_bad_count_is_one_line_before_any_model_loads(script, override, message, tmp_path):
    """One subprocess per script (their lists share int_list_setting, tested below). reps=0 used to end in
    statistics.StatisticsError, an empty list in 'max() arg is an empty sequence', both
    after the models loaded; a missing model folder shows that nothing was loaded first."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / script), override,
                          f"model.target={tmp_path / 'absent'}", f"model.drafter={tmp_path / 'absent'}",
                          f"model.tokenizer={tmp_path / 'absent'}",
                          f"out={tmp_path / 't.json'}" if script == "profile_cost.py" else f"out_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(message), out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_int_settings_refuse_in_one_line_naming_the_key():
    assert int_setting("reps", 3, 1) == 3 and int_list_setting("slots", [1, 2], 1, distinct=True) == [1, 2]
    for bad in (0, 1.5, True, None, "2"):
        with pytest.raises(ValueError, match="reps must be an integer >= 1"):
            int_setting("reps", bad, 1, "conf/x.yaml")
    for bad in ([], None, [0], [1, 1], [2.0]):
        with pytest.raises(ValueError, match="slots must be a non-empty list of distinct integers >= 1"):
            int_list_setting("slots", bad, 1, distinct=True)
