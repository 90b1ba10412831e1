"""Init container of the gateway pod: write the text endpoint's tokenizer for the gateway's --tokenizer.

    python3 /scripts/gateway-tokenizer.py --model BAAI/bge-large-zh-v1.5 --out /tokenizer/bge_large_zh \
        --cache-dir /scratch/cache

The gateway counts usage and truncates (truncate=START) with the server's own tokenizer. In the base, each
Triton pod exports into its own emptyDir, which the gateway pods cannot read, so this writes the same files the
exporter writes to MODEL_REPOSITORY/<name>/1/tokenizer, with the exporter's own code (bge_triton.export:
resolve --model, load the fast tokenizer at the export's max length, save it): for a hub id it downloads the
tokenizer and config files only (no weights); `synthetic:...` and local directories resolve as the export does.
Runs on the kit image (deploy/Dockerfile.kit), shipped as the ConfigMap `gateway-tokenizer` (kustomization.yaml).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# what a fast tokenizer and inspect_model (max length, pooling) read; never the weights
HUB_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
             "sentence_bert_config.json", "modules.json", "1_Pooling/config.json"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the export's --model (hub id, local dir or synthetic:...)")
    p.add_argument("--out", required=True, type=Path,
                   help="tokenizer dir to write, replaced (the gateway's --tokenizer): a folder below a volume's mount")
    p.add_argument("--cache-dir", required=True, type=Path, help="writable dir for synthetic models")
    p.add_argument("--max-length", type=int, default=None, help="the export's --max-length, if it set one")
    a = p.parse_args(argv)

    from bge_triton.errors import KitError
    from bge_triton.export.settings import SYNTHETIC_PREFIX, ExportSettings
    from bge_triton.export.source import inspect_model, load_tokenizer
    from bge_triton.export.writer import write_tokenizer

    model = a.model
    is_hub_id = not model.startswith((SYNTHETIC_PREFIX, "/", ".", "~")) and model.count("/") == 1 \
        and not Path(model).exists()
    if is_hub_id:
        from huggingface_hub import snapshot_download

        print(f"gateway-tokenizer: fetching the tokenizer files of {model} (no weights)", flush=True)
        snapshot_download(model, allow_patterns=HUB_FILES)
    try:
        settings = ExportSettings(model=model, repository=a.out, name="gateway", cache_dir=a.cache_dir,
                                  max_length=a.max_length)
        source = inspect_model(settings)
        write_tokenizer(load_tokenizer(source), a.out, source.synthetic)
    except KitError as err:
        print(f"gateway-tokenizer: {err}", file=sys.stderr)
        return 2
    print(f"gateway-tokenizer: wrote the tokenizer of {source.label} (max {source.max_length} tokens) to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
