"""Train the embedded byte-level BPE on the corpus's train split."""

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from eagle_backbone.data.tokenizer import train_bpe_tokenizer


@hydra.main(config_path="../conf", config_name="train_tokenizer", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    start(cfg)
    convs = json.loads((Path(cfg.corpus_dir) / "train.json").read_text())
    texts = (t["value"] for c in convs for t in c["conversations"])
    tok = train_bpe_tokenizer(texts, cfg.vocab_size, cfg.out_dir)
    print(f"saved a {len(tok)}-token tokenizer to {cfg.out_dir}")


if __name__ == "__main__":
    main()
