"""The main command's orchestration: the plan of stages and their DAG, and the runner that executes it.

May import anything in ``eagle_backbone`` and ``ldlp`` (it runs every stage package's scripts and reads their
outputs); nothing in ``eagle_backbone`` or ``ldlp`` imports it: it is the entry point above all packages, used by
``scripts/pipeline.py``, ``scripts/choose_contenders.py`` and the tests (``tests/test_layout.py`` checks both).

    stage.py       a Stage record, its fingerprint (stage.json next to its output)
    compose.py     Hydra composition of the stages' configs, and which overrides reach which stage
    plan.py        the stages in order, their inputs and outputs (the DAG), validate()
    contenders.py  the head to head's contenders, chosen from the sweeps and the tuning (the contenders stage)
    runner.py      StageRunner: skip, resume or run a stage; forward signals; the plan's preview
    processes.py   the folder lock, the watchdog, the parent-death signal
    main.py        run(): plan, preview, run, summarize, record and publish
"""

from ldlp.pipeline.compose import apply_overrides, forwarded, script_keys
from ldlp.pipeline.contenders import adaptive_contenders, choose, static_contenders
from ldlp.pipeline.main import check_models, run
from ldlp.pipeline.plan import bench_batch_stage, head_to_head_stages, plan, validate, with_cost_stage
from ldlp.pipeline.processes import LOCK, FolderLock, lock_folders, start_time
from ldlp.pipeline.runner import EXPECTED_S, StageFailed, StageRunner, force_level
from ldlp.pipeline.stage import (FINGERPRINT, Stage, changed_inputs, content_digest, fingerprint, output_digest,
                                 override_key, store_fingerprint, stored_fingerprint)

__all__ = ["EXPECTED_S", "FINGERPRINT", "LOCK", "FolderLock", "Stage", "StageFailed", "StageRunner",
           "adaptive_contenders", "apply_overrides", "bench_batch_stage", "changed_inputs", "check_models", "choose",
           "content_digest", "fingerprint", "force_level", "forwarded", "head_to_head_stages", "lock_folders",
           "output_digest", "override_key", "plan", "run", "script_keys", "start_time", "static_contenders",
           "store_fingerprint", "stored_fingerprint", "validate", "with_cost_stage"]
