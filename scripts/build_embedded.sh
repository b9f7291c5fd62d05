#!/usr/bin/env bash
# Rebuild every embedded artefact from scratch, in order (about 2 hours on 2 CPU cores):
# corpus -> tokenizer -> target -> EAGLE drafter -> draft LM -> MODEL_CARD.md.
# Each training step checkpoints under data/embedded/work/ and resumes when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
$PY scripts/build_corpus.py
$PY scripts/train_tokenizer.py
$PY scripts/train_lm.py lm=embedded_target trainer.max_steps=900 hydra.run.dir=data/embedded/work/target_run
$PY scripts/train_drafter.py trainer.max_steps=700 hydra.run.dir=data/embedded/work/drafter_run
$PY scripts/train_lm.py lm=embedded_draft_lm trainer.max_steps=500 lr=2e-3 hydra.run.dir=data/embedded/work/draft_lm_run
$PY scripts/model_card.py
