"""Publishing (ldlp/report/publish.py): one finished run's whole result, and nothing else, from paths.results to
the committed paths.published, or a one-line refusal before anything is copied."""

import hashlib
import json

import pytest
from conftest import a_run, one_line

from eagle_backbone.errors import ConfigError
from eagle_backbone.paths import REPO_ROOT
from ldlp.report.publish import (PUBLISHED_FILES, check_publishable, group_files, headline_block, prune_published,
                                 publish, publish_run, write_run_manifest)


def test_publishing_takes_one_complete_run_of_this_model_or_refuses(tmp_path):
    assert set(group_files()) == set(PUBLISHED_FILES)  # the check covers every file publish copies
    published, readme = tmp_path / "published", tmp_path / "README.md"
    readme.write_text("# r\n")
    old = a_run(tmp_path / "old")
    publish(old, published, readme, None, "m", "cmd")
    assert (published / "tuning" / "tuning.json").is_file()
    # a newer run without tuning: the older run's tuning is removed, not linked from the new page
    new = a_run(tmp_path / "new", tuning=False)
    files = check_publishable(new, "m")
    assert prune_published(published, files) == ["tuning/tuning.md", "tuning/tuning.json"]
    publish(new, published, readme, None, "m", "cmd")
    assert not (published / "tuning").exists() or not any((published / "tuning").iterdir())
    assert not [f for f in json.loads((published / "manifest.json").read_text())["files"] if f.startswith("tuning/")]
    # refused, in one line, before anything is copied
    bad = {"another model": (a_run(tmp_path / "other", model="vicuna"), "not model.name=m"),
           "an unfinished sweep": (a_run(tmp_path / "stopped", sweep_complete=False), "unfinished load sweep"),
           "no run": (tmp_path / "nothing", "missing results.md")}
    half = a_run(tmp_path / "half")
    (half / "tuning" / "tuning.json").unlink()
    bad["half a group"] = (half, "tuning is incomplete")
    for case, (folder, why) in bad.items():
        with pytest.raises(ConfigError) as e:
            check_publishable(folder, "m")
        assert why in one_line(e), case
    # both ways of publishing (publish_results.py, the main command's publish=true) go through publish_run
    before = sorted(p.relative_to(published) for p in published.rglob("*"))
    with pytest.raises(ConfigError, match="not model.name=m"):
        publish_run(bad["another model"][0], published, readme, None, "m", "cmd")
    assert sorted(p.relative_to(published) for p in published.rglob("*")) == before  # nothing copied or removed
    assert any("published" in line for line in publish_run(old, published, readme, None, "m", "cmd"))
    assert (published / "tuning" / "tuning.json").is_file()


def test_publishing_takes_only_the_stages_this_run_had_and_lists_what_it_wrote(tmp_path):
    """A run with bench_batch.enabled=false over the folder of an earlier run with a load sweep: the earlier load
    sweep (page, plots, runs file) is neither published nor timed nor linked, the earlier publish's files are
    removed, and manifest.json lists exactly what this publish wrote."""
    published, readme = tmp_path / "published", tmp_path / "README.md"
    readme.write_text("# r\n")
    results = a_run(tmp_path / "results")  # an earlier run: tuning and load sweep
    publish_run(results, published, readme, None, "m", "cmd")
    assert (published / "load_sweep" / "batch_bench_runs.json").is_file()  # every file of the group
    manifest = json.loads((published / "manifest.json").read_text())
    assert "load_sweep/batch_bench_runs.json" in manifest["files"]
    (published / "other.md").write_text("a page of another script")  # not the main command's: left alone
    # the next run has no load sweep; its files from the earlier run stay in the results folder
    write_run_manifest(results, "m", ["corpus", "oracle", "tune"], {"corpus": 1.0, "oracle": 2.0, "tune": 3.0})
    (results / "stage_seconds.json").write_text(json.dumps({"corpus": 1.0, "bench_batch": 99.0}))
    lines = publish_run(results, published, readme, None, "m", "cmd")
    assert not (published / "load_sweep").exists() or not any((published / "load_sweep").iterdir())
    assert any("not published: load sweep" in line for line in lines)
    assert json.loads((published / "stage_seconds.json").read_text()) == {"corpus": 1.0, "oracle": 2.0, "tune": 3.0}
    manifest = json.loads((published / "manifest.json").read_text())
    on_disk = {str(p.relative_to(published)) for p in published.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {"manifest.json", "other.md"}
    for f, digest in manifest["files"].items():
        assert hashlib.sha256((published / f).read_bytes()).hexdigest() == digest
    assert (published / "other.md").is_file()
    # rewriting the page from the committed files (results=<the published folder>) keeps them as they are
    before = {f: (published / f).read_bytes() for f in manifest["files"] if f != "README.md"}
    publish_run(published, published, readme, None, "m", "cmd")
    assert {f: (published / f).read_bytes() for f in before} == before


def test_publishing_a_folder_no_main_command_finished_is_refused(tmp_path):
    results = a_run(tmp_path / "results")
    (results / "run.json").unlink()
    with pytest.raises(ConfigError) as e:
        publish_run(results, tmp_path / "published", tmp_path / "README.md", None, "m", "cmd")
    assert "no run.json" in one_line(e) and not (tmp_path / "published").exists()


def test_the_publish_script_does_not_import_the_orchestrator():
    text = (REPO_ROOT / "scripts" / "publish_results.py").read_text()
    assert "ldlp.pipeline" not in text and "ldlp.report.publish" in text


def test_the_results_page_and_the_readme_block_render(tmp_path):
    """The two pages a publish writes render, each with its headline; what goes on them is the files, stage seconds
    and head-to-head rows the tests above check."""
    published, readme = tmp_path / "published", tmp_path / "README.md"
    readme.write_text("# r\n<!-- results:start -->\n<!-- results:end -->\n")
    lines = publish_run(a_run(tmp_path / "results"), published, readme, None, "m", "cmd")
    assert any("updated the results block" in line for line in lines)
    assert (published / "README.md").read_text().startswith("# Results: m\n")
    h2h = {"reference": "static γ=6", "n_prompts": 56, "n_dropped": 0, "rounds": 2,
           "rows": [{"contender": "static γ=6", "tau": 3.0, "tokens_per_s": 20.0},
                    {"contender": "ldlp", "tau": 3.2, "tokens_per_s": 21.0, "vs_best_static": 1.05, "ci95": [1.0, 1.1]},
                    {"contender": "AR", "tau": 1.0, "tokens_per_s": 8.0}]}
    block = headline_block({"headline": {"m": {"head_to_head": h2h}}}, "m", "cmd", "p.md")
    assert block.startswith("Generated by `cmd`")
